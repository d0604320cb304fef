"""Stage 0's scheduler as a plain data structure: admission, chunking, prefill chunks pipelined over several
in-flight micro-batches (a decode in at most one), preemption, aborts and frees."""

from ringsched.comm.messages import NewRequest
from ringsched.kv.cache import BlockTable
from ringsched.sampling.params import SamplingParams
from ringsched.scheduler.chunking import ChunkCost, ChunkSizer
from ringsched.scheduler.planner import Planner
from ringsched.scheduler.request import Request


def planner(blocks=64, mbs=4, running=8, budget=64, max_len=4096):
    return Planner(BlockTable(blocks, 16), mbs, running, budget, eos_ids=(2,), max_len=max_len)


def req(rid, n, max_tokens=8, **kw):
    return NewRequest(
        rid, list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw).to_dict()
    )


def test_micro_batch_cap_and_chunked_prefill():
    p = planner(mbs=2, budget=40)
    for i in range(4):
        assert p.add(req(f"r{i}", 30)) is None
    plan = p.plan(0, 0)
    assert [(e.rid, e.start, len(e.token_ids), e.samples) for e in plan.entries] == [
        ("r0", 0, 30, True),
        ("r1", 0, 10, False),
    ]  # budget 40: r1 gets a 10-token chunk
    assert [a.rid for a in plan.announce] == ["r0", "r1"]
    plan1 = p.plan(1, 1)  # r0 waits for its token; r1's next chunk needs none and goes on at once
    assert [(e.rid, e.start, len(e.token_ids), e.samples) for e in plan1.entries] == [
        ("r1", 10, 20, True),
        ("r2", 0, 20, False),
    ]


def test_decode_after_output_and_finish_frees_in_next_plan():
    p = planner()
    p.add(req("a", 5, max_tokens=2))
    plan = p.plan(0, 0)
    assert p.plan(1, 1).entries == []  # in flight: not scheduled twice
    outs = p.on_output(0, [77])
    assert outs[0].token_ids == [77] and outs[0].finish_reason is None
    plan = p.plan(0, 2)
    assert [(e.start, e.token_ids) for e in plan.entries] == [(5, [77])]
    outs = p.on_output(2, [2])  # EOS
    assert outs[0].finish_reason == "stop"
    assert p.blocks.used_blocks == 1  # freed only by the next plan
    plan = p.plan(1, 3)
    assert plan.frees == ["a"] and plan.drops == ["a"] and p.blocks.used_blocks == 0
    assert not p.has_work


def test_length_and_ignore_eos():
    p = planner()
    p.add(req("a", 3, max_tokens=1, ignore_eos=True))
    p.plan(0, 0)
    assert p.on_output(0, [2])[0].finish_reason == "length"


def test_abort_waiting_running_and_in_flight():
    p = planner(mbs=1)
    for r in "abc":
        p.add(req(r, 4))
    p.plan(0, 0)  # a in flight
    assert p.abort("c").finish_reason == "abort"  # waiting
    assert p.abort("a").finish_reason == "abort"  # in flight: freed when its batch returns
    assert p.blocks.tables.get("a")
    assert p.on_output(0, [5]) == []  # the late token of an aborted request is dropped
    plan = p.plan(0, 1)
    assert "a" in plan.frees and "a" in plan.drops and p.blocks.tables.get("a") is None
    assert p.abort("a") is None and p.abort("zzz") is None


