"""Stage-local loading: a stage reads only the tensors it owns, and its memory is its share of the weights.

How memory is measured, and why. safetensors (0.8 here) maps the whole file copy-on-write and returns tensors
that are views into that mapping; nothing is read from disk until a page is touched. The decoder layers'
projections are copied on CPU (`fused_linear.cpu_layout`), the embedding, norms and head stay views, so peak RSS
straight after loading counts only part of the weights. The weights become resident when a forward
pass touches them. The subprocess therefore loads, then reads every parameter once (what a forward does to
every weight it owns; an embedding lookup would touch only a few rows), and measures peak RSS (`VmHWM`)
minus the RSS after importing torch and ringsched (and after torch's one-time ~75 MiB initialisation of
meta-device module construction, which is code, not weights). Pages of tensors the stage does not own are
never touched, so they never count. A sanity bound checks the whole model's increase really covers its
weights, so the comparison cannot pass vacuously. The parameter bytes the stage holds (`weights_bytes`) are
compared too, as an accounting-independent measure.
"""

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringsched.attention.paged import ForwardBatch
from ringsched.layout.partition import get_pp_indices
from ringsched.layout.rank import StageInfo
from ringsched.models.llama import StageModel
from ringsched.models.loader import LoadStats, load_stage_model, weights_bytes
from ringsched.models.random_model import random_config, write_random_model
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

EMBED = "model.embed_tokens.weight"
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def header_sizes(path: Path) -> dict[str, int]:
    """Tensor name -> byte size, straight from the safetensors header (independent of the loader)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {name: end - start for name, (start, end) in ((k, v["data_offsets"]) for k, v in header.items())}


def expected_reads(sizes: dict[str, int], cfg: ModelConfig, rank: int, size: int) -> set[str]:
    start, end = get_pp_indices(cfg.num_layers, rank, size)
    names = {n for n in sizes if (m := LAYER.match(n)) and start <= int(m.group(1)) < end}
    if rank == 0:
        names.add(EMBED)
    if rank == size - 1:
        names.add("model.norm.weight")
        names.add(EMBED if cfg.tie_word_embeddings else "lm_head.weight")
    return names


def load_with_stats(model_dir, rank, size):
    cfg = ModelConfig.from_dir(model_dir)
    stats = LoadStats()
    start, end = get_pp_indices(cfg.num_layers, rank, size)
    model = load_stage_model(model_dir, StageInfo(rank, size, start, end), stats=stats)
    return model, stats


@pytest.fixture(scope="module")
def smollm2_sizes(smollm2_dir):
    return header_sizes(smollm2_dir / "model.safetensors")


@pytest.fixture(scope="module")
def smollm2_stage_stats(smollm2_dir):
    out = {}
    for rank in (0, 1):
        model, stats = load_with_stats(smollm2_dir, rank, 2)
        out[rank] = (weights_bytes(model), stats)
        del model
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_smollm2_stage_reads_only_its_tensors(smollm2_dir, smollm2_sizes, smollm2_stage_stats, rank):
    cfg = ModelConfig.from_dir(smollm2_dir)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in smollm2_sizes
    _, stats = smollm2_stage_stats[rank]
    read = stats.tensors_read
    assert len(read) == len(set(read)), "a tensor was read twice"
    assert set(read) == expected_reads(smollm2_sizes, cfg, rank, 2)
    start, end = get_pp_indices(cfg.num_layers, rank, 2)
    layers = {int(m.group(1)) for n in read if (m := LAYER.match(n))}
    assert layers == set(range(start, end))
    # Stage 0 reads the embedding as the embedding; stage 1 reads it as its (tied) lm_head, and no final norm
    # or layer from the other half leaks in.
    assert EMBED in read
    assert ("model.norm.weight" in read) == (rank == 1)
    assert stats.bytes_read == sum(smollm2_sizes[n] for n in read)


def test_smollm2_stage_bytes_are_a_share_of_the_file(smollm2_dir, smollm2_sizes, smollm2_stage_stats):
    file_bytes = (smollm2_dir / "model.safetensors").stat().st_size
    total = sum(smollm2_sizes.values())
    assert total <= file_bytes < total + (1 << 20)  # the file is the tensors plus a small header
    (w0, s0), (w1, s1) = smollm2_stage_stats[0], smollm2_stage_stats[1]
    msg = f"stage 0 read {s0.bytes_read}, stage 1 read {s1.bytes_read}, whole file {file_bytes}"
    # Half the layers plus the (large, tied) embedding: about 60% of the file each.
    assert s0.bytes_read < 0.65 * file_bytes, msg
    assert s1.bytes_read < 0.65 * file_bytes, msg
    # Together every tensor is read exactly once, except the tied embedding, which both stages need.
    assert s0.bytes_read + s1.bytes_read == total + smollm2_sizes[EMBED], msg
    # What a stage holds is exactly what it read (float32 in, float32 out).
    assert (w0, w1) == (s0.bytes_read, s1.bytes_read)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_tiny_three_stage_reads(tmp_path, tie):
    cfg_dict = random_config("llama", layers=6, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, tie=tie)
    model_dir = write_random_model(tmp_path / "m", cfg_dict, seed=0)
    sizes = header_sizes(model_dir / "model.safetensors")
    assert ("lm_head.weight" in sizes) == (not tie)
    cfg = ModelConfig.from_dir(model_dir)
    reads = []
    for rank in range(3):
        _, stats = load_with_stats(model_dir, rank, 3)
        assert len(stats.tensors_read) == len(set(stats.tensors_read))
        assert set(stats.tensors_read) == expected_reads(sizes, cfg, rank, 3)
        reads.append(set(stats.tensors_read))
    # The middle stage reads neither the embedding nor the head.
    assert not {EMBED, "lm_head.weight", "model.norm.weight"} & reads[1]
    # Every tensor in the file is read by some stage; only a tied embedding by two.
    assert set().union(*reads) == set(sizes)
    assert sum(map(len, reads)) == len(sizes) + (1 if tie else 0)


MEASURE = r"""
import json, sys
import psutil
import torch
import ringsched.models.loader as loader
from ringsched.stage.times import peak_rss_bytes
from ringsched.weights.model_config import ModelConfig
from ringsched.layout.partition import get_pp_indices
from ringsched.layout.rank import StageInfo

