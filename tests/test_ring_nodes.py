"""The nodes' part in a recovery (`process/ring_nodes.py`) over one store, without processes: node 0 begins and
publishes a pass, another node follows it or asks for it, a node started again counts once, a node that never
comes back ends the recovery naming it and --rejoin-timeout."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import HashStore

from ringsched.process.ring_nodes import Coordinator, Follower, NodesFailed
from ringsched.stage import rejoin


def _describe(n: int) -> str:
    return f"node {n} (stages {n}-{n})"


def _pair(rejoin_timeout: float = 10.0, stopped=lambda: None) -> tuple[Coordinator, Follower, HashStore]:
    store = HashStore()
    coord = Coordinator(store, 0, 2, rejoin_timeout, stopped, _describe)
    return coord, Follower(store, 1, 2, rejoin_timeout, stopped, _describe), store


def _in_thread(fn, *args):
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn(*args)), daemon=True)
    t.start()
    return t, out


def test_a_pass_begun_by_node_0_is_followed_and_counted():
    coord, follower, store = _pair()
    assert not follower.pending(0)
    assert coord.begin(1) == 1
    follower.watch()
    assert follower.pending(0) and not follower.pending(1)
    assert follower.begin(1) == 1
    follower.left(1, {1: "ringsched-pp1 (pid 7) was killed by signal 9"})
    failed, restarts = coord.left(1, {})
    assert failed == {1: "ringsched-pp1 (pid 7) was killed by signal 9"} and restarts == 1
    coord.publish(1)
    assert int(store.add(rejoin.GENERATION_KEY, 0)) == 1
    t, out = _in_thread(coord.ready, 1, {})
    follower.ready(1, {})
    t.join(5)
    assert out["value"] == {}


def test_a_node_asks_for_a_pass_and_waits_for_it():
    coord, follower, _ = _pair()
    t, out = _in_thread(follower.begin, 1)
    for _ in range(100):
        if coord.pending(0):
            break
        threading.Event().wait(0.02)
    assert coord.pending(0)
    assert coord.begin(1) == 1
    t.join(5)
    assert out["value"] == 1
    assert not coord.pending(1)  # the request is the pass just begun


def test_a_node_started_again_counts_once_and_failures_during_the_start_come_back():
    coord, follower, _ = _pair()
    coord.begin(1)
    follower.left(1, {2: "node 1's launcher was started again", 3: "node 1's launcher was started again"},
                  restart=True)  # fmt: skip
    failed, restarts = coord.left(1, {})
    assert sorted(failed) == [2, 3] and restarts == 1
    follower.ready(1, {3: "ringsched-pp1t1 exited with code 1"})
    assert coord.ready(1, {}) == {3: "ringsched-pp1t1 exited with code 1"}


def test_a_node_that_does_not_come_back_ends_the_recovery_naming_it():
    coord, _, _ = _pair(rejoin_timeout=0.3)
    coord.begin(1)
    with pytest.raises(NodesFailed, match=r"node 1 \(stages 1-1\).*--rejoin-timeout 0.3s.*--node-rank 1"):
        coord.left(1, {})


def test_the_rejoin_timeout_counts_from_the_nodes_last_sign_of_life(monkeypatch):
    """A node silent for a while before the pass began (a cut link noticed after --stage-timeout) gets what is left
    of --rejoin-timeout, not all of it again: the streams' error comes within --rejoin-timeout of the cut."""
    import time

    from ringsched.process import ring_nodes

    monkeypatch.setattr(ring_nodes, "ANSWER_S", 0.1)  # the first look before the warning that it waits
    store = HashStore()
    silent_since = time.monotonic() - 100.0  # last heard 100 s ago, of a 100.5 s rejoin timeout
    coord = Coordinator(store, 0, 2, 100.5, lambda: None, _describe, lambda n: silent_since)
    coord.begin(1)
    start = time.monotonic()
    with pytest.raises(NodesFailed, match="did not come back within --rejoin-timeout"):
        coord.left(1, {})
    assert time.monotonic() - start < 2  # the first look and what was left (0.5 s), not 100 s


def test_a_follower_gives_up_when_node_0_stops_the_ring():
    stop: list[str] = []
    _, follower, _ = _pair(stopped=lambda: stop[0] if stop else None)
    t, out = _in_thread(lambda: _catch(follower.begin, 1))
    stop.append("stage 0 failed")
    t.join(5)
    assert "stage 0 failed" in out["value"]


def _catch(fn, *args) -> str:
    try:
        fn(*args)
    except NodesFailed as e:
        return str(e)
    return "no error"
