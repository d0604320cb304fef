"""A node other than 0: its stages plus a small health endpoint, no front end.

`GET /health` answers 200 while this node's stages are alive and 503 otherwise. The process exits 0 when the
ring is shut down from node 0, and non-zero, with the reason, when a stage or another node fails.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ringsched.config import EngineConfig
from ringsched.process.supervisor import StageFailure, Supervisor
from ringsched.spec import ModelSpec

logger = logging.getLogger("ringsched.launch")


def _health_server(sup: Supervisor, host: str, port: int) -> ThreadingHTTPServer:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            ok = self.path.rstrip("/") == "/health" and sup.alive
            body = json.dumps(
                {"status": "ok" if ok else "unavailable", "node": sup.cfg.node_rank, "stages": sup.local_ranks}
            ).encode()
            self.send_response(200 if ok else (404 if self.path.rstrip("/") != "/health" else 503))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, name="ringsched-health", daemon=True).start()
    return server


def run_headless(cfg: EngineConfig, spec: ModelSpec, host: str, port: int, log_level: str = "info") -> int:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sup = Supervisor(cfg, spec)
    try:
        sup.start()
    except KeyboardInterrupt:
        sup.stop()
        return 130
    except Exception as e:
        logger.error("node %d could not start: %s", cfg.node_rank, e)
        sup.stop()
        return 1
    health = _health_server(sup, host, port)
    logger.info("node %d serving health on http://%s:%d/health", cfg.node_rank, host, port)
    code = 0
    try:
        while not stop.is_set():
            sup.check(timeout_ms=200)
            if all(p.exitcode == 0 for p in sup.procs) or sup.rendezvous.stopped == "":
                logger.info("node %d: the ring was shut down from node 0", cfg.node_rank)
                break
    except StageFailure as e:
        logger.error("node %d stops: %s", cfg.node_rank, e)
        code = 1
    except KeyboardInterrupt:
        code = 130
    finally:
        health.shutdown()
        sup.stop()
        time.sleep(0.1)
    return code
