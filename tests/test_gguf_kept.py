"""GGUF files whose tensors are quantized, served with their blocks kept (`--quantization gguf`, the default for
`--model FILE.gguf`: `weights/gguf_weights.py`, `gguf_linear.py`). The test quantizer (`gguf_quant.py`) writes
ggml's own layouts, checked against the `gguf` package's dequantization; tiny transformers Llamas are written as
GGUF in a few of llama.cpp's type mixes; loaded in-process, a stage's linear layers hold the file's blocks of the
file's types in about the file's bytes; (slow) the engine's greedy tokens equal transformers' own GGUF loader's
on the same file, at PP=2 and TP=2 as at PP=1."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_tiny import save_tiny
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf_quant import quantize  # noqa: E402
from gguf_writer import Case, write_gguf  # noqa: E402

from ringsched.kernels.gguf_linear import TYPES  # noqa: E402
from ringsched.layout.rank import StageInfo  # noqa: E402
from ringsched.weights.gguf_kept import GGUFWeights  # noqa: E402

# ---- the test quantizer: ggml's block layouts -------------------------------------------------------------------

# Largest error, as a fraction of the largest |value| of the values sharing a scale (32, Q6_K's 16): half a step of
# the bit width's range (2 * amax over 2^bits - 1 steps), plus slack for the float16 and 6-bit scales; Q4_0 and
# Q5_0 a whole step (ggml maps -amax to the lowest code and clips +amax one step short of it).
TOLERANCE = {"Q4_0": 0.13, "Q4_1": 0.072, "Q5_0": 0.066, "Q5_1": 0.036, "Q8_0": 0.0045, "Q4_K": 0.075,
             "Q5_K": 0.037, "Q6_K": 0.018}  # fmt: skip


@pytest.mark.parametrize("type_name", sorted(TOLERANCE))
def test_quantized_weights_dequantize_to_themselves_by_the_gguf_reference(type_name):
    """Every group of 32 values its own magnitude (a scale or minimum read from the wrong sub-block, or a code
    from the wrong position, shows as an error far past a step); rows all positive, all negative, partly zero."""
    rng = np.random.default_rng(0)
    rows, k = 16, 1024
    w = rng.standard_normal((rows, k)).astype(np.float32)
    w *= np.repeat(10 ** rng.uniform(-0.6, 0, (rows, k // 32)), 32, axis=1).astype(np.float32) * 0.1
    w[1], w[2], w[3, :300] = np.abs(w[1]), -np.abs(w[2]), 0
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = quantize(w, type_name)
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (rows, k // values * nbytes)
    back = gguf.quants.dequantize(raw, qtype)
    group = 16 if type_name == "Q6_K" else 32
    err = np.abs(back - w).reshape(rows, -1, group).max(-1)
    amax = np.abs(w).reshape(rows, -1, group).max(-1)
    assert (err <= TOLERANCE[type_name] * amax).all(), (err / np.maximum(amax, 1e-30)).max()
    assert (back[3, :288] == 0).all()  # whole blocks of zeros stay zeros
    stacked = quantize(np.stack([w, -w]), type_name)  # [experts, rows, k]: each row on its own
    assert stacked.shape == (2, *raw.shape) and np.array_equal(stacked[0], raw)


# ---- tiny Llamas written in llama.cpp's type mixes -----------------------------------------------------------------

# head_dim 64 and K-quants' 256-value blocks: hidden 256 (4 heads) and MLP width 512
SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# Tensor parallelism splits o_proj's inputs by heads and down_proj's by MLP width: at TP=2 a 256-wide model gives
# each rank 128 of o_proj's inputs, half a Q4_K block. q4_k_m keeps Q4_K there (as llama.cpp's Q4_K_M does) and is
# twice as wide instead, so each of 2 ranks gets 256 (4 heads x 64) of o_proj's inputs and 512 of down_proj's.
WIDE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            num_hidden_layers=2)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Mix:
    fields: dict
    types: dict  # GGUF tensor (`attn_q`, `token_embd`, `output`) -> type; 1-D tensors stay float32

    def quant(self, name: str, a: np.ndarray) -> str | None:
        return self.types.get(name.split(".")[-2]) if a.ndim == 2 else None


BLK = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
Q4_K_M = {**dict.fromkeys(("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"), "Q4_K"),
          **dict.fromkeys(("attn_v", "ffn_down", "token_embd", "output"), "Q6_K")}  # fmt: skip
# q, k and v of three types (not fused), gate and up of one (fused)
Q5 = {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q4_1", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
      "ffn_up": "Q5_1", "ffn_down": "Q4_1", "token_embd": "Q5_0"}  # fmt: skip
MIXES = {
    "q4_0": Mix({**SMALL, "tie_word_embeddings": True}, {**dict.fromkeys(BLK, "Q4_0"), "token_embd": "Q8_0"}),
    "q8_0": Mix({**SMALL, "tie_word_embeddings": False}, dict.fromkeys((*BLK, "token_embd", "output"), "Q8_0")),
    "q4_k_m": Mix({**WIDE, "tie_word_embeddings": False}, Q4_K_M),
    "q5": Mix({**SMALL, "tie_word_embeddings": True}, Q5),
}
# HF parameter (less `.weight`, less the layer's prefix) -> its GGUF tensor
GGUF_NAME = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}  # fmt: skip


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Per mix, lazily: (the transformers checkpoint's directory, the GGUF file)."""
    cache: dict[str, tuple[Path, Path]] = {}

    def make(name: str) -> tuple[Path, Path]:
        if name not in cache:
            mix, root = MIXES[name], tmp_path_factory.mktemp(name)
            hf_dir, hf = save_tiny(root / "hf", transformers.LlamaConfig, transformers.LlamaForCausalLM, **mix.fields)
            state = load_file(str(hf_dir / "model.safetensors"))
            path = write_gguf(root / f"tiny-{name}.gguf", Case("llama", "Llama", mix.fields), hf.config, state,
                              mix.quant)  # fmt: skip
            cache[name] = (hf_dir, path)
        return cache[name]

    return make


