"""The ZMQ codec: every message type survives encode/decode, nested dataclasses included, and goes on the wire as
each dataclass's field values in order (what `dataclasses.astuple` gives, as lists)."""

from __future__ import annotations

from dataclasses import astuple

import msgpack

from ringsched.comm.messages import (
    AbortRequest,
    BatchPlan,
    NewRequest,
    OutputBatch,
    PlanEntry,
    Shutdown,
    StageProgress,
    StageStatus,
    TokenOutput,
    decode,
    encode,
)


def _messages() -> list[object]:
    plan = BatchPlan(
        slot=1, seq=7,
        entries=[PlanEntry("a", 0, list(range(512)), True, [3, 4], cached_blocks=[1], cached_ids=[9, 9]),
                 PlanEntry("b", 40, [5], True, cp_counts=[1, 0], cp_blocks=[[6], []])],
        announce=[NewRequest("a", [], {"temperature": 0.0, "stop": ["\\n"]}, prompt_len=512)],
        frees=["c"], drops=["c"], cut=12,
    )  # fmt: skip
    out = OutputBatch([TokenOutput("a", [5], "stop", None, 10, 3, cached_tokens=2, logprobs=[[-0.5, [[5, -0.5]]]])],
                      stats={"running": 1})  # fmt: skip
    return [plan, out, BatchPlan(0, 0), OutputBatch(), NewRequest("r", [1, 2], {}), AbortRequest("r"),
            StageStatus(0, "ready", {"layers": [0, 15]}), StageProgress(3, 1.5, True), Shutdown("bye")]  # fmt: skip


def test_every_message_round_trips():
    for msg in _messages():
        assert decode(encode(msg)) == msg


def _lists(x):
    return [_lists(v) for v in x] if isinstance(x, (list, tuple)) else x


def test_the_wire_form_is_the_dataclass_field_values_in_order():
    for msg in _messages():
        _, body = msgpack.unpackb(encode(msg), raw=False)
        assert body == _lists(astuple(msg))
