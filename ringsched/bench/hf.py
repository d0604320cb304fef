"""`python -m ringsched.bench hf`: transformers on the requests `bench offline` runs, as the baseline to beat.

The prompts are `bench offline`'s exactly (same seed, same draw order: its warmup prompts first, then the
measured ones), every request generates exactly `--output-len` tokens, greedy. Two modes are measured:

- `generate` with static batches of each `--batch-sizes` entry (all prompts have one length: no padding);
- `generate_batch`, transformers' continuous batching (paged KV cache, requests join and leave per step).

The contract: output tokens/s of each mode, the best overall, and the number of tokens each mode really
produced (a mode that stops early would otherwise look fast). A `generate_batch` failure is reported as
`{"error": ...}` in the result instead of ending the run; `--no-generate-batch` leaves that mode out (it takes
several times as long as the static batches on CPU) and reports it as null.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from typing import TYPE_CHECKING

from ringsched.bench.offline import _prompts
from ringsched.config import DEFAULT_MODEL
from ringsched.weights.fetch import resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def add_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model directory or known name (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2: this machine's cores)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed, as `bench offline --seed`")
    p.add_argument("--batch-sizes", default="8,16,32,64", help="static batch sizes for `generate`, comma-separated")
    p.add_argument(
        "--warmup-prompts",
        type=int,
        default=8,
        help="drawn first, as in `bench offline`; a few of them run a short unmeasured generate (0: none)",
    )
    p.add_argument(
        "--cb-max-batch-tokens",
        type=int,
        default=512,
        help="generate_batch tokens per step (default: ringsched's --chunked-prefill-size)",
    )
    p.add_argument(
        "--generate-batch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure generate_batch (continuous batching; on CPU the slowest mode by far)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"error: --batch-sizes {text!r} must be positive integers separated by commas, e.g. 8,32")
    return sizes


def load_model(spec: str, dtype: str) -> PreTrainedModel:
    """ringsched's model directory (Hugging Face layout: config.json + model.safetensors) through transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(spec, quiet=False)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()


def _generate_once(model: PreTrainedModel, prompts: list[list[int]], batch_size: int, out_len: int) -> list[list[int]]:
    """New tokens of each prompt, `batch_size` prompts per `generate` call."""
    import torch

    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos  # only to silence generate's "setting pad_token_id" warning
    new_tokens = []
    for i in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[i : i + batch_size])  # [B, input_len]; one length, so no padding
        # min_new_tokens suppresses EOS until out_len: every request produces exactly out_len tokens.
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
            pad_token_id=pad,
        )
        new_tokens += out[:, ids.shape[1] :].tolist()  # [B, out_len]
    return new_tokens


def bench_generate(model: PreTrainedModel, prompts: list[list[int]], batch_sizes: list[int], out_len: int) -> dict:
    per_size, tokens, last = {}, {}, []
    for bs in batch_sizes:
        start = time.perf_counter()
        last = _generate_once(model, prompts, bs, out_len)
        elapsed = time.perf_counter() - start
        tokens[bs] = sum(len(t) for t in last)
        per_size[bs] = tokens[bs] / elapsed
        print(f"  generate batch {bs}: {per_size[bs]:.1f} output tok/s ({tokens[bs]} tokens in {elapsed:.1f}s)")
    best = max(per_size, key=per_size.get)
    return {
        "per_batch_size": per_size,
        "output_tokens": tokens,
        "best_batch_size": best,
        "best_output_tokens_per_s": per_size[best],
        "_new_tokens": last,
    }


def _cb_configs(n: int, in_len: int, out_len: int, max_batch_tokens: int):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    # eos_token_id=-1 disables EOS (generate_batch ignores min_new_tokens): exactly out_len tokens per request.
    gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    # Left unset, num_blocks is sized from free memory; on CPU that zeroes 60% of the RAM for the cache. Size it
    # for the workload instead: every request's prompt and output at once (one block = page_size tokens).
    cb.num_blocks = n * math.ceil((in_len + out_len) / cb.page_size)
    return gen, cb


