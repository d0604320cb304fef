"""Every user grammar is proven in a helper process before its request is accepted.

Contract: `await pool.prove(form)` returns the llguidance grammar of a `grammar_for` form, or raises `GrammarError` (the
request's 400): a bound of `grammar_limits` passed (checked here, in linear time), or the helper's own refusal, or the
helper died on it (a native stack overflow, its memory cap) or took longer than `timeout_s`; a dead or timed-out helper
is replaced. `GrammarBusy` (503) when no helper could be had within `timeout_s` (plus a start-up's while one is
starting). The helpers (`grammar_helper.py`, `workers` of them) are separate Python processes, started with `start()` or
on the first `prove`, ended by `close()` and by the kernel when this process dies. A grammar the pool returned has
already built a matcher and its first token mask with the same tokenizer and code the last stage uses, within the time
and memory caps, so the last stage builds only proven grammars.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from dataclasses import dataclass

from ringsched.sampling.structured import GrammarError
from ringsched.server.grammar_limits import GrammarLimits, check_form

logger = logging.getLogger("ringsched.server")

_READY_S = 60.0  # a helper's start: Python, llguidance and the model's tokenizer (~0.4 s on an idle CPU)
_LINE_LIMIT = 64 * 2**20  # a grammar's answer line: the grammar text (schemas are bounded far below this)


class GrammarBusy(RuntimeError):
    """No helper was free in time: the server is busy checking grammars, not the request at fault."""


@dataclass(frozen=True)
class PoolConfig:
    model_dir: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    workers: int = 2
    timeout_s: float = 5.0
    memory_mb: int = 1024
    limits: GrammarLimits = GrammarLimits()

    def argv(self) -> list[str]:
        eos = ",".join(str(t) for t in self.eos_ids)
        return [
            sys.executable,
            "-m",
            "ringsched.server.grammar_helper",
            self.model_dir,
            str(self.vocab_size),
            eos,
            str(self.memory_mb),
        ]


class _HelperGone(Exception):
    pass


class _Helper:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, cfg: PoolConfig) -> _Helper:
        proc = await asyncio.create_subprocess_exec(
            *cfg.argv(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=_LINE_LIMIT
        )
        helper = cls(proc)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), _READY_S)
        except asyncio.TimeoutError:
            line = b""
        except BaseException:  # cancelled while starting (the server closing): end and reap it before we go
            await asyncio.shield(helper.kill())
            raise
        if json.loads(line or b"{}").get("ready") is not True:
            await helper.kill()
            raise RuntimeError(f"a grammar helper did not start (exit code {proc.returncode})")
        return helper

    async def ask(self, form: dict, timeout_s: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"form": form}).encode() + b"\n")
            await self.proc.stdin.drain()
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        except asyncio.TimeoutError:
            await self.kill()
            raise _HelperGone(f"checking it took longer than {timeout_s:g} s") from None
        except (OSError, RuntimeError):  # its pipe is gone (uvloop says so with a RuntimeError): it died
            line = b""
        if not line:
            code = await self.kill()
            raise _HelperGone(f"it crashed the process that checks grammars (exit code {code})")
        return json.loads(line)

    async def kill(self) -> int | None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        return await self.proc.wait()


class GrammarPool:
    def __init__(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self._idle: asyncio.Queue[_Helper] | None = None
        self._helpers: set[_Helper] = set()
        self._spawning: set[asyncio.Task] = set()
        self.replaced = 0  # helpers that died or timed out and were replaced

    def start(self) -> None:
        """Start the helpers (in the running loop; idempotent)."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.cfg.workers):
                self._spawn()

    def _spawn(self) -> None:
        task = asyncio.ensure_future(self._add())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def _add(self) -> None:
        try:
            helper = await _Helper.spawn(self.cfg)
        except Exception as e:
            logger.error("a grammar helper failed to start: %s", e)
            return
        self._helpers.add(helper)
        self._idle.put_nowait(helper)

    async def prove(self, form: dict) -> str:
        check_form(form, self.cfg.limits)
        self.start()
        wait = self.cfg.timeout_s + (_READY_S if self._spawning else 0.0)  # a helper starting is worth waiting for
        try:
            helper = await asyncio.wait_for(self._idle.get(), wait)
        except asyncio.TimeoutError:
            raise GrammarBusy(f"every grammar checker was busy for {wait:g} s; try again") from None
        try:
            answer = await helper.ask(form, self.cfg.timeout_s)
        except _HelperGone as e:
            self._helpers.discard(helper)
            self.replaced += 1
            logger.warning("a grammar helper was lost (%s); starting another", e)
            self._spawn()
            raise GrammarError(str(e)) from None
        except BaseException:  # cancelled mid-answer: its next line would belong to this request, so end it
            self._helpers.discard(helper)
            await helper.kill()
            self._spawn()
            raise
        self._idle.put_nowait(helper)
        if "error" in answer:
            raise GrammarError(answer["error"])
        return answer["grammar"]

    async def close(self) -> None:
        for task in list(self._spawning):
            task.cancel()
        await asyncio.gather(*self._spawning, return_exceptions=True)
        for helper in list(self._helpers):
            await helper.kill()
        self._helpers.clear()
