"""GGUF files of every family ringsched runs (`--model FILE.gguf`: `weights/gguf_import.py`, `gguf_families.py`,
`gguf_tokenizer.py`). Tiny random models made by transformers' classes are written as llama.cpp's converter
writes them: tensor names from gguf-py's own table (`TensorNameMap`), Q and K permuted for `llama`, Gemma's norms
plus 1, experts stacked per projection, Phi-3's longrope factors and Llama 3.1's RoPE divisors as tensors,
tokenizer metadata. Then: the imported tensors equal the checkpoint's and the config reads as the checkpoint's
does; (slow) transformers' own GGUF loader on the same file gives ringsched's greedy tokens; a SentencePiece
("llama") vocabulary tokenizes as transformers' GGUF tokenizer does; an unsupported architecture or tokenizer is
refused by name; `resolve_model` converts a file once into the cache."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_tiny import save_tiny
from safetensors.torch import load_file

from ringsched.models.random_model import CHAT_TEMPLATE
from ringsched.weights.fetch import FetchError, resolve_model
from ringsched.weights.gguf_import import convert_gguf
from ringsched.weights.gguf_meta import Meta
from ringsched.weights.gguf_tokenizer import write_gguf_tokenizer
from ringsched.weights.model_config import ModelConfig, UnsupportedModelError

gguf = pytest.importorskip("gguf")
from gguf_writer import CASES, gpt2_vocab, spm_vocab, write_gguf, write_vocab  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Per case, lazily: (the transformers checkpoint's directory, the model, the GGUF file, its import)."""
    cache: dict[str, tuple] = {}

    def make(name: str):
        if name not in cache:
            case, root = CASES[name], tmp_path_factory.mktemp(name)
            model, _, config = case.hf.partition("/")
            hf_class = (getattr(transformers, f"{config or model}Config"), getattr(transformers, f"{model}ForCausalLM"))
            hf_dir, hf = save_tiny(root / "hf", *hf_class, **case.fields)
            path = write_gguf(root / f"tiny-{name}.gguf", case, hf.config, load_file(str(hf_dir / "model.safetensors")))
            cache[name] = (hf_dir, hf, path, convert_gguf(path, root / "imported", quiet=True))
        return cache[name]

    return make


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_import_holds_the_checkpoint_tensors_and_config(made, name):
    hf_dir, _, _, out = made(name)
    assert_same_tensors(out, hf_dir)
    ours, theirs = ModelConfig.from_dir(out), ModelConfig.from_dir(hf_dir)
    if name == "llama31":  # llama.cpp keeps only the per-frequency divisors: the same frequencies by another name
        (freq, scale), (want_freq, want_scale) = (
            c.rope_scaling.inv_freq(c.head_dim, c.rope_theta) for c in (ours, theirs)
        )
        torch.testing.assert_close(freq, want_freq, rtol=1e-6, atol=0)
        assert scale == want_scale == 1.0
        ours, theirs = (dataclasses.replace(c, rope_scaling=type(c.rope_scaling)()) for c in (ours, theirs))
    assert same(ours, theirs), (ours, theirs)


def assert_same_tensors(out: Path, hf_dir: Path) -> None:
    from ringsched.weights.checkpoint_names import weight_index

    want, files = load_file(str(hf_dir / "model.safetensors")), weight_index(out)
    got = {name: t for file in set(files.values()) for name, t in load_file(str(file)).items()}
    assert sorted(got) == sorted(want)
    for key, w in want.items():  # a norm's (w + 1) - 1 in float32 is w within an ulp of 1
        torch.testing.assert_close(got[key], w.float(), rtol=0, atol=1e-6 if "norm" in key else 0, msg=key)


def test_a_large_model_is_written_in_shards(made, tmp_path, monkeypatch):
    import ringsched.weights.gguf_import as gguf_import

    hf_dir, _, path, _ = made("mixtral")
    monkeypatch.setattr(gguf_import, "SHARD_BYTES", 64 << 10)
    out = convert_gguf(path, tmp_path / "sharded", quiet=True)
    assert not (out / "model.safetensors").exists() and len(list(out.glob("model-*.safetensors"))) > 3
    assert_same_tensors(out, hf_dir)


@pytest.mark.slow
def test_the_default_model_converts_from_its_file_as_by_its_name(smollm2_dir, smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSCHED_CACHE", str(tmp_path / "cache"))
    out = resolve_model(str(smollm2_gguf))
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ):
        assert (out / name).read_bytes() == (smollm2_dir / name).read_bytes(), name


def same(a, b) -> bool:
    """Equal, floats to float32's precision (GGUF metadata and the rope factor tensors are float32)."""
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def test_the_tokenizer_files_come_from_the_file(made):
    from ringsched.tokenizer import Tokenizer

    _, _, _, out = made("phi3")
    tok = Tokenizer(out)
    assert tok.chat_template == CHAT_TEMPLATE and tok.add_bos and tok.bos_id == 1
    assert tok.decode(tok.encode("the cat sat"), skip_special_tokens=True) == "the cat sat"
    assert tok.encode("<|end|>")[-1] == tok.token_to_id("<|end|>")  # a control token stays whole
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, tok.token_to_id("<|end|>")]  # Phi-3's end of turn stops it too


