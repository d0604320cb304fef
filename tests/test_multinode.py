"""The ring across machines: two hosts with their own addresses (network namespaces joined by a veth pair),
node 0 in one and node 1 in the other, each started with the same `python -m ringsched.launch` command.

Covered: greedy text equal to a single-node run at PP=2 (with node 1 given memory for fewer layers than its default
share: the nodes measure themselves and split by speed and memory; also with the cut decided while running), PP=4
and PP=2 x TP=2 (two ranks per node); nodes that cannot hold the model refused before any stage starts; with
--max-restarts 0, node 1 killed and the link cut while streams are open (every process gone within
--stage-timeout + 10 s, the error names node 1, every stream ends with an error chunk) and one rank of node 1
killed at TP=2 (the same, the error naming that rank); with restarts, node 1's launcher killed and started again,
or its stage killed and replaced, while streams are open (every stream goes on with its undisturbed text);
rendezvous refusing a different partition and timing out on a missing node.

Every client request runs inside node 0's namespace (`tests/ns_client.py`): the test process itself has no
route to the hosts. Needs root; skipped with the reason where network namespaces are unavailable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
from netns import NetHosts, NsProcess, netns_unavailable

NO_NETNS = netns_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NO_NETNS is not None, reason=f"{NO_NETNS}")]

MODEL = "smollm2-135m-instruct"
CLIENT = str(Path(__file__).with_name("ns_client.py"))
HTTP_PORT, DIST_PORT = 30000, 29500  # each host has its own ports: fixed numbers cannot collide
STAGE_TIMEOUT = 10.0  # the fault tests' deadline is this plus 10 s
FAST_TIMEOUT = 5.0  # below this machine's start-up time on purpose: loading weights is not silence
PROMPT, CHAT, MAX_TOKENS = "The capital of France is", "What is the capital of France?", 16
COMMON = [
    "--model", MODEL, "--threads-per-stage", "1", "--kv-cache-memory", "64M", "--max-model-len", "1024",
    "--host", "0.0.0.0", "--log-level", "info",
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(smollm2_dir) -> dict[str, str]:
    """Greedy texts from a single-node PP=2 run (the offline engine) for the prompts the tests send."""
    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    with Engine(MODEL, pp_size=2, threads_per_stage=1, kv_cache_memory="64M") as llm:
        chat_ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT}])
        outs = llm.generate([PROMPT, chat_ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return {"completion": outs[0].text, "chat": outs[1].text}


@pytest.fixture
def net(tmp_path, smollm2_dir) -> NetHosts:
    with NetHosts(2, tmp_path) as hosts:
        yield hosts
    # The hosts end SIGKILLed, as machines switched off, so each launcher leaves its ipc sockets' directory
    # (`zmq_io.new_ipc_dir`, named by its pid) in the temporary directory: remove them.
    for p in hosts.procs:
        for d in Path(tempfile.gettempdir()).glob(f"ringsched-{p.pid}-*"):
            shutil.rmtree(d, ignore_errors=True)


# -- helpers ---------------------------------------------------------------------------------------------------
def launch(net: NetHosts, rank: int, pp: int, *extra: str, stage_timeout: float = STAGE_TIMEOUT,
           name: str | None = None) -> NsProcess:  # fmt: skip
    argv = [
        sys.executable, "-m", "ringsched.launch", "--pp-size", str(pp), "--nnodes", "2", "--node-rank", str(rank),
        "--dist-init-addr", f"{net.hosts[0].ip}:{DIST_PORT}", "--stage-timeout", str(stage_timeout), *COMMON, *extra,
    ]  # fmt: skip
    return net.spawn(rank, argv, name or f"node{rank}")


def base_url(net: NetHosts) -> str:
    return f"http://{net.hosts[0].ip}:{HTTP_PORT}"


def logs(net: NetHosts, chars: int = 3000) -> str:
    """The tail of every process's log, for assertion messages."""
    return "\n".join(f"--- {p.log_path.name} (exit {p.proc.poll()}):\n{p.log()[-chars:]}" for p in net.procs)


