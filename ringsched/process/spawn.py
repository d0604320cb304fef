"""How stage processes are spawned and what goes with them: a spawn that skips the parent's `__main__`, and
multiprocessing's resource tracker stopped with the last stages."""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def without_main_module() -> Iterator[None]:
    """Spawn a stage without re-importing the parent's `__main__` in it.

    A spawned child imports the parent's main module (`ringsched.launch` pulls in the HTTP server, `bench`
    every benchmark) unless that module has neither a spec nor a file. A stage needs none of it, only
    `stage_main`, which it imports by name; skipping it keeps tens of MB out of every stage's memory."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


def stop_resource_tracker() -> None:
    """multiprocessing starts a resource tracker with the first spawned child; it would exit only after we do,
    leaving a process of ours (and of our process group) behind for a moment. Stop it with the last stages (it
    restarts by itself if stages are spawned again). It exits once every holder of its pipe has closed it, and
    every spawned child holds it: with other engines' stages still alive here, stopping it would wait for them."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None and not mp.active_children():
        stop()