# ---- transformers' GGUF loader on the same files --------------------------------------------------------------

# Config fields transformers' GGUF loader does not read from the file (it keeps its config class's defaults).
HF_GGUF_GAPS = {"llama": {}, "qwen3": {"head_dim": 16}, "gemma2": {"query_pre_attn_scalar": 16}}
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 13, 200, 31, 64], list(range(40, 90))]  # the second past the window


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_GGUF_GAPS))
def test_transformers_gguf_loader_and_ringsched_agree(made, name, monkeypatch, tmp_path, fresh_cache):
    from test_model_reference import hf_greedy

    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    _, hf, path, _ = made(name)
    load = transformers.AutoModelForCausalLM.from_pretrained
    theirs = load(str(path.parent), gguf_file=path.name, dtype=torch.float32, **HF_GGUF_GAPS[name]).eval()
    with torch.no_grad():
        want = [hf_greedy(theirs, ids, 16) for ids in PROMPTS]
        assert want == [hf_greedy(hf, ids, 16) for ids in PROMPTS]  # the file holds the model whole
    monkeypatch.setenv("RINGSCHED_CACHE", str(fresh_cache(tmp_path / "cache")))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with Engine(model=str(path), kv_cache_memory="8M", threads_per_stage=1, log_level="warning") as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want


# ---- SentencePiece ("llama") tokenizers against transformers' --------------------------------------------------

TEXTS = [
    "the cat sat on the mat",
    "then the rat ran",
    "Hello, wörld! 日本 🐍",
    "a\nb\tc",
    "the  hat   sat",
    "x",
    "I'M 12345 x's",
    "<|im_end|>the",
    "athe thet hethe sheath tthhee anthem otherwise dogmatic",
]
# transformers' Llama tokenizer prepends its "▁" to the first stretch of text only (Metaspace), llama.cpp and
# transformers' Phi-3 and ringsched to each stretch between control tokens and even before a leading space
LEGACY_ONLY = [" the cat", "  two spaces", "<|user|>the cat<|end|>the hat", "<s>the"]


@pytest.mark.parametrize(
    ("arch", "vocab", "prefix"),
    [("llama", "spm", None), ("phi3", "spm", None), ("gemma2", "spm", False), ("llama", "llama-bpe", None),
     ("qwen3", "qwen2", None)],
)  # fmt: skip
def test_the_tokenizer_matches_transformers(tmp_path, arch, vocab, prefix):
    """SentencePiece ("llama") vocabularies, and byte-level ones cut by Llama 3's and Qwen2's regexes."""
    path = tmp_path / f"{arch}-vocab.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    if vocab == "spm":
        write_vocab(w, spm_vocab(320), 1, 2, add_space_prefix=prefix)
    else:
        write_vocab(w, gpt2_vocab(320), 1, 2, pre=vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tmp_path / "ours").mkdir()  # not beside the file: transformers would read our tokenizer.json there
    write_gguf_tokenizer(Meta(gguf.GGUFReader(str(path))), tmp_path / "ours", 512)
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(tmp_path / "ours" / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS + (LEGACY_ONLY if arch != "llama" or vocab != "spm" else []):
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False).ids == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    if vocab == "spm":
        assert len(ours.encode("the cat sat on the mat").ids) < len("the cat sat on the mat") // 2  # merges apply


# ---- refusals and the cache ------------------------------------------------------------------------------------


def test_an_unsupported_architecture_or_tokenizer_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSCHED_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'falcon' is not supported; ringsched converts"):
        resolve_model(str(path))
    assert not list((tmp_path / "cache").glob("models/gguf/*"))  # nothing half-converted left
    vocab = tmp_path / "t5.gguf"
    w = gguf.GGUFWriter(str(vocab), "llama")
    write_vocab(w, {**spm_vocab(320), "model": "t5"}, 1, 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF tokenizer model 't5' is not supported"):
        write_gguf_tokenizer(Meta(gguf.GGUFReader(str(vocab))), tmp_path, 512)


def test_a_gguf_file_converts_once_into_the_cache(made, tmp_path, monkeypatch):
    import ringsched.weights.fetch as fetch

    monkeypatch.setenv("RINGSCHED_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen3.gguf"
    path.write_bytes(made("qwen3")[2].read_bytes())
    first = resolve_model(str(path))
    assert first.parent == tmp_path / "cache" / "models" / "gguf" and first.name.startswith("tiny-qwen3-")
    assert ModelConfig.from_dir(first).architecture == "Qwen3ForCausalLM"
    monkeypatch.setattr(fetch, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert resolve_model(str(path)) == first
    monkeypatch.undo()
    monkeypatch.setenv("RINGSCHED_CACHE", str(tmp_path / "cache"))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the file changed: anew
    assert resolve_model(str(path)) != first
    with pytest.raises(FetchError, match="a GGUF file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(FetchError, match="could not read it as a GGUF file"):
        resolve_model(str(tmp_path / "junk.gguf"))
