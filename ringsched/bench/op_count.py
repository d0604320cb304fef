"""One decode step of the device path, counted op by op on CPU (`python -m ringsched.bench overhead --ops`).

A GPU step costs a kernel launch per operator, and a host wait wherever the host reads a device value; neither
shows on a CPU clock. So the step the GPU would run is run here with the same code (the Triton attention
backend and Triton layer ops under Triton's interpreter, every linear layer torch's matmul) and counted:

- **launches**: aten ops that would launch a kernel (not views, not allocations), plus Triton kernel launches
  (the aten ops the interpreter itself runs are not counted);
- **allocations**: `empty`-like ops (a caching allocator's, no launch);
- **waits**: ops that make the host wait for the device: a scalar read (`item`, `int()`:
  `_local_scalar_dense`), ops whose output size depends on data (`nonzero`, `masked_select`, ...), and reads of
  a whole tensor on the host (`tolist`, `numpy`, `cpu`).

The step is counted from the model's first op to the sampled tokens (greedy), its batch built beforehand as the
stage builds it; per-layer figures are the mean over the layers.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive"}
HOST_READS = ("tolist", "numpy", "cpu", "item")


def _is_view(func) -> bool:
    """An op that only makes a new view of its input (no kernel): every output aliases an input, none written."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


class OpCounter(TorchDispatchMode):
    """Counts, per region (`region`: the layer running, or "other"), launches and allocations; and every wait."""

    def __init__(self) -> None:
        super().__init__()
        self.region = "other"
        self.launches: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.allocations: collections.Counter = collections.Counter()
        self.waits: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            name = func._schema.name.removeprefix("aten::")
            if name in DATA_DEPENDENT:
                self.waits.append(name)
            if name in ALLOCATIONS:
                self.allocations[self.region] += 1
            elif not _is_view(func) and name not in DATA_DEPENDENT:
                self.launches[self.region][name] += 1
        return out

    def triton_launch(self, name: str) -> None:
        if not self.paused:
            self.launches[self.region][f"triton:{name}"] += 1

    @contextlib.contextmanager
    def pause(self):
        was, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = was


@contextlib.contextmanager
def _hooks(counter: OpCounter, layers):
    """Triton launches and host reads reported to `counter`, and each layer named as its region."""
    from triton.runtime import interpreter, jit

    runs = {cls: cls.run for cls in (interpreter.InterpretedFunction, jit.JITFunction)}  # interpreted, compiled

    def counted(run):
        def counted_run(self, *args, **kwargs):
            counter.triton_launch(self.fn.__name__ if hasattr(self, "fn") else self.__name__)
            with counter.pause():
                return run(self, *args, **kwargs)

        return counted_run

    def reader(name: str, orig):
        def read(t, *args, **kwargs):
            if not counter.paused:
                counter.waits.append(name)
            return orig(t, *args, **kwargs)

        return read

    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "region", f"layer {i}")))
        handles.append(layer.register_forward_hook(lambda m, a, o: setattr(counter, "region", "other")))
    for cls, run in runs.items():
        cls.run = counted(run)
    for name, orig in saved.items():
        setattr(torch.Tensor, name, reader(name, orig))
    try:
        yield
    finally:
        for cls, run in runs.items():
            cls.run = run
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)
        for h in handles:
            h.remove()


def device_path(model, fused: bool = True) -> None:
    """`model` (a CPU StageModel) made to run what a GPU stage runs: torch's matmul in every linear layer, the
    Triton layer ops in every plain layer (`fused`; else torch's operators), no one-call native decode."""
    from ringsched.kernels import triton_layer_ops
    from ringsched.kernels.small_linear import FixedPaths

    for lin in model.linears():  # the fused q/k/v and gate/up too (not submodules)
        lin.paths = FixedPaths()
    for m in model.modules():
        if getattr(m, "step_ops", None) is not None:
            m.step_ops, m.small_rows = (triton_layer_ops, sys.maxsize) if fused else (None, 0)
    model.__dict__.pop("decode_layers", None)


def count_decode_ops(model_dir: str, rows: int = 4, context: int = 24, fused: bool = True, device: str = "cpu") -> dict:
    """Counts of one greedy decode step of `rows` requests at `context` tokens each, on the device path (`fused`:
    with the Triton layer ops, as a GPU stage runs; else with torch's operators), on `device` (CPU: Triton
    interpreted; `cuda`: the real launches, `scripts/gpu_check.py`)."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import
    from ringsched.attention.backend import select_backend
    from ringsched.comm.messages import BatchPlan, PlanEntry
    from ringsched.kv.cache import BlockTable, KVPool
    from ringsched.layout.rank import StageInfo
    from ringsched.models.loader import load_stage_model
    from ringsched.weights.model_config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    model = load_stage_model(model_dir, StageInfo(0, 1, 0, cfg.num_layers), device=device)
    device_path(model, fused)
    backend = select_backend("triton", device, torch.float32)
    blocks, pool = BlockTable(rows * 4, 16), KVPool(cfg, cfg.num_layers, rows * 4, 16, torch.float32, device)
    entries = []
    for r in range(rows):
        blocks.ensure(f"r{r}", context)
        entries.append(PlanEntry(f"r{r}", context - 1, [1 + r], True))
    batch, ids = backend.forward_batch(BatchPlan(slot=0, seq=0, entries=entries), blocks, torch.device(device))
    counter = OpCounter()
    with torch.no_grad():
        model(batch, input_ids=ids, kv_caches=pool.caches)  # warm: the rotary tables built once per stage
        with _hooks(counter, model.model.layers), counter:
            model.compute_logits(model(batch, input_ids=ids, kv_caches=pool.caches)).argmax(dim=-1)
    return _summary(counter, cfg.num_layers, rows) | {"fused": fused, "device": device}


def _summary(counter: OpCounter, layers: int, rows: int) -> dict:
    per_layer = collections.Counter()
    for region, ops in counter.launches.items():
        if region.startswith("layer"):
            per_layer.update(ops)
    layer_allocs = sum(n for region, n in counter.allocations.items() if region.startswith("layer"))
    return {
        "rows": rows,
        "launches_per_layer": sum(per_layer.values()) / layers,
        "layer_ops": {name: n / layers for name, n in sorted(per_layer.items())},
        "launches_outside_layers": sum(counter.launches["other"].values()),
        "other_ops": dict(sorted(counter.launches["other"].items())),
        "allocations_per_layer": layer_allocs / layers,
        "waits": list(counter.waits),
    }


def print_ops(ops: dict) -> None:
    how = "the Triton layer ops" if ops["fused"] else "torch's operators"
    where = "Triton interpreted on CPU" if ops["device"] == "cpu" else ops["device"]
    print(f"\none decode step of {ops['rows']} rows on the device path, with {how} ({where}):")
    print(f"  launches a layer: {ops['launches_per_layer']:g} (allocations {ops['allocations_per_layer']:g})")
    for name, n in ops["layer_ops"].items():
        print(f"    {n:g} x {name}")
    print(f"  launches outside the layers: {ops['launches_outside_layers']}: " + ", ".join(ops["other_ops"]))
    print(f"  host waits: {len(ops['waits'])}" + (f" ({', '.join(ops['waits'])})" if ops["waits"] else ""))