def client(net: NetHosts, *args: str, timeout: float = 120) -> dict:
    """Run `ns_client.py` in node 0's host and return its JSON result."""
    r = net.run(0, [sys.executable, CLIENT, *args], timeout=timeout)
    assert r.returncode == 0, f"client {args[0]} failed:\n{r.stdout}\n{r.stderr}\n{logs(net)}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def wait_ready(net: NetHosts, nodes: list[NsProcess], timeout: float = 180) -> None:
    """Until node 0's server and node 1's health endpoint answer 200, from inside node 0's host."""
    urls = [f"{base_url(net)}/health", f"http://{net.hosts[1].ip}:{HTTP_PORT + 1}/health"]
    waiter = net.spawn(0, [sys.executable, CLIENT, "wait", *urls, "--timeout", str(timeout)], "wait-ready")
    while waiter.poll() is None:
        for n in nodes:
            assert n.poll() is None, f"{n.log_path.name} exited with {n.proc.returncode} while starting\n{logs(net)}"
        time.sleep(0.3)
    assert waiter.proc.returncode == 0, f"{waiter.log()}\n{logs(net)}"
    for n in nodes:
        n.descendants()  # remember every stage process, so that "all gone" sees them too


def assert_greedy(net: NetHosts, reference: dict[str, str], nodes: list[NsProcess]) -> None:
    """The single node's greedy texts from node 0's server, and every node still running after."""
    out = client(net, "greedy", base_url(net), "--prompt", PROMPT, "--chat", CHAT, "--max-tokens", str(MAX_TOKENS))
    assert out == reference, logs(net)
    for n in nodes:
        assert n.poll() is None, logs(net)


