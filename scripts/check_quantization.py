"""What bfloat16, weight-only int8 and int4, and a GGUF file's own quantization cost in accuracy against float32,
on the same prompts and text. For `--model FILE.gguf`, float32 is the file's weights dequantized (what transformers
runs on the same file), so `gguf` measures the kernels on the file's blocks against that reference.

Greedy agreement: each prompt generated greedily (through the engine, PP=1) in float32 and in the other
setting; reported per prompt as the number of leading tokens that agree, and overall as the share of tokens
before the first difference. Log-likelihood: the mean negative log-likelihood per token of a fixed text (one
forward over the whole text, no cache), and its perplexity; and the same text scored as `llama-perplexity -c 32`
scores it (`llama-perplexity -m FILE.gguf -f text.txt -c 32`, the text written by `--write-text`), whose forwards
of 32 rows run the GGUF kernels.

    python scripts/check_quantization.py --max-tokens 64
    python scripts/check_quantization.py --model smollm2-q4_k_m.gguf --only gguf
"""

from __future__ import annotations

import argparse
import math

import torch

from ringsched import Engine
from ringsched.attention.paged import ForwardBatch
from ringsched.layout.rank import StageInfo
from ringsched.models.loader import load_stage_model
from ringsched.sampling.params import SamplingParams
from ringsched.tokenizer import Tokenizer
from ringsched.weights.fetch import resolve_model

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
    "List three prime numbers greater than 100:",
    "Once upon a time, in a small village,",
    "Translate to French: I would like a cup of coffee.",
    "The quick brown fox",
]
TEXT = (
    "Pipeline parallelism cuts a model by layers into stages. Each stage holds its layers' weights and its own "
    "cache of keys and values, and the stages pass activations along a ring. While one micro-batch is on the "
    "second stage, the first stage already works on the next, so every stage stays busy once the ring is full. "
    "The price is latency: a token passes through every stage in turn before the next one can be decoded."
)
WINDOW = 32  # tokens a forward: within the GGUF kernels' rows
SETTINGS = {"bfloat16": {"dtype": "bfloat16", "quantization": "none"}, "int8": {"quantization": "int8"},
            "int4": {"quantization": "int4"}, "gguf": {"quantization": "gguf"}}  # fmt: skip


def generate(model: str, settings: dict, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Engine(model, threads_per_stage=2, **settings) as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, params)]


@torch.inference_mode()
def nll(model: str, dtype: torch.dtype, quantization: str) -> tuple[float, float]:
    """The text's mean negative log-likelihood per token: over the whole text in one forward, and scored as
    `llama-perplexity -c WINDOW` scores it (windows of WINDOW tokens, each its own forward, each scoring its second
    half), whose forwards of WINDOW rows run the quantized kernels rather than a dequantized weight."""
    model_dir = resolve_model(model)
    ids = torch.tensor(Tokenizer(model_dir).encode(TEXT))
    m = load_stage_model(model_dir, StageInfo(0, 1, 0, _layers(model_dir)), dtype, quantization=quantization)

    def logp(tokens: torch.Tensor) -> torch.Tensor:
        hidden = m(ForwardBatch.no_cache(len(tokens)), input_ids=tokens)
        return torch.log_softmax(m.compute_logits(hidden).float(), dim=-1)[:-1].gather(1, tokens[1:, None])[:, 0]

    half = WINDOW // 2
    windows = [logp(ids[s : s + WINDOW])[half:] for s in range(0, len(ids) - WINDOW + 1, WINDOW)]
    return -logp(ids).mean().item(), -torch.cat(windows).mean().item()


def _layers(model_dir) -> int:
    from ringsched.weights.model_config import ModelConfig

    return ModelConfig.from_dir(model_dir).num_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--only", choices=list(SETTINGS), action="append", help="these settings only (default: all)")
    ap.add_argument("--write-text", metavar="PATH", help="write the fixed text to PATH (for llama-perplexity) and exit")
    args = ap.parse_args()
    if args.write_text:
        open(args.write_text, "w").write(TEXT)
        return
    base = generate(args.model, {"quantization": "none"}, args.max_tokens)
    base_nll, base_windowed = nll(args.model, torch.float32, "none")
    print(
        f"float32: NLL {base_nll:.4f} per token, perplexity {math.exp(base_nll):.3f}; in windows of {WINDOW} "
        f"{base_windowed:.4f}, perplexity {math.exp(base_windowed):.3f}"
    )
    for name, settings in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        other = generate(args.model, settings, args.max_tokens)
        pairs = list(zip(base, other, strict=True))
        lead = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), len(x)) for x, y in pairs]
        same = sum(x == y for x, y in pairs)
        dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
        value, windowed = nll(args.model, dtype, settings.get("quantization", "none"))
        print(f"{name}: {same}/{len(PROMPTS)} prompts identical for {args.max_tokens} tokens; leading tokens in "
              f"agreement {lead} ({sum(lead) / (len(lead) * args.max_tokens):.0%}); NLL {value:.4f} "
              f"({value - base_nll:+.4f}), perplexity {math.exp(value):.3f}; in windows of {WINDOW} {windowed:.4f} "
              f"({windowed - base_windowed:+.4f}), perplexity {math.exp(windowed):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
