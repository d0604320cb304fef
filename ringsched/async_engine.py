"""The engine for asyncio programs: `async with AsyncEngine(pp_size=2) as llm: async for out in llm.generate(...)`.

It is the HTTP server's own core (`server.engine_client.EngineClient`) without HTTP: the stage processes start
when the `async with` block is entered (off the event loop), every request streams `RequestOutput` snapshots (the
tokens, text, log-probabilities and finish so far) as its tokens come back, stop strings end a request as in the
server, and leaving the iteration early (a `break`, a cancelled task) aborts the request on the ring, which frees
its KV on every stage. Keyword arguments mirror the launcher's flags, as for `Engine`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator, Sequence

from ringsched.config import EngineConfig
from ringsched.detokenizer import TextStream
from ringsched.engine import RequestOutput
from ringsched.sampling.params import SamplingParams
from ringsched.server.engine_client import EngineClient, EngineError
from ringsched.spec import ModelSpec
from ringsched.tokenizer import Tokenizer


class AsyncEngine:
    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs) -> None:
        cfg = EngineConfig(model=model, **kwargs)
        self.spec = ModelSpec.resolve(cfg, quiet=False)  # a bad flag fails here
        self.cfg = dataclasses.replace(cfg, model=self.spec.model_dir)
        self.tokenizer = Tokenizer(self.spec.model_dir)
        self.client: EngineClient | None = None
        self._ids = itertools.count()

    async def __aenter__(self) -> AsyncEngine:
        self.client = await asyncio.to_thread(EngineClient, self.cfg, self.spec)  # starts the stages
        self.client.start_routing()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop every stage process (idempotent)."""
        if self.client is not None:
            await self.client.close()

    async def replay_open(self) -> int:
        """`EngineClient.replay_open`: every open request resubmitted to a fresh ring; how many."""
        if self.client is None:
            raise RuntimeError("use the engine inside `async with AsyncEngine(...) as llm:`")
        return await self.client.replay_open()

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's output after each new token; the last one has `finish_reason` set ("error", with
        `error`, when the engine refused or failed it)."""
        if self.client is None:
            raise RuntimeError("use the engine inside `async with AsyncEngine(...) as llm:`")
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        rid = request_id or f"async-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        out = RequestOutput(prompt_token_ids=ids)
        text = TextStream(self.tokenizer, ids, params.stop)
        try:
            self.client.admit(rid)
        except EngineError as e:  # unavailable, or the id is in use
            yield dataclasses.replace(out, finish_reason="error", error=str(e))
            return
        try:
            async for o in self.client.generate(rid, ids, params):
                used = text.add_until_stop(o.token_ids)[1]  # the tokens up to a stop string's end
                out.add(o, used)
                if text.stopped:  # returning closes `generate`, which aborts the request on the ring
                    out.finish_reason = "stop"
                elif o.finish_reason:
                    text.finish()
                    out.finish_reason = o.finish_reason
                out.text = text.text
                yield dataclasses.replace(out, token_ids=list(out.token_ids))
                if out.finish_reason:
                    return
        except EngineError as e:
            yield dataclasses.replace(out, finish_reason="error", error=str(e))
        finally:
            self.client.release(rid)