def wait_gone(procs: list[NsProcess], timeout: float) -> float | None:
    """Seconds until every process tree in `procs` has exited, or None if one is still running at `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(p.tree_gone() for p in procs):
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def open_streams(net: NetHosts, nodes: list[NsProcess], n: int = 3, *extra: str, name: str = "streams") -> NsProcess:
    """`n` streaming completions from inside node 0's host, once each has its first chunk; every stage process
    is remembered then, so "all gone" sees them."""
    streams = net.spawn(0, [sys.executable, CLIENT, "streams", base_url(net), "--n", str(n), "--timeout", "60", *extra],
                        name)  # fmt: skip
    deadline = time.monotonic() + 60
    while "STARTED" not in streams.log():
        assert streams.poll() is None and time.monotonic() < deadline, f"{streams.log()}\n{logs(net)}"
        time.sleep(0.1)
    for node in nodes:
        node.descendants()
    return streams


def lines_with(text: str, *words: str) -> list[str]:
    return [ln for ln in text.splitlines() if all(w.lower() in ln.lower() for w in words)]


# -- serving across two hosts ----------------------------------------------------------------------------------
# The cut-link test below also sends stage 1's progress across the hosts (`--pp-flex-policy ready`: a tcp channel
# whose address travels through the store), and checks the greedy text before it cuts the link.
READY = ("--pp-flex-layers", "2", "--pp-flex-policy", "ready")
TP2 = ("--tp-size", "2")  # each node runs one stage of two ranks: the seam goes sharded across the hosts
FAIL_STOP = ("--max-restarts", "0")


def test_two_hosts_match_single_node_greedy_at_pp4(net, reference):
    """(PP=2: the less-memory test; with the cut decided while running: the cut-link test; PP=2 x TP=2: below.)"""
    nodes = [launch(net, r, 4, stage_timeout=FAST_TIMEOUT) for r in (0, 1)]
    wait_ready(net, nodes)
    assert_greedy(net, reference, nodes)


def _stage_bytes(smollm2_dir):
    from ringsched.config import EngineConfig
    from ringsched.process.node_measure import stage_bytes
    from ringsched.spec import ModelSpec

    cfg = EngineConfig(model=str(smollm2_dir), pp_size=2, kv_cache_memory="64M", max_model_len=1024)
    return stage_bytes(cfg, ModelSpec.resolve(cfg))


def test_a_node_with_less_memory_gets_fewer_layers_and_serves_then_is_lost(net, reference, smollm2_dir):
    """PP=2 (the plain two-host case) with node 1 given memory for 8 layers, short of its default 13: the nodes
    measure themselves, node 0 splits 22,8 and logs each node's figures, and the text is the single node's. Then,
    with --max-restarts 0, node 1 is killed while streams are open (`kill-node-1` below)."""
    weights = _stage_bytes(smollm2_dir)
    memory = int(weights.need(1, 2, 8) + weights.layer / 2)
    nodes = [launch(net, 0, 2, *FAIL_STOP, stage_timeout=FAST_TIMEOUT),
             launch(net, 1, 2, *FAIL_STOP, "--node-memory", str(memory), stage_timeout=FAST_TIMEOUT)]  # fmt: skip
    wait_ready(net, nodes)
    assert_greedy(net, reference, nodes)
    said = nodes[0].log()
    assert "layer split over nodes: 22,8" in said and "node 1 has" in said, logs(net)
    assert re.search(r"node 1: layer [\d.]+ ms, [\d.]+ GiB \([\d.]+ GiB used\): layers \[8\]", said), logs(net)
    assert lines_with(nodes[1].log(), "layer split over nodes from node 0: 22,8"), logs(net)
    lose_node_1(net, nodes, "kill-node-1")


def test_nodes_that_cannot_hold_the_model_are_refused_before_any_stage_starts(net, smollm2_dir):
    memory = str(int(_stage_bytes(smollm2_dir).need(0, 2, 4)))  # a node holds a few layers, the two not 30
    nodes = [launch(net, r, 2, "--node-memory", memory, "--dist-timeout", "30") for r in (0, 1)]
    for n in nodes:
        assert n.wait(90) not in (None, 0), f"{n.log_path.name} was not refused\n{logs(net)}"
        said = lines_with(n.log(), "cannot hold the model")
        assert said and all(f"node {r}" in said[0] for r in (0, 1)) and "short" in said[0], logs(net)
        assert not lines_with(n.log(), "ready: layers"), f"a stage started\n{logs(net)}"


# -- faults while streams are open ------------------------------------------------------------------------------
def lose_node_1(net: NetHosts, nodes: list[NsProcess], fault: str) -> None:
    """With --max-restarts 0, node 1 lost (`fault`) while streams are open: every process gone within
    --stage-timeout + 10 s, node 0's log naming node 1 and its stage, every stream ended with an error chunk."""
    streams = open_streams(net, nodes)
    if fault == "kill-node-1":
        net.kill_host(1)  # node 1's launcher and stages, SIGKILL: the machine is gone
        survivors = nodes[:1]
    else:
        net.cut(1)  # no reset, no FIN: only a deadline can notice
        survivors = nodes
    bound = STAGE_TIMEOUT + 10
    took = wait_gone(survivors, bound)
    assert took is not None, f"still running {bound:.0f}s after {fault}\n{logs(net)}"
    node0 = nodes[0]
    assert node0.proc.returncode != 0, logs(net)
    assert lines_with(node0.log(), "node 1"), f"node 0's log does not name node 1\n{logs(net)}"
    assert re.search(r"stage\W*1", node0.log()), f"node 0's log does not name the lost stage\n{logs(net)}"
    if fault == "cut-link":  # node 1 survived the cut: it must give up on node 0 as well
        assert nodes[1].proc.returncode != 0, logs(net)
        assert lines_with(nodes[1].log(), "node 0"), f"node 1's log does not name node 0\n{logs(net)}"
    assert streams.wait(15) == 0, f"{streams.log()}\n{logs(net)}"
    results = json.loads(streams.log().strip().splitlines()[-1])
    for r in results:
        assert r["chunks"] > 0 and r["error"] is not None and r["done"], (r, logs(net))
        assert r["transport_error"] is None, (r, logs(net))