def imported(path: Path, cache: Path) -> Path:
    """The model directory `--model FILE.gguf` converts `path` into, in cache `cache` (only the conversion: the
    native kernels stay built in the usual cache, not rebuilt per test)."""
    from ringsched.weights.fetch import import_gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGSCHED_CACHE", str(cache))
        return import_gguf(path)


def file_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("name", sorted(MIXES))
def test_a_stage_holds_the_files_blocks_in_about_the_files_bytes(made, name, tmp_path):
    from ringsched.models.loader import load_stage_model, weights_bytes
    from ringsched.weights.model_config import ModelConfig

    _, path = made(name)
    model_dir = imported(path, tmp_path / "cache")
    layers = ModelConfig.from_dir(model_dir).num_layers
    model = load_stage_model(model_dir, StageInfo(0, 1, 0, layers), quantization="gguf")
    types, mix = file_types(path), MIXES[name]
    assert {types[n] for n in types if n.endswith("norm.weight")} == {"F32"}
    for i in range(layers):
        for hf_name, gguf_name in GGUF_NAME.items():
            lin = model.get_submodule(f"model.layers.{i}.{hf_name}")
            assert isinstance(lin, GGUFWeights) and lin.weight.dtype == torch.uint8, hf_name
            assert TYPES[lin.qtype][0] == types[f"blk.{i}.{gguf_name}.weight"] == mix.types[gguf_name], hf_name
    emb = model.model.embed_tokens
    assert emb.weight.dtype == torch.uint8 and TYPES[emb.qtype][0] == types["token_embd.weight"]
    head = model.lm_head
    assert isinstance(head, GGUFWeights) and head.weight.dtype == torch.uint8
    assert TYPES[head.qtype][0] == types.get("output.weight", types["token_embd.weight"])
    if mix.fields["tie_word_embeddings"]:
        assert head.weight.data_ptr() == emb.weight.data_ptr()  # one tensor for both
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    assert abs(weights_bytes(model) - file_bytes) <= 0.15 * file_bytes, (weights_bytes(model), file_bytes)


def test_gguf_quantization_needs_a_gguf_model_and_whole_blocks_per_rank(made, tmp_path):
    """A Hugging Face checkpoint's directory is refused by the flag's name; a TP size that would cut a block of a
    row-parallel weight is refused naming the sizes that do not (q4_k_m's o_proj: 8 heads x 64 inputs in Q4_K
    blocks of 256: TP=4 gives each rank 128)."""
    from ringsched.models.loader import load_stage_model
    from ringsched.weights.gguf_weights import check_kept
    from ringsched.weights.model_config import ModelConfig

    hf_dir, path = made("q4_k_m")
    with pytest.raises(ValueError, match="--quantization gguf"):
        load_stage_model(hf_dir, StageInfo(0, 1, 0, 2), quantization="gguf")
    model_dir = imported(path, tmp_path / "cache")
    mcfg = ModelConfig.from_dir(model_dir)
    check_kept(model_dir, mcfg, 2)
    with pytest.raises(ValueError, match=r"--tp-size 4: blk\.\d\.attn_output\.weight .* --tp-size \[1, 2\]"):
        check_kept(model_dir, mcfg, 4)


# ---- (slow) served: transformers' own GGUF loader on the same file ------------------------------------------------

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 13, 200, 31, 64], list(range(40, 90))]
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def served(made, tmp_path_factory, fresh_cache):
    """Per (mix, layout), lazily: the engine's greedy tokens for `PROMPTS` (`--model FILE.gguf`, so
    `--quantization gguf`)."""
    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    cache: dict[tuple, list[list[int]]] = {}
    ringsched_cache = fresh_cache(tmp_path_factory.mktemp("served") / "cache")  # the conversions apart, not the kernels
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def serve(name: str, **layout) -> list[list[int]]:
        key = (name, *sorted(layout.items()))
        if key not in cache:
            _, path = made(name)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("RINGSCHED_CACHE", str(ringsched_cache))
                with Engine(model=str(path), kv_cache_memory="8M", threads_per_stage=1, log_level="warning",
                            dtype="float32", **layout) as llm:  # fmt: skip
                    assert llm.cfg.quantization == "gguf"
                    cache[key] = [o.token_ids for o in llm.generate(PROMPTS, params)]
        return cache[key]

    return serve


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MIXES))
def test_transformers_gguf_loader_and_ringsched_agree_on_a_quantized_file(made, served, name):
    from test_model_reference import hf_greedy

    _, path = made(name)
    load = transformers.AutoModelForCausalLM.from_pretrained
    theirs = load(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf_greedy(theirs, ids, MAX_TOKENS) for ids in PROMPTS]
    assert served(name) == want


@pytest.mark.slow
def test_a_quantized_file_serves_the_same_tokens_split_by_stages_or_ranks(served):
    """q4_k_m at PP=2 (a layer a stage) and at TP=2 (o_proj and down_proj cut between whole Q4_K and Q6_K blocks,
    the vocabulary's Q6_K rows split) as at PP=1."""
    want = served("q4_k_m")
    assert served("q4_k_m", pp_size=2) == want
    assert served("q4_k_m", tp_size=2) == want
