"""What the supervisor makes of its ranks' reports: which rank is hung or stuck (`liveness`), and the root cause of
a failure named first (`describe`, `remote_cause`)."""

from __future__ import annotations

import multiprocessing as mp
import time

from ringsched.comm.tensor_channel import without_source_paths
from ringsched.process.supervised import Supervised


def liveness(self: Supervised) -> tuple[int, str] | None:
    """(rank, why) of a ready stage whose heartbeats stopped (hung), or whose loop sat in one micro-batch too long
    (stuck). Heartbeats carry the stage's monotonic clock (one clock per machine), so a supervisor that was slow to
    look does not mistake its own delay for the stage's silence."""
    now, cfg = time.monotonic(), self.cfg
    for rank, p in zip(self.ranks, self.procs, strict=True):
        if rank not in self.ready_at:
            continue  # still loading: start()'s deadline covers it
        beat = self.beats.get(rank)
        silent = now - (beat["sent_at"] if beat else self.ready_at[rank])
        if silent > cfg.heartbeat_timeout:
            return rank, (
                f"{cfg.describe_rank(rank)} (pid {p.pid}) is hung: no heartbeat for {silent:.1f}s "
                f"(--heartbeat-timeout {cfg.heartbeat_timeout:g}); it is stopped, or blocked without releasing "
                "Python's GIL"
            )
        if beat is None or not beat["in_step"]:
            self.stalled.pop(rank, None)
            continue
        steps, since = self.stalled.get(rank, (None, beat["sent_at"]))
        if steps != beat["steps"]:
            self.stalled[rank] = (beat["steps"], beat["sent_at"])
        elif beat["sent_at"] - since > cfg.stage_timeout:
            return rank, (
                f"{cfg.describe_rank(rank)} (pid {p.pid}) is stuck: one micro-batch has taken "
                f"{beat['sent_at'] - since:.0f}s without finishing (--stage-timeout {cfg.stage_timeout:g})"
            )
    return None


def describe(self: Supervised, errors: dict[int, str], dead: list[tuple[int, mp.Process]]) -> str:
    """The root cause first: a stage that died without a word, else the first error that is not a stage
    losing its neighbour (which is what the others report once the failed one is gone). `errors` is in the
    order the reports arrived."""
    silent = [(r, p) for r, p in dead if r not in errors]
    if silent:
        r, p = silent[0]
        how = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
        msg = f"{self.cfg.describe_rank(r)} (pid {p.pid}) {how} without reporting an error"
        others = [f"{self.cfg.describe_rank(k)}: {without_source_paths(e.splitlines()[0])}" for k, e in errors.items()]
        return msg + (f"; then {'; '.join(others)}" if others else "")
    causes = [k for k, e in errors.items() if not e.startswith("PeerLost")] or list(errors)
    r = causes[0]
    first, _, details = errors[r].partition("\n")
    then = [k for k in errors if k != r]
    noun = ("rank" if self.cfg.ranks_per_stage > 1 else "stage") + ("s" if len(then) > 1 else "")
    after = f"; then {noun} {', '.join(map(str, then))} stopped too" if then else ""
    return f"{self.cfg.describe_rank(r)} failed: {without_source_paths(first)}{after}\n{details}"


def remote_cause(self: Supervised, errors: dict[int, str], dead: list) -> str:
    """When every rank here only lost a neighbour on another node, that node's own account (which of its
    ranks died, and how) comes first: `"node 1: rank 3 (...) was killed by signal 9; then here: "`."""
    if self.rendezvous is None or self.cfg.nnodes == 1 or any(r not in errors for r, _ in dead):
        return ""  # a rank here died without a word: the cause is here
    if not errors or not all(e.startswith("PeerLost") for e in errors.values()):
        return ""
    remote = self.rendezvous.wait_remote_failure(3.0)
    return f"{remote}; then here: " if remote else ""
