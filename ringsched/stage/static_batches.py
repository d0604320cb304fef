"""Step 4 of the ring loop, a stage's forward pass: eager (`EagerForward`), or for decode steps on static buffers,
one set per row bucket, replayed as a CUDA graph on a GPU (`StaticForward`).

A CUDA graph replays fixed kernels on fixed addresses, so a step's inputs must sit in buffers that outlive it and
have one shape per graph. A decode step of `n` rows is padded to its bucket (`buckets`: 1, 2, 4, 8, then every 8 up
to `--cuda-graph-max-bs`), the padding rows decoding one token of a scratch request whose only block is a block
the pool keeps aside (`SCRATCH_RID`): they write and read that block only, and their outputs are dropped. The
step's batch is built as an eager step's (the stage's attention backend, over the padded plan), then copied into
the bucket's buffers (ids or the received seam, positions, slots, block tables, lengths); the graph of that bucket
replays (captured on its first use); the last stage samples the real rows of its output, the others send a copy of
theirs. On CPU (tests, with RINGSCHED_STATIC_BATCHES=1) the same buffers run through the model eagerly: the path
but the capture.

**The bucket is named in stage 0's plan** (`BatchPlan.graph_rows`, by `Buckets.choose`): every stage pads and
replays what the plan says, none decides graph or eager for itself (the invariant vLLM #45094 broke). Prefill,
mixed, drafted, context-parallel, flexible-cut and sliding-window steps stay eager.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from ringsched.attention.backend import AttentionBackend
from ringsched.attention.paged import ForwardBatch, PagedSeqs
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kernels.native import NativeDecode
from ringsched.kv.cache import BlockTable, KVPool
from ringsched.models.llama import StageModel
from ringsched.models.rope import Rotary

SCRATCH_RID = "\0static-padding"  # no request id a front end makes starts with NUL
STATIC_BACKENDS = ("native", "triton")  # backends whose decodes are tensors of fixed shape (torch's are groups)


def buckets(max_rows: int) -> list[int]:
    """The row buckets up to `max_rows` (SGLang's and vLLM's ladder): 1, 2, 4, 8, 16, 24, ..., and `max_rows`."""
    out = [b for b in (1, 2, 4, 8) if b <= max_rows] + list(range(16, max_rows + 1, 8))
    return out if out[-1] == max_rows else [*out, max_rows]


def eligible(static: bool, attention: AttentionBackend, flex: bool, sliding: bool) -> bool:
    """Whether this stage's decode steps can run on static buffers (every stage computes the same answer from the
    same configuration; stage 0 alone then decides per plan)."""
    return static and attention.name in STATIC_BACKENDS and not flex and not sliding


class Buckets:
    """Stage 0's choice of a plan's bucket: decode-only plans (one token each, sampling, no drafts) of up to the
    largest bucket's rows."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def choose(self, plan: BatchPlan) -> None:
        n = len(plan.entries)
        if not self.sizes or not 0 < n <= self.sizes[-1]:
            return
        if all(len(e.token_ids) == 1 and e.samples and not e.drafts for e in plan.entries):
            plan.graph_rows = next(b for b in self.sizes if b >= n)


NO_BUCKETS = Buckets([])


class EagerForward:
    """A step as built: the backend's batch, the model over the layers the cut picks."""

    def __init__(self, model: StageModel, attention: AttentionBackend, blocks: BlockTable, pool: KVPool, cut, device):
        self.model, self.attention, self.blocks, self.pool, self.cut = model, attention, blocks, pool, cut
        self.device = device

    def __call__(self, plan: BatchPlan, proxy: dict | None) -> tuple[ForwardBatch, object, list[torch.Tensor]]:
        """The batch, the layers' output (the last stage: the sampling rows' final hidden states) and the K/V rows the
        cut mirrors."""
        batch, ids = self.attention.forward_batch(plan, self.blocks, self.device)
        out = self.model(
            batch,
            input_ids=ids if proxy is None else None,
            proxy=proxy,
            kv_caches=self.pool.caches,
            # policy ready: may set plan.cut as it runs
            layers=self.cut.layers(plan, self.model.one_call(batch), proxy, batch.slot_mapping),
        )
        return batch, out, self.cut.after_layers(plan, batch.slot_mapping)

    def stats(self) -> dict:
        return {}


