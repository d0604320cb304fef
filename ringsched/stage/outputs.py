"""Step 6 of the ring loop: the sampled tokens' way back from the last stage to stage 0, one part per role.

`SendBack` (the last stage) holds what it sampled and sends it to stage 0; `TakeBack` (stage 0) receives the
tokens of each micro-batch it planned and hands them to the planner; `Local` is both in one process (a single
stage); `NoOutputs` is a middle stage's, and `Discard` that of the last stage's other tensor-parallel ranks (they
sample the same tokens; only the stage's first rank sends them). Each has `hold`, `exchange`, `drain`, `pending`
and `behind`.

Why the last stage holds `depth - 1` outputs and not `depth`: holding the newest `depth` tied stage 0 to the last
stage exactly as at depth 0. Planning `t + 1` needs the outputs of `t + 1 - loop`; held `depth` micro-batches,
they left the last stage only once it had computed `t - 1`, so stage 0 computed `t + 1` beside the last stage's
`t` and the extra slot gave it no slack. Held `depth - 1`, they leave after `t - 2`: stage 0 can run a
micro-batch further ahead and the ring absorbs a slow micro-batch on either stage. The send at the end of `t`
waits for stage 0 to take the outputs of `t - depth`, which it does once it has posted the proxy of `t + 1`:
the same moment this stage needs that proxy, so it costs no wait.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable

import torch

from ringsched.comm.messages import OutputBatch
from ringsched.config import EngineConfig
from ringsched.layout.rank import RankInfo
from ringsched.scheduler.planner import Planner
from ringsched.stage.flex_ring import FixedCut, FlexRing
from ringsched.stage.times import StageTimes

PeerCall = Callable[..., object]


class _Holding:
    """The last stage's side (`SendBack`, and `Local` for one stage): what it sampled, held (seq, the message's
    tensors) until more than `depth - 1` wait, then released oldest first by `_release`.

    On a GPU the tokens reach the host by a copy into pinned memory that the step only enqueues
    (`FixedCut.payload`): holding them records an event after it, and releasing them waits for that event, so the
    host waits for the device only when the tokens leave, not inside the step."""

    def __init__(self, cfg: EngineConfig, times: StageTimes) -> None:
        self.times = times
        self.held: deque[tuple[int, list[torch.Tensor], object]] = deque()
        self.keep = max(cfg.pp_async_batch_depth - 1, 0)
        self.on_gpu = cfg.resolved_device == "cuda"

    def hold(self, seq: int, payload: list[torch.Tensor]) -> None:
        copied = None
        if self.on_gpu:
            copied = torch.cuda.Event()
            copied.record()
        self.held.append((seq, payload, copied))

    def exchange(self, t: int) -> None:
        with self.times.measure("comm"):
            self._release_due(flush=False)

    def drain(self, t: int) -> None:
        """Idle: release everything held, so no stage sits on an unfinished send (a gloo send of an output
        completes only when stage 0 receives it) and every finished request gets freed. (Its time is the idle
        wait's it happens in.)"""
        self._release_due(flush=True)

    def _release_due(self, flush: bool) -> None:
        while self.held and (flush or len(self.held) > self.keep):
            seq, payload, copied = self.held.popleft()
            if copied is not None:
                copied.synchronize()
            self._release(seq, payload)

    def _release(self, seq: int, payload: list[torch.Tensor]) -> None:
        raise NotImplementedError

    @property
    def pending(self) -> bool:
        return bool(self.held)


class _Taker:
    """Stage 0's side: which micro-batch's outputs come back next, and where they go."""

    def __init__(self, planner: Planner, front_out, times: StageTimes) -> None:
        self.planner, self.front_out, self.times = planner, front_out, times
        self.next_output = 0

    def deliver(self, seq: int, tokens: torch.Tensor) -> None:
        outs = self.planner.on_output(seq, tokens.tolist())
        if outs:
            self.front_out.send(OutputBatch(outs))
        self.next_output = seq + 1

    def behind(self, t: int) -> bool:
        """Outputs of micro-batches before `t` are still on their way."""
        return self.next_output < t


class SendBack(_Holding):
    def __init__(self, cfg: EngineConfig, chan, times: StageTimes, peer: PeerCall) -> None:
        super().__init__(cfg, times)
        self.cfg, self.chan, self.peer = cfg, chan, peer

    def _release(self, seq: int, payload: list[torch.Tensor]) -> None:
        self.peer(0, self.chan.send, 0, "output", seq % self.cfg.pp_loop_size, seq, payload)  # to global rank 0

    def behind(self, t: int) -> bool:
        return False


class TakeBack:
    """`src`: the global rank of the last stage's first rank."""

    def __init__(
        self,
        cfg: EngineConfig,
        src: int,
        chan,
        times: StageTimes,
        peer: PeerCall,
        taker: _Taker,
        cut: FixedCut | FlexRing,
    ) -> None:
        self.cfg, self.src, self.chan, self.times, self.peer = cfg, src, chan, times, peer
        self.taker, self.cut = taker, cut

    def hold(self, seq: int, payload: list[torch.Tensor]) -> None:
        raise AssertionError("stage 0 samples nothing when there are several stages")

    def exchange(self, t: int) -> None:
        """Take in the outputs up to micro-batch `t - pp_loop_size + 1`: the previous micro-batch of the slot
        planned next, so its requests are free again just in time."""
        self._take(t - self.cfg.pp_loop_size + 1, counted=True)

    def drain(self, t: int) -> None:
        """Idle: take in the outputs of every micro-batch planned (up to `t - 1`)."""
        self._take(t - 1, counted=False)

    def _take(self, upto: int, counted: bool) -> None:
        """Receive (the wait counts as waiting for outputs) and deliver (as communication when `counted`)."""
        while self.taker.next_output <= upto:
            with self.times.measure("wait_output"):
                msg = self.peer(self.src, self.chan.recv, self.src, "output", self.taker.next_output)
            with self.times.measure("comm") if counted else contextlib.nullcontext():
                self.taker.deliver(msg.seq, self.cut.tokens_of(msg.seq, msg.tensors))

    pending = False

    def behind(self, t: int) -> bool:
        return self.taker.behind(t)


class Local(_Holding):
    """One stage: the outputs never leave the process (held as the last stage would, then delivered)."""

    def __init__(self, cfg: EngineConfig, times: StageTimes, taker: _Taker) -> None:
        super().__init__(cfg, times)
        self.taker = taker

    def _release(self, seq: int, payload: list[torch.Tensor]) -> None:
        self.taker.deliver(seq, payload[0] if payload else torch.empty(0, dtype=torch.long))

    def behind(self, t: int) -> bool:
        return self.taker.behind(t)


class NoOutputs:
    """A middle stage: tokens do not pass through it."""

    pending = False

    def hold(self, seq: int, payload: list[torch.Tensor]) -> None:
        raise AssertionError("a middle stage samples nothing")

    def exchange(self, t: int) -> None:
        pass

    def drain(self, t: int) -> None:
        pass

    def behind(self, t: int) -> bool:
        return False


class Discard(NoOutputs):
    """The last stage's other tensor-parallel ranks: the tokens they sampled (the same as the first rank's) stay
    here."""

    def hold(self, seq: int, payload: list[torch.Tensor]) -> None:
        pass


def outputs_for(
    cfg: EngineConfig,
    where: RankInfo,
    chan,
    times: StageTimes,
    peer: PeerCall,
    planner: Planner | None,
    front_out,
    cut: FixedCut | FlexRing,
):
    """The part for this rank's place in the ring."""
    stage = where.stage
    if where.decides:
        taker = _Taker(planner, front_out, times)
        last = where.pp_group[-1]  # the last stage's first rank (this rank's TP index is 0)
        return Local(cfg, times, taker) if stage.is_last else TakeBack(cfg, last, chan, times, peer, taker, cut)
    if stage.is_last:
        return SendBack(cfg, chan, times, peer) if where.leads_stage else Discard()
    return NoOutputs()
