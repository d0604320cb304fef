"""Where the nodes meet: a `torch.distributed.TCPStore` hosted by node 0's launcher at `--dist-init-addr`.

Every node's launcher joins it, publishes what it runs (model, partition, version, address) and waits, up to
`--dist-timeout`, for the others; a node that disagrees with node 0 is refused with a message naming both
sides. The stage processes then use the same store for `torch.distributed` and to exchange their ZMQ
endpoints. After the start, each launcher heartbeats through the store, so a node that dies or a link that is
cut is noticed within `--stage-timeout` even when the ring is idle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from torch.distributed import PrefixStore

from ringsched.comm.store import RendezvousError, connect_store, route_ip, split_addr
from ringsched.config import EngineConfig
from ringsched.layout.partition import head_layers, log_partition, partition_source
from ringsched.process.node_exchange import settle_split, split_mode, why_measure
from ringsched.process.node_measure import hardware
from ringsched.spec import ModelSpec
from ringsched.version import __version__

logger = logging.getLogger("ringsched.launch")


def meet(cfg: EngineConfig, spec: ModelSpec, partition: list[int] | None) -> tuple[Rendezvous, EngineConfig, ModelSpec]:
    """Join the rendezvous with this node's `partition`; the config and spec then carry the partition node 0 runs
    (the stages, and this node when it left `auto` to node 0, take it)."""
    given, auto = cfg.pp_layer_partition, cfg.auto_partition  # before the stages are told the split
    rdv = Rendezvous(cfg, cfg.model, spec.model_dir, partition)
    rdv.join()
    reason = why_measure(cfg, spec, rdv.metas, rdv.partition)
    if reason:  # nodes not alike: each measures itself, node 0 decides (`process/node_exchange.py`)
        rdv.partition = settle_split(rdv.nodes, cfg, spec, reason)
    cfg = replace(cfg, host_ip=rdv.host_ip, pp_layer_partition=",".join(map(str, rdv.partition)))
    cfg.check_partition(sum(rdv.partition))  # `auto` may leave no room for the flex
    spec = spec.with_partition(rdv.partition)
    if cfg.node_rank == 0 and not reason:  # `auto` logged its measured costs; else the head weighs as by default
        log_partition(rdv.partition, partition_source(given), 0.0 if auto else head_layers(spec.config))
    if cfg.nnodes > 1:
        logger.info(
            "node %d of %d joined the rendezvous at %s as %s; ranks %s run here",
            cfg.node_rank,
            cfg.nnodes,
            cfg.dist_init_addr,
            cfg.host_ip,
            list(cfg.local_ranks),
        )
    return rdv, cfg, spec


def model_fingerprint(model_dir: str) -> str:
    """What identifies a model directory's content, wherever it is: config.json, tokenizer.json, and each weight
    file's size and safetensors header (every tensor's name, dtype, shape and place; the weights' bytes are not
    read, which would take minutes for a large model)."""
    from pathlib import Path

    from ringsched.weights.model_files import weight_files

    root, digest = Path(model_dir), hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        digest.update((root / name).read_bytes() if (root / name).is_file() else b"-")
    for path in weight_files(root):
        with open(path, "rb") as f:
            head = f.read(8)
            digest.update(f"{path.name}:{path.stat().st_size}:".encode() + head)
            digest.update(f.read(int.from_bytes(head, "little")))
    return digest.hexdigest()[:16]


class Rendezvous:
    def __init__(self, cfg: EngineConfig, model_name: str, model_dir: str, partition: list[int] | None) -> None:
        self.cfg = cfg
        self.host_ip = cfg.host_ip or route_ip(split_addr(cfg.dist_init_addr)[0])
        self.meta = {
            "node": cfg.node_rank,
            "host_ip": self.host_ip,
            "version": __version__,
            "model": model_name,
            "model_config": model_fingerprint(model_dir),
            "partition": partition,
            "pp_size": cfg.pp_size,
            "tp_size": cfg.tp_size,
            "cp_size": cfg.cp_size,
            "nnodes": cfg.nnodes,
            "hardware": hardware(cfg) if cfg.nnodes > 1 else None,
            "split": split_mode(cfg),
        }
        try:
            self.store = connect_store(cfg, is_master=cfg.node_rank == 0)
        except RuntimeError as e:  # torch's message is a C++ trace; keep its first line
            what = "host the rendezvous at" if cfg.node_rank == 0 else "reach the rendezvous at"
            raise RendezvousError(
                f"node {cfg.node_rank} could not {what} {cfg.dist_init_addr} within --dist-timeout "
                f"{cfg.dist_timeout:.0f}s: {str(e).splitlines()[0]}; check that node 0 runs and the port is open"
            ) from None
        self.nodes = PrefixStore("nodes", self.store)
        self.partition = partition  # after join(): the partition node 0 runs
        self.metas: list[dict] = []  # after join(): every node's published meta, by node
        self.failure: str | None = None
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {}
        self._heard: dict[int, float] = {}
        self.stopped: str | None = None  # node 0 ended the ring: "" when cleanly, else why
        # Why a node's ring failed, as its own supervisor saw it (the root cause: which rank died), published
        # through the store so the other nodes can name it instead of only the neighbour they lost. Threads write
        # ours and read theirs (a store call can block on a cut link; the supervisor's must not).
        self.remote_failures: dict[int, str] = {}
        self._publisher: threading.Thread | None = None

    def join(self) -> None:
        """Publish this node and wait for the others; raise `RendezvousError` on a timeout or a mismatch."""
        r = self.cfg.node_rank
        self.nodes.set(f"meta/{r}", json.dumps(self.meta))
        deadline = time.monotonic() + self.cfg.dist_timeout
        keys = [f"meta/{n}" for n in range(self.cfg.nnodes)]
        while True:
            present = [n for n, k in enumerate(keys) if self.nodes.check([k])]
            if len(present) == self.cfg.nnodes:
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.cfg.nnodes)) - set(present))
                spn = self.cfg.stages_per_node
                stages = [list(range(n * spn, (n + 1) * spn)) for n in missing]  # whole stages per node
                raise RendezvousError(
                    f"rendezvous at {self.cfg.dist_init_addr} timed out after {self.cfg.dist_timeout:.0f}s: "
                    f"node(s) {missing} (stages {stages}) never joined; start them with --node-rank and the same "
                    "--dist-init-addr, or raise --dist-timeout"
                )
            time.sleep(0.2)
        others = self.metas = [json.loads(self.nodes.get(k)) for k in keys]
        for other in others:
            self._compare(other)
        self.partition = others[0]["partition"]  # node 0 decides (`auto` elsewhere takes it)

    def _compare(self, other: dict) -> None:
        me = self.meta
        for key, flag in (
            ("pp_size", "--pp-size"),
            ("tp_size", "--tp-size"),
            ("cp_size", "--cp-size"),
            ("nnodes", "--nnodes"),
            ("partition", "--pp-layer-partition"),
            ("model_config", "--model (its config, tokenizer and weights; the path may differ)"),
            ("version", "ringsched"),
        ):
            if key == "partition" and None in (other[key], me[key]):
                continue  # a node started with `auto` below node 0 takes node 0's split
            if other[key] != me[key]:
                if self.cfg.node_rank == 0:
                    time.sleep(2.0)  # let the refused node read node 0's entry before the store goes away
                raise RendezvousError(
                    f"node {other['node']} was started with {key} {other[key]} but node {me['node']} with "
                    f"{me[key]}: every node must run the same {flag}; node {other['node']} is refused"
                    if other["node"] != 0
                    else f"node {me['node']} was started with {key} {me[key]} but node 0 with {other[key]}: every node "
                    f"must run the same {flag}; node {me['node']} is refused"
                )

    def addresses(self) -> dict[int, str]:
        return {n: json.loads(self.nodes.get(f"meta/{n}"))["host_ip"] for n in range(self.cfg.nnodes)}

    # -- heartbeat -----------------------------------------------------------------------------------------
    def start_heartbeat(self, period: float = 1.0, on_beat: Callable[[], None] | None = None) -> None:
        """Beat, and watch the other nodes' beats; `on_beat` also runs each period, in the same thread."""
        if self.cfg.nnodes == 1:
            return
        watched = range(1, self.cfg.nnodes) if self.cfg.node_rank == 0 else [0]
        now = time.monotonic()
        self._seen = {n: (-1, now) for n in watched}
        self._heard = dict.fromkeys(watched, now)  # as `_seen`'s times, but never reset by `forgive`
        self._last_ok = now  # loading the stages is not silence

        def beat() -> None:
            while not self._stop.wait(period):
                try:
                    if self.cfg.node_rank > 0 and self.nodes.check(["stop"]):
                        self.stopped = self.nodes.get("stop").decode()
                    for n in range(self.cfg.nnodes):
                        if n != self.cfg.node_rank and n not in self.remote_failures:
                            if self.nodes.check([f"failed/{n}"]):
                                self.remote_failures[n] = self.nodes.get(f"failed/{n}").decode()
                    if on_beat is not None:
                        on_beat()
                    self.nodes.add(f"hb/{self.cfg.node_rank}", 1)
                    for n in watched:
                        count = self.nodes.add(f"hb/{n}", 0)
                        if count != self._seen[n][0]:
                            self._seen[n] = (count, time.monotonic())
                            self._heard[n] = self._seen[n][1]
                    self._last_ok = time.monotonic()
                except Exception:  # a cut link: the watchdog below notices the silence
                    pass

        threading.Thread(target=beat, name="ringsched-heartbeat", daemon=True).start()

    @property
    def silence_limit(self) -> float:
        """How long a watched node may be silent: `--stage-timeout`; on a node other than 0 with --max-restarts,
        `--rejoin-timeout`, so that it outwaits a partition (node 0 notices the silence after --stage-timeout and
        waits for this node up to --rejoin-timeout; once the link is back the two rebuild the ring)."""
        if self.cfg.node_rank > 0 and self.cfg.restarts_enabled:
            return max(self.cfg.rejoin_timeout, self.cfg.stage_timeout)
        return self.cfg.stage_timeout

    def check(self) -> str | None:
        """A failure message once a watched node has been silent for longer than `silence_limit`."""
        if self.failure or self.cfg.nnodes == 1 or not self._seen:
            return self.failure
        if self.stopped:
            self.failure = f"node 0 stopped the ring: {self.stopped}"
            return self.failure
        now, limit = time.monotonic(), self.silence_limit
        if now - self._last_ok > limit:
            self.failure = (
                f"node {self.cfg.node_rank} lost the rendezvous at {self.cfg.dist_init_addr} (node 0) for "
                f"{now - self._last_ok:.0f}s: node 0 died or the link to it is cut"
            )
        for n, (_, seen) in self._seen.items():
            if now - seen > limit and not self.failure:
                spn = self.cfg.stages_per_node
                self.failure = (
                    f"node {n} (stages {n * spn}-{(n + 1) * spn - 1}) stopped answering {now - seen:.0f}s ago: it died "
                    "or the link to it is cut"
                )
        return self.failure

    def last_seen(self, node: int) -> float:
        """When `node` last beat (`time.monotonic()`; now if it is not watched)."""
        return self._heard.get(node, time.monotonic())

    def forgive(self) -> None:
        """A recovery has dealt with the silence `check` found: watch every node afresh."""
        now = time.monotonic()
        self.failure, self._last_ok = None, now
        self._seen = {n: (count, now) for n, (count, _) in self._seen.items()}

    def publish_failure(self, reason: str) -> None:
        """This node's root cause, for the other nodes: written by a thread of its own, which `close` waits for
        a moment (the launcher is about to stop)."""
        if self.cfg.nnodes == 1 or self._publisher is not None:
            return

        def write() -> None:
            try:
                self.nodes.set(f"failed/{self.cfg.node_rank}", reason.splitlines()[0])
            except Exception:  # the store is gone: the others notice this node's silence instead
                pass

        self._publisher = threading.Thread(target=write, name="ringsched-failure", daemon=True)
        self._publisher.start()

    def wait_remote_failure(self, timeout: float) -> str | None:
        """Another node's published root cause, waiting up to `timeout` for one to arrive."""
        deadline = time.monotonic() + timeout
        while not self.remote_failures and time.monotonic() < deadline and self.cfg.nnodes > 1:
            time.sleep(0.1)
        return "; ".join(f"node {n}: {why}" for n, why in sorted(self.remote_failures.items())) or None

    def announce_stop(self, reason: str) -> None:
        """Node 0 tells the other nodes the ring is over (and why, if it failed), so they exit promptly."""
        if self.cfg.node_rank == 0 and self.cfg.nnodes > 1:
            try:
                self.nodes.set("stop", reason)
                time.sleep(1.5)  # the others poll once a second; keep the store up until they have read it
            except Exception:
                pass

    def close(self) -> None:
        self._stop.set()
        if self._publisher is not None:
            self._publisher.join(2.0)
