"""ringsched: a pipeline-parallel LLM inference server (one scheduler per stage, stages in a ring).

`from ringsched import Engine, SamplingParams` is the offline API (`AsyncEngine` its asyncio form); they load
lazily so that `import ringsched` stays light for the command-line tools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringsched.version import __version__ as __version__

__all__ = ["Engine", "AsyncEngine", "SamplingParams", "RequestOutput"]

if TYPE_CHECKING:
    from ringsched.async_engine import AsyncEngine
    from ringsched.engine import Engine, RequestOutput
    from ringsched.sampling.params import SamplingParams


def __getattr__(name: str):
    if name in ("Engine", "RequestOutput"):
        from ringsched import engine

        return getattr(engine, name)
    if name == "AsyncEngine":
        from ringsched.async_engine import AsyncEngine

        return AsyncEngine
    if name == "SamplingParams":
        from ringsched.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'ringsched' has no attribute {name!r}")