model_dir, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = ModelConfig.from_dir(model_dir)
start, end = get_pp_indices(cfg.num_layers, rank, size)
# torch's first module built on the meta device costs ~75 MiB of RSS once (lazy library initialisation, not
# weights); pay it before the baseline so it does not blur the comparison.
with torch.device("meta"):
    torch.nn.Embedding(2, 2)

base = psutil.Process().memory_info().rss
model = loader.load_stage_model(model_dir, StageInfo(rank, size, start, end))
# The stages' own measure (VmHWM: ru_maxrss would start from the pytest parent's high-water mark).
after_load = peak_rss_bytes()
with torch.no_grad():
    for p in model.parameters():
        p.sum()  # read every byte of every weight this stage holds, as a forward pass would
peak = peak_rss_bytes()
print(json.dumps({"base": base, "after_load": after_load - base, "increase": peak - base,
                  "param_bytes": loader.weights_bytes(model)}))
"""


def measure(model_dir, rank, size):
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(model_dir), str(rank), str(size)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units and mmap behaviour: Linux")
def test_peak_memory_of_one_of_two_stages(smollm2_dir):
    half = measure(smollm2_dir, 0, 2)
    whole = measure(smollm2_dir, 0, 1)
    mib = 1 << 20
    msg = (
        f"stage 0 of 2: +{half['increase'] / mib:.0f} MiB peak RSS ({half['param_bytes'] / mib:.0f} MiB params, "
        f"+{half['after_load'] / mib:.0f} MiB before touching); whole model: +{whole['increase'] / mib:.0f} MiB "
        f"({whole['param_bytes'] / mib:.0f} MiB params, +{whole['after_load'] / mib:.0f} MiB before touching); "
        f"baseline RSS {half['base'] / mib:.0f} / {whole['base'] / mib:.0f} MiB; "
        f"ratio {half['increase'] / whole['increase']:.2f}"
    )
    print(msg)
    # The measure must see the weights at all, or the comparison below would pass for nothing.
    assert whole["increase"] >= 0.9 * whole["param_bytes"], msg
    # ... and must not hold the weights twice (copying the layers' layout through one long-lived file mapping
    # kept every page it read resident: 2x).
    assert whole["increase"] <= 1.25 * whole["param_bytes"], msg
    assert half["increase"] < 0.75 * whole["increase"], msg
    assert half["param_bytes"] < 0.75 * whole["param_bytes"], msg


def test_cpu_layout_keeps_names_shapes_and_results(tmp_path):
    """Layer projections are stored [in, out] on CPU (faster sgemm); everything a caller sees is unchanged."""
    cfg_dict = random_config("llama", layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, tie=True)
    model_dir = write_random_model(tmp_path / "m", cfg_dict, seed=0)
    model = load_stage_model(model_dir, StageInfo(0, 1, 0, 3))
    w = model.model.layers[1].mlp.gate_proj.weight
    assert w.shape == (128, 64) and w.stride() == (1, 256)  # transposed strides, same shape: gate/up's rows
    fused = model.model.layers[1].mlp.gate_up.weight  # one [256, 64] weight, the loaded gate and up side by side
    assert fused.shape == (256, 64) and fused.stride() == (1, 256) and fused.data_ptr() == w.data_ptr()
    assert model.model.embed_tokens.weight.is_contiguous() and model.lm_head.weight.is_contiguous()
    reference = load_stage_model(model_dir, StageInfo(0, 1, 0, 3))
    for mod in reference.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.weight = torch.nn.Parameter(mod.weight.contiguous(), requires_grad=False)
    assert set(model.state_dict()) == set(reference.state_dict())
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = model(ForwardBatch.no_cache(37), input_ids=ids)
        ref = reference(ForwardBatch.no_cache(37), input_ids=ids)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_lay_out_for_cpu_with_biases():
    """A model built in place (the `auto` probe's) gets the same layout, biases and norms left as they were."""
    cfg = ModelConfig.from_dict(
        random_config("qwen2", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, tie=True)
    )
    model = StageModel(cfg, StageInfo(0, 1, 0, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.lay_out_for_cpu()
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.q_proj.bias.shape == (64,)
    assert attn.q_proj.weight.shape == (64, 64) and attn.q_proj.weight.stride() == (1, 64)
    assert model.model.norm.weight.is_contiguous()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    with torch.inference_mode():
        model(ForwardBatch.no_cache(5), input_ids=torch.arange(5))
