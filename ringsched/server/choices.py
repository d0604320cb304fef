"""A request's `n` sequences (`best_of` of them computed): collected whole, the best kept, merged as they
stream, their usage combined. If one sequence fails, or the request is cancelled, the others are cancelled (and
so aborted) too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ringsched.server.engine_client import EngineError
from ringsched.server.protocol import Prepared
from ringsched.server.serving import Delta, collect, usage


async def collect_all(deltas: list[AsyncIterator[Delta]]) -> list[tuple[str, Delta]]:
    """Every sequence's text and last delta; if one fails (or this is cancelled), the others are cancelled too,
    which aborts them."""
    tasks = [asyncio.ensure_future(collect(d)) for d in deltas]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def best(results: list[tuple[str, Delta]], req: Prepared) -> list[tuple[str, Delta]]:
    """The `n` of `best_of` results with the highest cumulative log-probability (all of them when n == best_of)."""
    if req.best_of > req.n:
        results = sorted(results, key=lambda r: -sum(lp for _, lp, _ in r[1].logprobs))[: req.n]
    if not req.logprobs_asked:
        for _, last in results:
            last.logprobs = []
    return results


def combined_usage(results: list[Delta]) -> dict:
    """One prompt (computed once, its KV shared), every sequence's completion tokens."""
    out = usage(results[0])
    completion = sum(d.completion_tokens for d in results)
    return {**out, "completion_tokens": completion, "total_tokens": out["prompt_tokens"] + completion}


async def merged(deltas: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The sequences' deltas as they come, each with its index; closing it closes (and so aborts) them all."""
    if len(deltas) == 1:
        async with contextlib.aclosing(deltas[0]) as it:
            async for d in it:
                yield 0, d
        return
    pending = {asyncio.ensure_future(anext(d)): i for i, d in enumerate(deltas)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    d = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(deltas[i]))] = i
                yield i, d
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, EngineError):
                await task
        for d in deltas:
            await d.aclose()