def test_preemption_newest_idle_request_then_recompute():
    p = planner(blocks=4, mbs=4, running=4)  # 64 tokens of KV
    p.add(req("old", 30, max_tokens=20))
    p.add(req("new", 30, max_tokens=20))
    p.plan(0, 0)
    p.on_output(0, [100, 200])
    for seq in range(1, 3):  # decode to 32 tokens each: 4 blocks used
        p.plan(0, seq)
        p.on_output(seq, [101, 201])
    plan = p.plan(0, 3)  # "old" needs a 3rd block at position 32: "new" (newest, idle) is preempted
    assert "new" in plan.frees and [e.rid for e in plan.entries] == ["old"]
    assert p.num_preemptions == 1 and p.waiting[0].rid == "new"
    p.on_output(3, [102])
    while p.requests.get("old"):
        plan = p.plan(0, 4)
        p.on_output(4, [103] * len([e for e in plan.entries if e.samples]))
    plan = p.plan(0, 5)
    plan = p.plan(0, 6) if not plan.entries else plan
    redo = [e for e in plan.entries if e.rid == "new"][0]
    assert (redo.start, redo.token_ids, redo.samples) == (0, list(range(10, 40)), False)  # the prompt, then
    seq, outputs = 7, []
    while not outputs or not outputs[-1].samples:  # each output so far computed again one a step, as decoded
        p.on_output(seq - 1, [0] * len([e for e in plan.entries if e.samples and e.rid != "new"]))
        plan = p.plan(0, seq)
        outputs += [e for e in plan.entries if e.rid == "new"]
        seq += 1
    assert [(e.start, e.token_ids) for e in outputs] == [(30, [200]), (31, [201]), (32, [201])]


def test_requests_that_can_never_fit_are_refused():
    p = planner(blocks=2, max_len=100)
    assert "maximum context length" in p.add(req("a", 100)).error
    assert "pool holds" in p.add(req("b", 20, max_tokens=40)).error
    assert "empty" in p.add(NewRequest("c", [], SamplingParams().to_dict())).error
    p.add(req("d", 5))
    assert "already in use" in p.add(req("d", 5)).error


def test_unseeded_sampling_gets_a_seed_once():
    p = planner()
    p.add(NewRequest("s", [5, 6], SamplingParams(temperature=0.7).to_dict()))
    plan = p.plan(0, 0)
    assert plan.announce[0].params["seed"] is not None


def test_a_request_that_failed_sampling_ends_alone_and_is_freed():
    p = planner()
    p.add(req("bad", 5))
    p.add(req("good", 5))
    p.plan(0, 0)
    outs = p.on_output(0, [-1, 42])  # sampler_state.FAILED for "bad"
    assert [(o.rid, o.finish_reason, o.error_code) for o in outs] == [
        ("bad", "error", "request_failed"),
        ("good", None, None),
    ]
    plan = p.plan(1, 1)
    assert plan.frees == ["bad"] and plan.drops == ["bad"]
    assert [e.rid for e in plan.entries] == ["good"]


def test_add_refuses_what_would_fail_on_a_stage():
    p = Planner(BlockTable(64, 16), 4, 8, 64, eos_ids=(2,), max_len=4096, vocab_size=100)
    out = p.add(NewRequest("a", [1, 100], SamplingParams(temperature=0).to_dict()))
    assert out.finish_reason == "error" and "vocabulary" in out.error and out.error_code is None
    out = p.add(req("b", 3, stop_token_ids=[5, 250]))
    assert out.finish_reason == "error" and "stop_token_ids" in out.error
    out = p.add(NewRequest("c", [1, 2], {"max_tokens": "lots"}))  # params no front end checked
    assert out.finish_reason == "error" and "max_tokens" in out.error
    assert p.add(req("d", 3, stop_token_ids=[99])) is None
    assert list(p.requests) == ["d"]


def test_prefill_tokens_count_as_they_are_planned():
    p = planner(budget=10)
    p.add(req("long", 30))
    p.plan(0, 0)
    assert p.stats()["prefill_tokens"] == 10  # one chunk so far, not the whole prompt
    p.on_output(0, [])
    p.plan(1, 1)
    assert p.stats()["prefill_tokens"] == 20


def test_a_long_prompt_fills_the_ring_and_only_its_first_decode_waits():
    p = planner(blocks=64, budget=100)
    p.add(req("long", 350))
    chunks = [p.plan(seq % 3, seq).entries for seq in range(5)]  # three slots, nothing has come back yet
    assert [[(e.start, len(e.token_ids), e.samples) for e in c] for c in chunks] == [
        [(0, 100, False)], [(100, 100, False)], [(200, 100, False)], [(300, 50, True)], []
    ]  # fmt: skip
    assert p.requests["long"].in_flight == {0, 1, 2, 3}
    for seq in range(3):
        assert p.on_output(seq, []) == []
    assert p.plan(0, 5).entries == []  # the sampling chunk is still out: nothing to compute
    assert p.on_output(3, [7])[0].token_ids == [7]
    decode = p.plan(1, 6).entries
    assert [(e.start, e.token_ids) for e in decode] == [(350, [7])]
    assert p.plan(2, 7).entries == []  # a decode is in one micro-batch at a time