class StaticForward:
    """`EagerForward` for plans without a bucket; a plan with one runs on that bucket's `StaticStep`. `max_len`: the
    longest context a request may reach (the buffers' block tables and the rotary tables cover it)."""

    def __init__(self, eager: EagerForward, scratch_block: int, max_len: int) -> None:
        self.eager, self.max_len = eager, max_len
        eager.blocks.tables[SCRATCH_RID] = [scratch_block]  # held by no request: the pool set it aside
        self.steps: dict[int, StaticStep] = {}
        self.counts: collections.Counter = collections.Counter()
        # One memory pool for every bucket's graph: a step's outputs are taken (sampled, or copied to send) before
        # the next replay, so the graphs may share it
        self.graph_pool = torch.cuda.graph_pool_handle() if eager.pool.caches[0][0].is_cuda else None

    def __call__(self, plan: BatchPlan, proxy: dict | None) -> tuple[ForwardBatch, object, list[torch.Tensor]]:
        rows = plan.graph_rows
        if not rows:
            return self.eager(plan, proxy)
        pad = PlanEntry(SCRATCH_RID, 0, [0], False)
        padded = dataclasses.replace(plan, entries=plan.entries + [pad] * (rows - len(plan.entries)))
        e = self.eager
        batch, ids = e.attention.forward_batch(padded, e.blocks, e.device)
        step = self.steps.get(rows)
        if step is None:
            step = self.steps[rows] = StaticStep(e.model, e.pool, batch, ids, proxy, self.max_len, self.graph_pool)
        out = step.run(batch, ids, proxy)
        self.counts[rows] += 1
        if e.model.stage.is_last:
            return batch, out.index_select(0, batch.logit_rows), []  # the real rows that sample
        return batch, {k: v.clone() for k, v in out.items()}, []  # the next replay overwrites the buffers

    def stats(self) -> dict:
        return {"static_steps": {str(rows): n for rows, n in sorted(self.counts.items())}}


class StaticStep:
    """One bucket's buffers and, on CUDA, its graph: `run` copies a padded step in and returns the output buffers."""

    def __init__(
        self, model: StageModel, pool: KVPool, batch: ForwardBatch, ids, proxy, max_len: int, graph_pool=None
    ) -> None:
        self.model, self.caches, self.graph_pool = model, pool.caches, graph_pool
        rows, dev = batch.num_tokens, batch.positions.device
        self.ids = None if proxy is not None else torch.zeros(rows, dtype=torch.long, device=dev)
        self.seam = None if proxy is None else {k: torch.zeros_like(proxy[k]) for k in ("hidden_states", "residual")}
        self.batch = dataclasses.replace(
            batch,
            positions=torch.zeros_like(batch.positions),
            slot_mapping=torch.zeros_like(batch.slot_mapping),
            logit_rows=torch.arange(rows, device=dev),  # every row: the real ones are taken after
            samples_all=True,
            position_bound=max_len - 1,  # the rotary tables cover every position, once
            native_decode=_static_native(batch.native_decode, rows, max_len),
            paged_decodes=_static_paged(batch.paged_decodes, rows, max_len, batch.block_size),
        )
        self.graph = None
        self.out = None
        self.cuda = dev.type == "cuda"
        self.rotaries = list({id(m): m for m in model.modules() if isinstance(m, Rotary)}.values())

    def _forward(self):
        for r in self.rotaries:  # the positions buffer is refilled in place: its rows gathered anew (in the graph)
            r.forget()
        proxy = None if self.seam is None else {**self.seam, "kv": []}
        return self.model(self.batch, input_ids=self.ids, proxy=proxy, kv_caches=self.caches)

    def run(self, batch: ForwardBatch, ids: torch.Tensor, proxy: dict | None):
        self._load(batch, ids, proxy)
        if not self.cuda:
            return self._forward()  # CPU: the same buffers, eagerly
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out

    def _load(self, batch: ForwardBatch, ids: torch.Tensor, proxy: dict | None) -> None:
        s = self.batch
        s.positions.copy_(batch.positions)
        s.slot_mapping.copy_(batch.slot_mapping)
        if self.ids is not None:
            self.ids.copy_(ids)
        else:
            for k, buf in self.seam.items():
                buf.copy_(proxy[k])
        for mine, theirs in ((s.native_decode, batch.native_decode), (s.paged_decodes, batch.paged_decodes)):
            if mine is not None:
                lens = mine.lens if isinstance(mine, NativeDecode) else mine.kv_lens
                lens.copy_(theirs.lens if isinstance(theirs, NativeDecode) else theirs.kv_lens)
                mine.tables[:, : theirs.tables.shape[1]].copy_(theirs.tables)

    def _capture(self) -> None:
        """Warm the step up on a side stream (kernels compiled, tables built), then capture it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.graph_pool):
            self.out = self._forward()


def _static_native(d: NativeDecode | None, rows: int, max_len: int) -> NativeDecode | None:
    if d is None:
        return None
    blocks = -(-max_len // d.block_size)
    tables = torch.zeros(rows, blocks, dtype=d.tables.dtype, device=d.tables.device)
    lens = torch.ones_like(d.lens)
    return NativeDecode(torch.arange(rows), tables, lens, d.block_size, max_len, all_rows=True)


def _static_paged(p: PagedSeqs | None, rows: int, max_len: int, block_size: int) -> PagedSeqs | None:
    if p is None:
        return None
    dev = p.tables.device
    blocks = -(-max_len // block_size)
    tables = torch.zeros(rows, blocks, dtype=p.tables.dtype, device=dev)
    return PagedSeqs(torch.arange(rows, device=dev), tables, torch.ones_like(p.kv_lens), max_len, all_rows=True)