def test_the_cut_decided_while_running_matches_single_node_greedy_then_a_cut_link_ends_everything(net, reference):
    """PP=2 with `--pp-flex-policy ready` (READY above): the single node's greedy text; then the link cut. (Node 1
    killed outright: after the less-memory test above, on its hosts.)"""
    nodes = [launch(net, r, 2, *READY, *FAIL_STOP) for r in (0, 1)]
    wait_ready(net, nodes)
    assert_greedy(net, reference, nodes)
    lose_node_1(net, nodes, "cut-link")


def test_tp2_over_two_hosts_matches_single_node_greedy_then_a_killed_rank_ends_every_process_naming_it(net, reference):
    """PP=2 x TP=2: the single node's greedy text; then SIGKILL of node 1's second rank (global rank 3) while streams
    are open."""
    nodes = [launch(net, r, 2, *TP2, *FAIL_STOP, stage_timeout=FAST_TIMEOUT) for r in (0, 1)]
    wait_ready(net, nodes)
    assert_greedy(net, reference, nodes)
    streams = open_streams(net, nodes)
    victims = [p for p in nodes[1].descendants() if p.name() == "ringsched-pp1t1"]
    assert len(victims) == 1, (nodes[1].descendants(), logs(net))
    victims[0].kill()
    bound = STAGE_TIMEOUT + 10
    took = wait_gone(nodes, bound)
    assert took is not None, f"still running {bound:.0f}s after the kill\n{logs(net)}"
    for n in nodes:
        assert n.proc.returncode != 0, logs(net)
        assert lines_with(n.log(), "rank 3", "killed"), f"{n.log_path.name} does not name rank 3\n{logs(net)}"
    assert streams.wait(15) == 0, f"{streams.log()}\n{logs(net)}"
    for r in json.loads(streams.log().strip().splitlines()[-1]):
        assert r["chunks"] > 0 and r["done"] and r["transport_error"] is None, (r, logs(net))
        assert "rank 3" in str(r["error"]), (r, logs(net))


# -- a node started again -------------------------------------------------------------------------------------
def stream_results(streams: NsProcess, net: NetHosts, timeout: float = 120) -> list[dict]:
    assert streams.wait(timeout) == 0, f"{streams.log()}\n{logs(net)}"
    return json.loads(streams.log().strip().splitlines()[-1])


UNDISTURBED: list[dict] = []  # the streams' results on two hosts that lose nothing


@pytest.mark.parametrize("fault", ["launcher", "rank"])
def test_a_node_started_again_or_a_rank_replaced_on_node_1_every_stream_goes_on(net, fault):
    """PP=2 over two hosts, four streams (greedy and seeded) open. `launcher`: node 1's launcher SIGKILLed (its
    stages follow it), then started again with the same flags within --rejoin-timeout. `rank`: node 1's stage
    SIGKILLed, its launcher replacing it. Every stream ends with exactly the text of an undisturbed run, no
    error; both nodes healthy again, nothing of the first node 1 left."""
    args = ("--rejoin-timeout", "60", "--max-restarts", "3", "--enable-deterministic-inference")
    nodes = [launch(net, r, 2, *args) for r in (0, 1)]
    wait_ready(net, nodes)
    streams_args = ("--sampled", "--max-tokens", "96")
    if not UNDISTURBED:  # the same flags and streams each time: one undisturbed run for both faults
        UNDISTURBED.extend(stream_results(open_streams(net, nodes, 4, *streams_args, name="undisturbed"), net))
    undisturbed = UNDISTURBED
    assert all(r["error"] is None and r["done"] for r in undisturbed), (undisturbed, logs(net))

    streams = open_streams(net, nodes, 4, *streams_args)
    time.sleep(1.5)  # some tokens delivered
    first_stages = [p for p in nodes[1].descendants() if p.name() == "ringsched-pp1"]
    assert len(first_stages) == 1, (nodes[1].descendants(), logs(net))
    if fault == "rank":
        first_stages[0].kill()
        live = nodes
    else:
        os.kill(nodes[1].pid, signal.SIGKILL)  # the launcher alone: its stages notice and go
        gone = wait_gone([nodes[1]], 20)
        assert gone is not None, f"node 1's stages outlived their launcher: {nodes[1].leftovers()}\n{logs(net)}"
        time.sleep(max(4.0 - gone, 0))  # node 0 says it waits for node 1 after 3 s without an answer
        live = [nodes[0], launch(net, 1, 2, *args, name="node1-again")]
    results = stream_results(streams, net, timeout=180)
    for r, u in zip(results, undisturbed, strict=True):
        assert r["error"] is None and r["transport_error"] is None and r["done"], (r, logs(net))
        assert r["text"] == u["text"], (r["text"], u["text"], logs(net))
    wait_ready(net, live, timeout=60)
    assert not first_stages[0].is_running() or first_stages[0].status() == "zombie", logs(net)
    said = lines_with(nodes[0].log(), "stage 1 (node 1)", "restart 1 of --max-restarts 3")
    assert said, f"node 0's log does not count the replacement\n{logs(net)}"
    if fault == "launcher":
        assert lines_with(nodes[0].log(), "node 1", "rejoin"), f"node 0's log does not say it waited\n{logs(net)}"
        assert lines_with(live[1].log(), "rejoins"), logs(net)
    else:
        assert lines_with(nodes[1].log(), "stage 1", "killed", "replacing"), logs(net)


