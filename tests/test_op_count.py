"""The op counter (`bench/op_count.py`): what it counts can fail, and the device path's decode layer stays within
its launch budget with no host wait between its first launch and its sampled tokens."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels' first import
pytest.importorskip("triton")

from ringsched.bench.op_count import OpCounter, _hooks, count_decode_ops  # noqa: E402
from ringsched.models.random_model import random_config, write_random_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ops-model")
    write_random_model(out, random_config("llama", 2, 64, 2, 1, 128, 300, tie=True))
    return str(out)


def test_counter_sees_launches_views_allocations_and_waits():
    counter = OpCounter()
    x = torch.arange(6.0)
    with _hooks(counter, []), counter:
        y = x.view(2, 3).t()  # views: no launch
        z = torch.empty(3)  # an allocation
        z.copy_(y.sum(1))  # two launches
        int(z[0])  # a scalar read: a wait
        z.tolist()  # a host read: a wait
        torch.nonzero(z)  # a data-dependent size: a wait
    assert dict(counter.launches["other"]) == {"sum": 1, "copy_": 1}
    assert counter.allocations["other"] == 1
    assert counter.waits == ["_local_scalar_dense", "tolist", "nonzero"]


def test_device_path_decode_layer_launch_budget_and_no_wait(model_dir):
    fused, torch_ops = count_decode_ops(model_dir, fused=True), count_decode_ops(model_dir, fused=False)
    assert fused["launches_per_layer"] <= 14
    assert fused["layer_ops"]["triton:rope_store_kernel"] == 1 and fused["layer_ops"]["mm"] == 4
    assert torch_ops["launches_per_layer"] > 2 * fused["launches_per_layer"]
    assert fused["waits"] == [] and torch_ops["waits"] == []  # the rotary bound comes from the plan
