"""What a front end keeps per open request so it can resubmit it to a fresh ring (`--max-restarts`).

When a rank of the ring is replaced, every request the ring held is lost with stage 0's state. A front end that
records each request as it first sent it (prompt ids, params with the seed `SamplingParams.seeded` gave it) and the
token ids delivered since can *replay* it: the same request, with those tokens as `NewRequest.output_ids`, which the
fresh stage 0 computes and samples on from (`Planner.add`). Greedy and seeded sampling then continue with exactly
the tokens the undisturbed run would have given; the front end's own per-request state (detokenizer, stop strings,
counts) is untouched and carries on.

Contract: `sent(new)` when a request goes to the ring; `delivered(out)` for each of its outputs the front end reads
(one that ends it forgets it); `ended(rid)` when the front end ends it itself (an abort). `replays()` gives the
`NewRequest`s to resubmit, one INFO line each, and counts them in `replayed`. A replayed request's first new token
logs its pause (from the last token it had before the failure, or from its submission) and adds it to `pauses`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ringsched.comm.messages import NewRequest, TokenOutput

logger = logging.getLogger("ringsched.replay")


@dataclass
class OpenRequest:
    new: NewRequest  # as first sent, its seed included
    delivered: list[int] = field(default_factory=list)  # token ids read from the ring so far
    last_at: float = field(default_factory=time.monotonic)  # when it was sent or its last token read
    replayed: bool = False  # resubmitted, and no token read since


class OpenRequests:
    def __init__(self) -> None:
        self.open: dict[str, OpenRequest] = {}
        self.replayed = 0  # requests resubmitted so far (`ringsched:requests_replayed_total`)
        self.pauses: list[float] = []  # per replayed request, seconds without a token (`request_replay_pause_seconds`)

    def sent(self, new: NewRequest) -> None:
        self.open[new.rid] = OpenRequest(new, list(new.output_ids))

    def delivered(self, out: TokenOutput) -> None:
        """Record `out`'s tokens; a finish (any reason: stop, length, abort, error) ends the request on the ring."""
        req = self.open.get(out.rid)
        if req is None:
            return
        now = time.monotonic()
        if req.replayed and (out.token_ids or out.finish_reason is not None):
            self.pauses.append(now - req.last_at)
            logger.info(
                "request %s resumed after a %.2fs pause (replayed with %d delivered token(s))",
                out.rid,
                self.pauses[-1],
                len(req.delivered),
            )
            req.replayed = False
        if out.token_ids:
            req.last_at = now
        if out.finish_reason is not None:
            del self.open[out.rid]
        else:
            req.delivered += out.token_ids

    def ended(self, rid: str) -> None:
        self.open.pop(rid, None)

    def replays(self) -> list[NewRequest]:
        """A replay of every open request, in the order they were first sent (so arrival order is kept)."""
        out = []
        for rid, req in self.open.items():
            n = req.new
            out.append(NewRequest(rid, list(n.token_ids), dict(n.params), output_ids=list(req.delivered)))
            req.replayed = True
            logger.info("replaying request %s with %d delivered token(s)", rid, len(req.delivered))
        self.replayed += len(out)
        return out


class FollowRecovery:
    """A front end's side of a recovery (`process/recovery.py`): once one runs, stop sending to stage 0 (`pause`:
    the request socket closed with linger 0, so nothing queued for the ring that failed reaches its successor, and
    nothing sent meanwhile is lost: a request submitted now is open and is replayed) and let the recovery go on
    (`front_paused`, which it waits for before the new generation starts); once the ring is whole in the next
    generation, `step` says to replay (`replay_open`)."""

    def __init__(self, supervisor, link) -> None:
        self.supervisor, self.link = supervisor, link
        self.generation = 0
        self.paused = False

    def step(self) -> bool:
        """Call after each `supervisor.check()`; True when the open requests are to be replayed now."""
        recovery = self.supervisor.recovery
        if recovery.running and not self.paused:
            self.link.pause()
            self.paused = True
            recovery.front_paused.set()
        if self.supervisor.generation != self.generation and not recovery.running:
            self.generation, self.paused = self.supervisor.generation, False
            return True
        return False