def test_a_partition_longer_than_the_stage_timeout_heals(net):
    """PP=2 over two hosts, four streams open, node 1's link down for 9 s with --stage-timeout 5: both nodes wait
    for each other (up to --rejoin-timeout), the ring is rebuilt once the link is back, and every stream ends with
    exactly the text of an undisturbed run."""
    args = ("--rejoin-timeout", "60", "--max-restarts", "3", "--enable-deterministic-inference")
    nodes = [launch(net, r, 2, *args, stage_timeout=5) for r in (0, 1)]
    wait_ready(net, nodes)
    streams_args = ("--sampled", "--max-tokens", "96")
    if not UNDISTURBED:
        UNDISTURBED.extend(stream_results(open_streams(net, nodes, 4, *streams_args, name="undisturbed"), net))
    streams = open_streams(net, nodes, 4, *streams_args)
    time.sleep(1.5)  # some tokens delivered
    net.cut(1)
    time.sleep(9)
    net.heal(1)
    results = stream_results(streams, net, timeout=180)
    for r, u in zip(results, UNDISTURBED, strict=True):
        assert r["error"] is None and r["transport_error"] is None and r["done"], (r, logs(net))
        assert r["text"] == u["text"], (r["text"], u["text"], logs(net))
    wait_ready(net, nodes, timeout=60)


# -- rendezvous --------------------------------------------------------------------------------------------------
def test_node_with_a_different_partition_is_refused(net):
    nodes = [
        launch(net, 0, 2, "--pp-layer-partition", "15,15", "--dist-timeout", "30"),
        launch(net, 1, 2, "--pp-layer-partition", "10,20", "--dist-timeout", "30"),
    ]
    code = nodes[1].wait(90)
    assert code not in (None, 0), f"node 1 was not refused\n{logs(net)}"
    said = lines_with(nodes[1].log(), "partition", "node 0", "node 1")
    assert said, f"node 1's log has no line naming the partition and both nodes\n{logs(net)}"
    assert any(re.search(r"15\D{1,3}15", s) and re.search(r"10\D{1,3}20", s) for s in said), (said, logs(net))


def test_missing_node_times_out_naming_it(net):
    node0 = launch(net, 0, 2, "--dist-timeout", "5")
    code = node0.wait(90)
    assert code not in (None, 0), f"node 0 did not give up on the rendezvous\n{logs(net)}"
    said = lines_with(node0.log(), "rendezvous")
    assert any(re.search(r"\b(node|rank)s?\b\D{0,12}\b1\b", s) for s in said), f"{said}\n{logs(net)}"
    assert wait_gone([node0], 10) is not None, logs(net)