def test_a_prompts_chunks_go_around_together_naming_the_micro_batches_they_read():
    """With a flexible cut stage 0 cuts a chunk no later than the in-flight chunks before it (`plan.reads`)."""
    p = Planner(BlockTable(64, 16), 4, 8, 100, eos_ids=(2,), max_len=4096, flexible_cut=True)
    p.add(req("long", 250))
    p.add(req("short", 20))
    first = p.plan(0, 0)
    assert [(e.rid, e.start) for e in first.entries] == [("long", 0)] and first.reads == []
    second = p.plan(1, 1)
    assert [(e.rid, e.start) for e in second.entries] == [("long", 100)] and second.reads == [0]
    p.on_output(0, [])
    third = p.plan(0, 2)
    assert [(e.rid, e.start) for e in third.entries] == [("long", 200), ("short", 0)] and third.reads == [1]


def test_aborting_a_prompt_with_three_chunks_in_flight_frees_after_the_last():
    p = planner(blocks=64, budget=64)
    p.add(req("long", 300))
    for seq in range(3):
        p.plan(seq, seq)
    used = p.blocks.used_blocks
    assert used == 12 and p.abort("long").finish_reason == "abort"
    assert p.plan(0, 3).entries == [] and p.blocks.used_blocks == used  # aborted: nothing new, nothing freed
    p.on_output(0, [])
    p.on_output(1, [])
    assert p.plan(1, 4).frees == [] and p.blocks.used_blocks == used  # one chunk still on the ring
    p.on_output(2, [])
    plan = p.plan(2, 5)
    assert plan.frees == ["long"] and plan.drops == ["long"] and p.blocks.used_blocks == 0
    for seq in (3, 4, 5):
        p.on_output(seq, [])
    assert not p.has_work


def test_a_request_with_chunks_in_flight_is_never_preempted():
    p = planner(blocks=6, mbs=4, running=4, budget=32)  # 96 tokens of KV
    p.add(req("old", 16, max_tokens=4))
    p.add(req("long", 80, max_tokens=4))
    p.plan(0, 0)  # old's prompt and long's first 16 tokens
    p.plan(1, 1)
    p.plan(2, 2)  # long's last 64 tokens in two more chunks: the pool is full
    assert p.blocks.used_blocks == 6 and p.requests["long"].in_flight == {0, 1, 2}
    p.on_output(0, [5])
    plan = p.plan(0, 3)  # old's decode needs a block; the newest request has chunks out, so old gives way
    assert plan.frees == ["old"] and plan.entries == [] and p.waiting[0].rid == "old"
    assert p.requests["long"].in_flight == {1, 2} and p.blocks.used_blocks == 5


def test_dynamic_chunks_come_from_the_sizer():
    sizer = ChunkSizer(ChunkCost(per_token=1.0, per_pair=0.01), first=100)
    p = Planner(BlockTable(64, 16), 4, 8, 100, eos_ids=(2,), max_len=4096, chunker=sizer)
    p.add(req("long", 600))
    sizes = []
    for seq in range(20):
        sizes += [len(e.token_ids) for e in p.plan(seq % 4, seq).entries]
    assert sizes == sizer.plan(600) and sum(sizes) == 600
    assert sizes[0] == 100 and sizes[-1] < sizes[0]


def test_request_ids_are_a_slice_of_prompt_and_outputs():
    r = Request("a", [1, 2, 3], SamplingParams(), 0, [4, 5])
    for start in range(6):
        for end in range(start, 6):
            assert r.ids(start, end) == r.all_ids[start:end], (start, end)
