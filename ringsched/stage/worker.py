"""One stage process: set up (threads, process group, weights, KV pool, sockets), report ready, run the loop.

Any exception is reported to the launcher as a `StageStatus("error")` with the traceback before the process
exits non-zero, so the launcher can stop the others and say which stage failed and why. With `--max-restarts`
above 0, losing a neighbour (`PeerLost`) or the supervisor's request to rejoin (`Rejoin`) is not an error: the
rank reports `lost`, leaves its generation of the ring and joins the next one (`stage/rejoin.py`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

import zmq

from ringsched.comm.messages import StageStatus
from ringsched.comm.zmq_io import Pusher
from ringsched.config import EngineConfig
from ringsched.layout.rank import RankInfo
from ringsched.spec import ModelSpec
from ringsched.stage import rejoin
from ringsched.stage.channels import StageAddrs
from ringsched.stage.loop import PeerLost
from ringsched.stage.setup import ParentGone, RankSetup

logger = logging.getLogger("ringsched.layout.rank")


def stage_main(cfg: EngineConfig, spec: ModelSpec, where: RankInfo, addrs: StageAddrs, generation: int = 0) -> None:
    """A rank's process. `generation`: the ring's generation it starts in (above 0: it replaces a failed rank)."""
    rank = where.rank
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format=f"[{cfg.describe_rank(rank)}] %(asctime)s %(levelname)s %(message)s",
        force=True,
    )
    _set_process_name(
        process_name(where.pp, where.tp if cfg.tp_size > 1 else None, where.cp if cfg.cp_size > 1 else None)
    )
    # Ctrl-C in a terminal, and scancel or systemd's SIGTERM, reach the whole process group; the launcher owns
    # shutdown, so a stage ignores them and stops when told to (Shutdown plan), when its parent is gone, or by
    # the launcher's SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rejoin.install()
    ctx = zmq.Context()
    ctl = Pusher(ctx, addrs.ctl)
    try:
        _serve(RankSetup(cfg, spec, where, addrs, ctx, ctl), ctl, generation)
        ctl.send(StageStatus(rank, "exited"))
        logger.info("stopped")
    except BaseException as e:  # report everything, KeyboardInterrupt included
        if not isinstance(e, (KeyboardInterrupt, ParentGone)):
            ctl.send(StageStatus(rank, "error", error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            logger.error("failed: %s", e)
        ctl.close()
        ctx.destroy(linger=1000)
        os._exit(1)
    ctl.close()
    ctx.destroy(linger=1000)
    os._exit(0)  # skip interpreter teardown: a peer's pending gloo work must not hang our exit


def _serve(setup: RankSetup, ctl: Pusher, generation: int) -> None:
    """Connect, report ready, run the loop; on losing the ring (with restarts allowed), leave and join again."""
    rank, beating = setup.where.rank, False
    while True:
        info = setup.connect(generation)[1]  # the loop lives in `setup` alone, so `leave` can let it go
        if not beating:
            _start_heartbeat(setup.ctx, setup.addrs.ctl, rank, setup)
            beating = True
        ctl.send(StageStatus(rank, "ready", info))
        try:
            setup.loop.run()
            return
        except (PeerLost, rejoin.Rejoin) as e:
            if not setup.cfg.restarts_enabled:
                raise
            logger.warning("left generation %d of the ring: %s", generation, e)
            ctl.send(StageStatus(rank, "lost", error=f"{type(e).__name__}: {e}"))
        setup.leave()
        generation = rejoin.wait_generation(setup.store, generation, setup.parent_alive)


HEARTBEAT_PERIOD_S = 0.5


def _start_heartbeat(ctx: zmq.Context, addr: str, rank: int, setup: RankSetup) -> None:
    """A thread that tells the supervisor, every `HEARTBEAT_PERIOD_S`, that this process runs and how far its loop
    got: silence means the process is hung (stopped, or stuck holding the GIL); a step counter that stands
    still while the loop is inside a step means the loop is stuck. The thread has its own socket (ZMQ sockets
    are not thread-safe) and dies with the process."""

    def beat() -> None:
        try:
            sock = Pusher(ctx, addr)
            while True:
                sock.send(StageStatus(rank, "heartbeat", _progress(setup)))
                time.sleep(HEARTBEAT_PERIOD_S)
        except zmq.ZMQError:  # the process is closing its sockets on the way down: nothing left to tell
            return

    threading.Thread(target=beat, name=f"heartbeat-{rank}", daemon=True).start()


def _progress(setup: RankSetup) -> dict:
    """The heartbeat's account of the loop, without holding on to it: a loop left behind by `leave` must go at
    once, its process group's connections with it."""
    loop = setup.loop  # None between generations
    return {"sent_at": time.monotonic(), "steps": loop.steps if loop else 0, "in_step": bool(loop and loop.in_step)}


def process_name(stage: int, tp: int | None = None, cp: int | None = None) -> str:
    """What `ps`, `top` and `pgrep` show for a rank: `ringsched-pp1`, or `ringsched-pp1t0` for tensor-parallel
    rank 0 of stage 1 (`ringsched-pp1c0`: context-parallel); at most 15 characters, the kernel's limit."""
    return f"ringsched-pp{stage}" + (f"t{tp}" if tp is not None else "") + (f"c{cp}" if cp is not None else "")


def _set_process_name(name: str) -> None:
    """So `ps`/`top` (and psutil's `name()`) show which stage a process is."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass
