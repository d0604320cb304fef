"""The offline engine: `with Engine(model=..., pp_size=2) as llm: llm.generate(prompts, params)`.

It starts the stage processes (via `Supervisor`), sends requests to stage 0 and collects the tokens stage 0
streams back; it keeps what each open request needs to be replayed on a fresh ring (`replay_open`). Keyword
arguments mirror the launcher's flags. Leaving the `with` block, an error, or `shutdown()` stops every stage
process.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ringsched.comm.messages import AbortRequest, NewRequest, OutputBatch, TokenOutput
from ringsched.config import EngineConfig
from ringsched.detokenizer import TextStream
from ringsched.link import RingLink
from ringsched.replay import FollowRecovery, OpenRequests
from ringsched.sampling.params import SamplingParams
from ringsched.spec import ModelSpec
from ringsched.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated only
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    # with SamplingParams(logprobs=k): per generated token, (its log-probability, [(id, log-probability)] of the
    # k most likely tokens)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # with SamplingParams(prompt_logprobs=k): per prompt token, None for the first, then (its log-probability,
    # its rank, [(id, log-probability)] of the k most likely tokens at its position)
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]] | None] | None = None

    def add(self, o: TokenOutput, used: int) -> None:
        """The first `used` of `o`'s tokens, their log-probabilities and the prompt's, where asked for."""
        self.token_ids += o.token_ids[:used]
        self.cached_tokens = o.cached_tokens or self.cached_tokens
        if o.logprobs:
            lps = o.logprobs[:used]
            self.logprobs = (self.logprobs or []) + [(lp, [tuple(t) for t in top]) for lp, top in lps]
        if o.prompt_logprobs is not None:
            scores = [(lp, rank, [tuple(t) for t in top]) for lp, rank, top in o.prompt_logprobs]
            self.prompt_logprobs = [None, *scores]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamEvent:
    index: int  # which prompt
    token_ids: list[int]
    finish_reason: str | None = None


class Engine:
    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs) -> None:
        self.cfg = EngineConfig(model=model, **kwargs)
        self.spec = ModelSpec.resolve(self.cfg, quiet=False)  # fails here, not in a child, on a bad flag
        self.cfg = dataclasses.replace(self.cfg, model=self.spec.model_dir)
        self.model_dir, self.model_config, self.max_len = self.spec.model_dir, self.spec.config, self.spec.context_len
        self.tokenizer = Tokenizer(self.model_dir)
        self._ids = itertools.count()
        self._seeds = random.Random(self.cfg.seed)  # seeds the unseeded random requests, in arrival order
        self.last_stats: dict = {}
        self.open_requests = OpenRequests()  # what `replay_open` resubmits
        self.link = RingLink(self.cfg, self.spec)  # starts the stages
        self.supervisor = self.link.supervisor
        self._recovery = FollowRecovery(self.supervisor, self.link)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- requests ------------------------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, rid: str | None = None) -> str:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        params = (params or SamplingParams()).seeded(self._seeds)
        rid = rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        new = NewRequest(rid, ids, params.to_dict())
        self.open_requests.sent(new)
        self.link.send(new)
        return rid

    def abort(self, rid: str) -> None:
        self.open_requests.ended(rid)
        self.link.send(AbortRequest(rid))

    def replay_open(self) -> int:
        """Resubmit every open request to a fresh ring (a replaced rank, a fresh stage 0) with the tokens
        already delivered, after re-creating the sockets to stage 0 (`RingLink.reconnect`: nothing queued for the
        old stage 0 reaches the fresh one, outputs not yet read are dropped). Greedy and seeded requests go on with
        exactly their undisturbed tokens. Returns how many were resubmitted (`requests_replayed` counts them all).
        Nothing here detects the failure: whoever replaces the rank calls this."""
        self.link.reconnect()
        replays = self.open_requests.replays()
        for new in replays:
            self.link.send(new)
        return len(replays)

    @property
    def requests_replayed(self) -> int:
        return self.open_requests.replayed

    def poll(self, timeout: float = 0.1) -> list[TokenOutput]:
        """Outputs that arrived within `timeout`; raises `StageFailure` if a stage died (beyond --max-restarts). A
        replaced rank's recovery pauses the outputs; then the open requests are replayed and go on."""
        self._check()
        msg = self.link.recv(timeout_ms=int(timeout * 1000))
        msgs = [msg] + self.link.drain() if msg is not None else []
        outs: list[TokenOutput] = []
        for m in msgs:
            assert isinstance(m, OutputBatch)
            outs += m.outputs
            for o in m.outputs:
                self.open_requests.delivered(o)
            if m.stats:
                self.last_stats = m.stats
        if not msgs:
            self._check()
        return outs

    def _check(self) -> None:
        self.supervisor.check()
        if self._recovery.step():
            self.replay_open()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        results: dict[int, RequestOutput] = {}
        for _ in self._run(prompts, params, results):
            pass
        return [results[i] for i in range(len(prompts))]

    def stream(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield tokens as they come, per prompt index."""
        yield from self._run(prompts, params, {})

    def _run(self, prompts, params, results: dict[int, RequestOutput]) -> Iterator[StreamEvent]:
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts; give one or one each")
        index: dict[str, int] = {}
        texts: dict[str, TextStream | None] = {}  # stop strings are matched on the text, as the server does
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
            results[i] = RequestOutput(prompt_token_ids=ids)
            rid = self.submit(ids, sp)
            index[rid], texts[rid] = i, TextStream(self.tokenizer, ids, sp.stop) if sp.stop else None
        pending = set(index)
        try:
            while pending:
                for o in self.poll(0.2):
                    i = index.get(o.rid)
                    if i is None or o.rid not in pending:
                        continue
                    r, text = results[i], texts[o.rid]
                    # the tokens up to a stop string's end (a speculative step's can run past it)
                    used = text.add_until_stop(o.token_ids)[1] if text is not None else len(o.token_ids)
                    stopped = text is not None and text.stopped
                    r.add(o, used)
                    finish = "stop" if stopped else o.finish_reason
                    if finish:
                        if stopped and not o.finish_reason:
                            self.abort(o.rid)  # ended here, not on the ring: free its KV there
                        r.finish_reason, r.error = finish, o.error
                        r.text = text.text if stopped else self.tokenizer.decode(r.token_ids)
                        pending.discard(o.rid)
                    yield StreamEvent(i, list(o.token_ids[:used]), finish)
        finally:
            for rid in pending:  # the caller stopped early: nothing stays running
                self.abort(rid)

    def stats(self) -> dict:
        self.supervisor.check()
        return dict(self.last_stats)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until stage 0 reports no running or waiting request and an empty KV pool; its last stats."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll(0.1)
            s = self.last_stats
            if s and s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0:
                return s
        return self.last_stats

    # -- lifecycle -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every stage process (idempotent)."""
        if hasattr(self, "link"):
            self.link.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
