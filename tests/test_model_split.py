"""Running the stages one after another, passing the seam tensors by hand, equals the unsplit model."""

import pytest
import torch

from ringsched.attention.paged import ForwardBatch
from ringsched.layout.partition import resolve_partition, stage_ranges
from ringsched.layout.rank import StageInfo
from ringsched.models.decoder_layer import MissingLayer
from ringsched.models.loader import load_stage_model

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407]


def run_split(model_dir, counts, ids):
    batch = ForwardBatch.no_cache(len(ids))
    x, proxy = torch.tensor(ids), None
    for rank, (start, end) in enumerate(stage_ranges(counts)):
        model = load_stage_model(model_dir, StageInfo(rank, len(counts), start, end))
        with torch.no_grad():
            out = model(batch, input_ids=x if rank == 0 else None, proxy=proxy)
            if rank < len(counts) - 1:
                assert set(out) == {"hidden_states", "residual"}
                proxy = {k: v.clone() for k, v in out.items()}
            else:
                return model.compute_logits(out)


@pytest.fixture(scope="module")
def full_logits(smollm2_dir):
    return run_split(smollm2_dir, [30], PROMPT)


@pytest.mark.parametrize("pp_size", [2, 3, 4, 5])
def test_split_is_bitwise_identical(smollm2_dir, full_logits, pp_size):
    logits = run_split(smollm2_dir, resolve_partition(30, pp_size), PROMPT)
    assert torch.equal(logits, full_logits)


def test_uneven_override_is_bitwise_identical(smollm2_dir, full_logits):
    assert torch.equal(run_split(smollm2_dir, resolve_partition(30, 3, "4,19,7"), PROMPT), full_logits)


def test_stage_owns_only_its_parts(smollm2_dir):
    first = load_stage_model(smollm2_dir, StageInfo(0, 2, 0, 15))
    last = load_stage_model(smollm2_dir, StageInfo(1, 2, 15, 30))
    assert hasattr(first.model, "embed_tokens") and not hasattr(first, "lm_head")
    assert not hasattr(last.model, "embed_tokens") and hasattr(last, "lm_head")
    assert isinstance(first.model.layers[20], MissingLayer) and isinstance(last.model.layers[3], MissingLayer)
    names = set(first.state_dict())
    assert "model.layers.14.mlp.up_proj.weight" in names and "model.layers.15.mlp.up_proj.weight" not in names
    # Tied embeddings: the last stage's lm_head is the embedding matrix.
    assert torch.equal(last.lm_head.weight[:3], first.model.embed_tokens.weight[:3])


def test_bfloat16_stages_track_float32(tiny_llama_dir):
    """--dtype bfloat16: the same split model in bf16 stays close to float32 (and keeps the seam in bf16)."""
    ids = torch.tensor([5, 17, 42, 99, 3, 250, 7, 8])
    batch = ForwardBatch.no_cache(len(ids))
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        first = load_stage_model(tiny_llama_dir, StageInfo(0, 2, 0, 3), dtype)
        last = load_stage_model(tiny_llama_dir, StageInfo(1, 2, 3, 6), dtype)
        with torch.no_grad():
            proxy = first(batch, input_ids=ids)
            assert proxy["hidden_states"].dtype == dtype
            outs[dtype] = last.compute_logits(last(batch, proxy=proxy)).float()
    assert (outs[torch.bfloat16] - outs[torch.float32]).abs().max() < 0.05


def test_loading_stage_0_keeps_the_torch_compiler_out(tiny_llama_dir):
    # The loader builds the model on the meta device; a random init there imports torch's compiler stack
    # (dynamo, inductor: ~800 modules, ~70 MiB resident in every first stage). A fresh process shows it.
    import subprocess
    import sys

    code = (
        "import sys; from ringsched.models.loader import load_stage_model;"
        "from ringsched.layout.rank import StageInfo;"
        f"m = load_stage_model({str(tiny_llama_dir)!r}, StageInfo(0, 2, 0, 3));"
        "assert m.model.embed_tokens.weight.abs().sum() > 0;"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"
