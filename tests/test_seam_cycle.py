"""The ring's sends and receives form no cycle, whatever the transport buffers.

NCCL runs a communicator's operations one after another in the order each rank posts them, and a send past its
eager size completes only when the matching receive runs. `StreamComm` is that transport in one process: the real
`TensorChannel` posts through it (its `dist` replaced), and each stage of an in-process ring (the real
`StageLoop`s, `test_loop_in_process.run_ring`) runs in a thread. With the seams and the tokens on one
communicator (the ring's old order) the loop deadlocks once the token message is past the eager size; with the
tokens on a communicator of their own (`stage/groups.py`) it finishes with the same tokens.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import pytest
import torch

from ringsched.comm import tensor_channel
from ringsched.comm.tensor_channel import TensorChannel
from ringsched.sampling.params import SamplingParams
from tests.test_loop_in_process import run_ring

STALL_S = 3.0  # an operation waited on this long without progress: the ring is deadlocked


@dataclass
class _Op:
    send: bool
    peer: int
    tensor: torch.Tensor
    done: bool = False


@dataclass
class StreamComm:
    """One communicator: per rank a queue of posted operations, run strictly in order. A send of at most
    `eager_bytes` completes as it is posted (the transport buffers it); a larger one waits for its receive."""

    eager_bytes: int
    cv: threading.Condition = field(default_factory=threading.Condition)
    queues: defaultdict = field(default_factory=lambda: defaultdict(deque))
    buffered: defaultdict = field(default_factory=lambda: defaultdict(deque))  # (src, dst) -> tensors

    def post(self, rank: int, op: _Op) -> _Op:
        with self.cv:
            self.queues[rank].append(op)
            self._progress()
        return op

    def _progress(self) -> None:
        moved = True
        while moved:
            moved = False
            for rank, q in list(self.queues.items()):
                if q and self._run_head(rank, q[0]):
                    q.popleft()
                    moved = True
        self.cv.notify_all()

    def _run_head(self, rank: int, op: _Op) -> bool:
        if op.send:
            if op.tensor.numel() * op.tensor.element_size() > self.eager_bytes:
                return False  # waits for the receive at the head of the peer's queue (`_run_head` of that one)
            self.buffered[(rank, op.peer)].append(op.tensor.clone())
            op.done = True
            return True
        if self.buffered[(op.peer, rank)]:
            op.tensor.copy_(self.buffered[(op.peer, rank)].popleft())
            op.done = True
            return True
        peer_q = self.queues[op.peer]
        if peer_q and peer_q[0].send and peer_q[0].peer == rank:
            send = peer_q.popleft()
            op.tensor.copy_(send.tensor)
            send.done = op.done = True
            return True
        return False

    def wait(self, op: _Op) -> None:
        with self.cv:
            if not self.cv.wait_for(lambda: op.done, STALL_S):
                raise RuntimeError("deadlock: no operation of the communicator can run")


@dataclass
class _Group:
    comm: StreamComm
    rank: int


class _Work:
    def __init__(self, group: _Group, op: _Op) -> None:
        self.group, self.op = group, op

    def wait(self) -> None:
        self.group.comm.wait(self.op)

    def is_completed(self) -> bool:
        return self.op.done


class _StreamDist:
    """What `TensorChannel` calls of `torch.distributed`, over the `StreamComm` its group names."""

    @staticmethod
    def isend(t, dst, group):
        return _Work(group, group.comm.post(group.rank, _Op(True, dst, t)))

    @staticmethod
    def irecv(t, src, group):
        return _Work(group, group.comm.post(group.rank, _Op(False, src, t)))

    @staticmethod
    def recv(t, src, group):
        _StreamDist.irecv(t, src, group).wait()


def _ring(model_dir, requests, shared: bool, eager_bytes: int):
    seams, tokens = StreamComm(eager_bytes), StreamComm(eager_bytes)

    def channels(rank: int):
        seam = TensorChannel("cpu", group=_Group(seams, rank))
        return seam, (seam if shared else TensorChannel("cpu", group=_Group(tokens, rank)))

    return run_ring(model_dir, requests, pp_size=2, depth=1, channels=channels)


@pytest.fixture
def stream_dist(monkeypatch):
    monkeypatch.setattr(tensor_channel, "dist", _StreamDist)


def _requests():
    # Logprobs make the token message bigger than its header's inline room: a payload of its own
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    return [([5 + i, 9, 11 + i], params) for i in range(4)]


def test_tokens_on_their_own_communicator_never_wait_on_a_seam(tiny_llama_dir, stream_dist):
    model = str(tiny_llama_dir)
    reqs = _requests()
    expected = run_ring(model, reqs, pp_size=1)
    assert _ring(model, reqs, shared=False, eager_bytes=0) == expected
    assert _ring(model, reqs, shared=False, eager_bytes=1 << 20) == expected


def test_the_old_order_deadlocks_once_the_tokens_are_not_buffered(tiny_llama_dir, stream_dist):
    model = str(tiny_llama_dir)
    reqs = _requests()
    # While the transport buffers the token message, one communicator for both ways works ...
    assert _ring(model, reqs, shared=True, eager_bytes=1 << 20) == run_ring(model, reqs, pp_size=1)
    # ... and when it does not, the stages wait on each other's sends
    start = time.monotonic()
    with pytest.raises(AssertionError, match="deadlock"):
        _ring(model, reqs, shared=True, eager_bytes=0)
    assert time.monotonic() - start < 30
