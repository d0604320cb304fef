"""The typed messages that travel over ZMQ, with one msgpack codec.

Each message is a dataclass registered under a short tag; `encode`/`decode` are the only way objects go on
the wire. Tensors never travel here (they go over `torch.distributed`, see `tensor_channel.py`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import msgpack


@dataclass
class NewRequest:
    """Front end -> stage 0. A *replay* (a request resubmitted to a fresh ring after a rank was replaced) carries
    the tokens an earlier ring already delivered in `output_ids`: stage 0 computes prompt + those and samples on,
    counting them as outputs (`max_tokens`, penalties, the seeded draw's index)."""

    rid: str
    token_ids: list[int]
    params: dict  # SamplingParams.to_dict()
    prompt_len: int = 0  # in announcements, where token_ids is left empty
    output_ids: list[int] = field(default_factory=list)  # a replay's tokens delivered so far; empty when new


@dataclass
class AbortRequest:
    """Front end -> stage 0. Stage 0 decides; the other stages learn of it through a plan's `frees`."""

    rid: str


@dataclass
class PlanEntry:
    rid: str
    start: int  # position of the first token in this entry
    token_ids: list[int]  # the tokens this micro-batch computes for the request
    samples: bool  # the entry ends at the last known token: the last stage samples the next one
    new_blocks: list[int] = field(default_factory=list)  # KV blocks stage 0 allocated for this entry
    # Prefix caching, in a request's first entry after admission: the cached blocks it starts from (positions
    # [0, start), computed by earlier requests) and their token ids (the last stage's sampling history)
    cached_blocks: list[int] = field(default_factory=list)
    cached_ids: list[int] = field(default_factory=list)
    # --cp-size > 1 (kv/cp_blocks.py): the tokens each CP rank of a stage computes and stores, and each
    # rank's new blocks (`new_blocks` then stays empty)
    cp_counts: list[int] = field(default_factory=list)
    cp_blocks: list[list[int]] = field(default_factory=list)
    # Models with sliding layers: the blocks of the sliding pool this entry adds to the request's ring (`kv/ring.py`)
    ring_blocks: list[int] = field(default_factory=list)
    # Speculative decoding: the last `drafts` of `token_ids` are stage 0's guesses of the next tokens; the last
    # stage samples at each of the entry's last `drafts + 1` positions and keeps the longest run it agrees with
    drafts: int = 0
    # Prompt log-probabilities (`SamplingParams.prompt_logprobs`): the prompt tokens that follow the entry's first
    # `len(scored_ids)` positions; the last stage returns each one's log-probability at the position before it
    scored_ids: list[int] = field(default_factory=list)


@dataclass
class BatchPlan:
    """Stage k -> k+1: the whole decision for one micro-batch, made once by stage 0."""

    slot: int
    seq: int
    entries: list[PlanEntry] = field(default_factory=list)
    announce: list[NewRequest] = field(default_factory=list)  # requests scheduled for the first time
    frees: list[str] = field(default_factory=list)  # free KV before this batch (finished, aborted, preempted)
    drops: list[str] = field(default_factory=list)  # forget entirely (finished or aborted)
    # --pp-flex-layers: stage 0 runs layers [0, cut), stage 1 the rest. -1: the fixed partition, or (policy
    # ready) a cut stage 0 decides while it runs, which stage 1 reads from the proxy.
    cut: int = -1
    shutdown: bool = False
    # Micro-batches still in flight when this one was planned whose KV it reads (a request's earlier prompt chunks):
    # with a flexible cut stage 0 cuts this one no later than those (it holds their KV up to their cut only).
    reads: list[int] = field(default_factory=list)
    # A decode step on static buffers (`stage/static_batches.py`): the row bucket every stage pads it to (and replays
    # the CUDA graph of); 0: eager. Stage 0 decides, so no two stages can disagree on graph or eager.
    graph_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries)

    @property
    def num_samples(self) -> int:
        return sum(e.samples for e in self.entries)

    @property
    def sample_rows(self) -> int:
        """Rows the last stage samples: one per sampling entry, and one more per draft."""
        return sum(1 + e.drafts for e in self.entries if e.samples)


@dataclass
class TokenOutput:
    """Stage 0 -> front end: new tokens of one request, and its end when `finish_reason` is set."""

    rid: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # With finish_reason "error": None when stage 0 refused the request at admission (the client's to fix), else
    # what failed while it ran ("request_failed": its parameters made a stage fail; the engine runs on).
    error_code: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (the first admission's)
    # per token of `token_ids`, when the request asked for them: [its log-probability, [[id, log-probability]]
    # of the most likely tokens]
    logprobs: list | None = None
    # with the first token, when the request asked for them: per prompt token after the first, [its
    # log-probability, its rank, [[id, log-probability]] of the most likely tokens]
    prompt_logprobs: list | None = None


@dataclass
class OutputBatch:
    outputs: list[TokenOutput] = field(default_factory=list)
    stats: dict | None = None  # stage 0's scheduler gauges, sent now and then


@dataclass
class StageStatus:
    """Stage -> its launcher: ready (with its capacity and layers), stats, or a fatal error."""

    rank: int
    state: str  # "ready", "stats", "error", "exited"
    info: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class StageProgress:
    """Stage 1 -> stage 0 (`--pp-flex-policy ready`): when stage 1 expects to finish micro-batch `seq` (wall clock,
    `time.time()`), sent before each of its layers; `done` once it has finished and is ready for the next one."""

    seq: int
    finish_at: float
    done: bool = False


@dataclass
class Shutdown:
    reason: str = ""


_TYPES: dict[str, type] = {
    "new": NewRequest,
    "abort": AbortRequest,
    "plan": BatchPlan,
    "out": OutputBatch,
    "status": StageStatus,
    "shutdown": Shutdown,
    "progress": StageProgress,
}
_TAGS = {cls: tag for tag, cls in _TYPES.items()}


# The fields of each message type that hold lists of other messages (nothing else nests).
_NESTED: dict[type, dict[str, type]] = {
    BatchPlan: {"entries": PlanEntry, "announce": NewRequest},
    OutputBatch: {"outputs": TokenOutput},
}


def encode(msg: object) -> bytes:
    return msgpack.packb([_TAGS[type(msg)], _plain(msg)], use_bin_type=True)


def _plain(msg: object) -> list:
    """A message as msgpack packs it: its field values in declaration order, a nested message's likewise. Positional,
    not a dict of names: a step's plan or output batch holds one entry per request, and each entry's values are one
    C call (`attrgetter`), with no key to pack or match on the other side; lists of numbers go as they are
    (`dataclasses.asdict` would copy every token id)."""
    cls = type(msg)
    values = list(_getter(cls)(msg))
    for i, sub in _nested_at(cls):
        getter = _getter(sub)
        values[i] = [list(getter(x)) for x in values[i]]
    return values


@functools.cache
def _getter(cls: type) -> Callable[[object], tuple]:
    names = [f.name for f in fields(cls)]
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else lambda msg: (get(msg),)


@functools.cache
def _nested_at(cls: type) -> tuple[tuple[int, type], ...]:
    """(field index, message type) of `cls`'s fields that hold lists of messages."""
    nested = _NESTED.get(cls, {})
    return tuple((i, nested[f.name]) for i, f in enumerate(fields(cls)) if f.name in nested)


def decode(data: bytes) -> object:
    tag, body = msgpack.unpackb(data, raw=False)
    cls = _TYPES[tag]
    for i, sub in _nested_at(cls):
        body[i] = [sub(*x) for x in body[i]]
    return cls(*body)
