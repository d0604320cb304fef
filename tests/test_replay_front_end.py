"""The front ends' side of a replay (issue 47), without a model: what `OpenRequests` keeps and resubmits, and
`EngineClient.replay_open` over real ZMQ sockets, a fake stage 0 that dies and a fresh one that replaces it
(tests/fake_ring.py). The continuation itself is checked on a real ring in test_replay_engine.py."""

from __future__ import annotations

import asyncio
import logging
import time

from fake_ring import FakeRing, FakeSupervisor

from ringsched.comm.messages import NewRequest, TokenOutput
from ringsched.config import EngineConfig
from ringsched.replay import OpenRequests
from ringsched.sampling.params import SamplingParams
from ringsched.server.engine_client import EngineClient


def test_open_requests_resubmit_what_was_delivered_and_not_what_ended(caplog):
    reqs = OpenRequests()
    for rid in ("a", "b", "c", "d"):
        reqs.sent(NewRequest(rid, [1, 2, 3], {"max_tokens": 9, "seed": 7}))
    reqs.delivered(TokenOutput("a", [10]))
    reqs.delivered(TokenOutput("a", [11, 12]))
    reqs.delivered(TokenOutput("b", [20], "length"))  # finished on the ring
    reqs.ended("c")  # aborted by the front end (a stop string, a client that left)
    reqs.delivered(TokenOutput("zzz", [1]))  # not ours: ignored
    with caplog.at_level(logging.INFO, logger="ringsched.replay"):
        out = reqs.replays()
    assert [(n.rid, n.token_ids, n.params, n.output_ids) for n in out] == [
        ("a", [1, 2, 3], {"max_tokens": 9, "seed": 7}, [10, 11, 12]),
        ("d", [1, 2, 3], {"max_tokens": 9, "seed": 7}, []),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        "replaying request a with 3 delivered token(s)",
        "replaying request d with 0 delivered token(s)",
    ]
    assert reqs.replayed == 2
    reqs.delivered(TokenOutput("a", [13]))  # the fresh ring goes on: a second replay carries all four
    assert [n.output_ids for n in reqs.replays()] == [[10, 11, 12, 13], []] and reqs.replayed == 4


def test_front_ends_seed_unseeded_random_requests_in_arrival_order():
    import random

    rng, again = random.Random(5), random.Random(5)
    p = SamplingParams(temperature=0.7)
    seeds = [p.seeded(rng).seed for _ in range(3)]
    assert seeds == [again.randrange(2**31) for _ in range(3)] and len(set(seeds)) == 3
    assert SamplingParams(temperature=0).seeded(rng).seed is None  # greedy needs none
    assert SamplingParams(temperature=0.7, seed=3).seeded(rng).seed == 3


async def _tokens(it, n: int) -> list[int]:
    """At least `n` more tokens from a request's outputs."""
    out = []
    while len(out) < n:
        out += (await it.__anext__()).token_ids
    return out


def test_engine_client_replay_open_resubmits_open_requests_once_to_a_fresh_stage_0():
    sup = FakeSupervisor()
    old = FakeRing(sup.addrs, step_s=0.001)
    client = EngineClient(EngineConfig(seed=11), None, supervisor=sup)
    fresh: FakeRing | None = None

    async def main():
        nonlocal fresh
        client.start_routing()
        gens = {}
        for rid, max_tokens in (("long", 10_000), ("short", 2), ("gone", 10_000)):
            client.admit(rid)
            gens[rid] = client.generate(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0.8))
        got = await _tokens(gens["long"], 3)
        assert [o.finish_reason async for o in gens["short"]][-1] == "length"  # ended on the ring
        await gens["gone"].__anext__()
        await gens["gone"].aclose()  # its caller left: released and aborted
        old.mode = "hold"
        await asyncio.sleep(0.05)  # let routing take what the old ring sent
        delivered = client.open_requests.open["long"].delivered
        assert delivered[:3] == got
        old.close()  # stage 0 dies
        client.abort("long")  # queued for the dead stage 0: the fresh one must never see it
        client.admit("late")  # sent while no stage 0 runs: replayed, once
        late = client.generate("late", [8], SamplingParams(max_tokens=4, temperature=0.8))
        late_task = asyncio.ensure_future(late.__anext__())
        await asyncio.sleep(0.05)
        assert await client.replay_open() == 2 and client.requests_replayed == 2
        fresh = FakeRing(sup.addrs, step_s=0.001)  # binds front-in after the replays were queued
        more = await _tokens(gens["long"], 2)  # the stream goes on after a pause, no error
        assert more and (await late_task).token_ids
        for _ in range(100):
            if len(fresh.received) == 2:
                break
            await asyncio.sleep(0.02)
        assert sorted(fresh.received) == ["late", "long"] and fresh.aborted == []  # each once, no stale abort
        replays = {n.rid: n for n in client.open_requests.replays()}  # what a second replay would carry
        assert replays["long"].output_ids[: len(delivered)] == delivered
        assert replays["long"].params["seed"] is not None  # the front end's seed travels with the request
        await client.close()

    try:
        asyncio.run(main())
    finally:
        client.close_sync()
        old.close()
        if fresh is not None:
            fresh.close()


def test_ring_link_reconnect_drops_unread_outputs_of_the_old_ring():
    from ringsched.comm.messages import OutputBatch
    from ringsched.comm.zmq_io import Pusher
    from ringsched.link import RingLink

    sup = FakeSupervisor()
    link = RingLink(EngineConfig(), None, supervisor=sup)
    try:
        old_out = Pusher(link.zctx, sup.addrs.front_out)
        old_out.send(OutputBatch([TokenOutput("r", [1])]))
        deadline = time.monotonic() + 10
        while not link.out.sock.poll(10) and time.monotonic() < deadline:
            pass
        link.reconnect()  # the old ring's output is still unread
        old_out.close(linger_ms=0)
        new_out = Pusher(link.zctx, sup.addrs.front_out)
        new_out.send(OutputBatch([TokenOutput("r", [2])]))
        msg = link.recv(timeout_ms=10_000)
        assert msg.outputs[0].token_ids == [2] and link.drain() == []
        new_out.close(linger_ms=0)
    finally:
        link.close()