def _run_generate_batch(model: PreTrainedModel, prompts: list[list[int]], out_len: int, max_batch_tokens: int):
    """(new tokens per prompt, seconds, first error or None)."""
    gen, cb = _cb_configs(len(prompts), len(prompts[0]), out_len, max_batch_tokens)
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    elapsed = time.perf_counter() - start
    outs = list(results.values())  # in the order of `prompts`
    # generate_batch logs and swallows errors in its loop: failures show as missing or errored results.
    errors = [o.error for o in outs if o.error is not None]
    if errors or len(outs) != len(prompts):
        return [], elapsed, errors[0] if errors else f"only {len(outs)} of {len(prompts)} requests came back"
    return [list(o.generated_tokens) for o in outs], elapsed, None


def bench_generate_batch(
    model: PreTrainedModel, prompts: list[list[int]], out_len: int, max_batch_tokens: int, reference: list[list[int]]
) -> dict:
    """`reference`: `generate`'s new tokens for the same prompts, to check both modes compute the same thing."""
    try:
        new_tokens, elapsed, error = _run_generate_batch(model, prompts, out_len, max_batch_tokens)
    except Exception as e:  # a failure of the baseline is a result, not a crash
        new_tokens, elapsed, error = [], 0.0, f"{type(e).__name__}: {e}"
    if error is not None:
        print(f"  generate_batch: error: {error}")
        return {"error": error}
    tokens = sum(len(t) for t in new_tokens)
    same = sum(a == b for a, b in zip(new_tokens, reference, strict=False)) if reference else None
    print(
        f"  generate_batch: {tokens / elapsed:.1f} output tok/s ({tokens} tokens in {elapsed:.1f}s; "
        f"{same} of {len(prompts)} requests token-identical to generate)"
    )
    return {
        "output_tokens_per_s": tokens / elapsed,
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "max_batch_tokens": max_batch_tokens,
        "same_tokens_as_generate": same,
    }


def _warmup(model: PreTrainedModel, prompts: list[list[int]], max_batch_tokens: int, cb: bool) -> None:
    """A short unmeasured run of each mode: first-call costs (allocator, kernels, lazy imports) stay out."""
    if not prompts:
        return
    few = prompts[:4]
    _generate_once(model, few, len(few), 4)
    if not cb:
        return
    try:
        _run_generate_batch(model, few, 4, max_batch_tokens)
    except Exception:  # the measured run reports it
        pass


def run_hf(args: argparse.Namespace) -> int:
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"error: {e}; `bench hf` needs transformers: pip install 'ringsched[dev]'")
        return 2
    transformers.logging.set_verbosity_error()  # generate_batch's per-run info and tqdm noise
    torch.set_num_threads(args.threads)
    sizes = _batch_sizes(args.batch_sizes)
    model = load_model(args.model, args.dtype)
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    # Same draws as `bench offline`: its warmup prompts come first from the same generator.
    warm = _prompts(args.warmup_prompts, args.input_len, vocab, rng) if args.warmup_prompts else []
    prompts = _prompts(args.num_prompts, args.input_len, vocab, rng)
    print(
        f"transformers {transformers.__version__}, {args.dtype}, {args.threads} threads: {args.num_prompts} "
        f"prompts of {args.input_len} tokens, {args.output_len} new tokens each"
    )
    with torch.inference_mode():
        _warmup(model, warm, args.cb_max_batch_tokens, args.generate_batch)
        gen = bench_generate(model, prompts, sizes, args.output_len)
        reference = gen.pop("_new_tokens")
        cb = None
        if args.generate_batch:
            cb = bench_generate_batch(model, prompts, args.output_len, args.cb_max_batch_tokens, reference)
    best = max(gen["best_output_tokens_per_s"], (cb or {}).get("output_tokens_per_s", 0.0))
    print(f"  best: {best:.1f} output tok/s")
    result = {
        "dtype": args.dtype,
        "threads": args.threads,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "transformers": transformers.__version__,
        "generate": gen,
        "generate_batch": cb,
        "best_output_tokens_per_s": best,
    }
    if args.json:
        print(json.dumps(result))
    return 0
