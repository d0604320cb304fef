"""A replayed request in stage 0's planner, as plain data (issue 47): admitted with the tokens an earlier ring
delivered as its outputs, it prefills prompt + outputs, samples the next token, finishes at the same total
`max_tokens` and reports the same counts as the run it continues."""

from ringsched.comm.messages import NewRequest
from ringsched.kv.cache import BlockTable
from ringsched.sampling.params import SamplingParams
from ringsched.scheduler.planner import Planner

PROMPT = list(range(10, 30))  # 20 tokens
TOKENS = [50, 51, 52, 53, 54, 55]  # what the last stage samples, in order


def planner(prefix_caching=False):
    return Planner(BlockTable(64, 16, prefix_caching=prefix_caching), 4, 8, 64, eos_ids=(2,), max_len=4096)


def new(rid="r", delivered=(), **kw):
    params = SamplingParams(**{"max_tokens": len(TOKENS), "temperature": 0, **kw})
    return NewRequest(rid, list(PROMPT), params.to_dict(), output_ids=list(delivered))


def drive(p, tokens, seq=0, request=None):
    """Plan and answer micro-batches with `tokens` (one per sample) until `request` (if given, added first) ends:
    the plans and outputs."""
    if request is not None:
        assert p.add(request) is None
    plans, outs, tokens = [], [], iter(tokens)
    while p.has_work:
        plan = p.plan(0, seq)
        plans.append(plan)
        outs += p.on_output(seq, [next(tokens) for _ in range(plan.num_samples)])
        seq += 1
    return plans, outs


def test_a_replay_prefills_its_prompt_then_its_outputs_one_a_step_then_samples_the_next_token():
    """The delivered tokens are computed again as their decodes computed them, one a micro-batch, so their KV (and
    every token after) is the undisturbed run's bit for bit; only the last one samples."""
    p = planner()
    assert p.add(new(delivered=TOKENS[:2])) is None
    plan = p.plan(0, 0)
    (e,) = plan.entries
    assert (e.start, e.token_ids, e.samples) == (0, PROMPT, False)
    (a,) = plan.announce
    assert a.prompt_len == len(PROMPT) and a.output_ids == []  # the last stage sees the delivered tokens as outputs
    assert p.on_output(0, []) == []
    steps = [p.plan(0, seq).entries[0] for seq in (1, 2)]  # pipelined: they sample nothing before the last
    assert [(e.start, e.token_ids, e.samples) for e in steps] == [(20, [TOKENS[0]], False), (21, [TOKENS[1]], True)]
    assert p.on_output(1, []) == []
    (out,) = p.on_output(2, [TOKENS[2]])
    assert out.token_ids == [TOKENS[2]] and out.completion_tokens == 3 and out.prompt_tokens == len(PROMPT)
    (e,) = p.plan(0, 3).entries
    assert (e.start, e.token_ids) == (len(PROMPT) + 2, [TOKENS[2]])  # then a plain decode


def test_a_replay_ends_and_counts_as_the_undisturbed_run():
    _, whole = drive(planner(), TOKENS, request=new())
    for k in (1, 3, 5):
        p = planner()
        p.add(new(delivered=TOKENS[:k]))
        _, rest = drive(p, TOKENS[k:])
        assert [(o.token_ids, o.finish_reason, o.prompt_tokens, o.completion_tokens) for o in rest] == [
            (o.token_ids, o.finish_reason, o.prompt_tokens, o.completion_tokens) for o in whole[k:]
        ]
        assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == len(TOKENS)


def test_min_tokens_counts_the_delivered_outputs():
    p = planner()
    p.add(new(delivered=[50, 51], min_tokens=4, max_tokens=8))
    _, outs = drive(p, [2, 2, 60])  # EOS as the 3rd output is under min_tokens; as the 4th it stops
    assert [o.finish_reason for o in outs] == [None, "stop"] and outs[-1].completion_tokens == 4


def test_a_replay_with_nothing_left_ends_at_once():
    p = planner()
    out = p.add(new(delivered=TOKENS))
    assert (out.token_ids, out.finish_reason, out.completion_tokens) == ([], "length", len(TOKENS))
    assert not p.has_work
    assert p.add(new("s", delivered=[50, 2])).finish_reason == "stop"


def test_a_replay_is_checked_on_its_prompt_and_its_outputs_vocabulary():
    p = Planner(BlockTable(64, 16), 4, 8, 64, eos_ids=(2,), max_len=40, vocab_size=100)
    # prompt (20) + max_tokens (30) > max_len (40), as the first submission was: still admitted
    assert p.add(new(delivered=[50] * 10, max_tokens=30)) is None
    out = p.add(new("bad", delivered=[50, 100]))
    assert out.finish_reason == "error" and "replayed output" in out.error


def test_the_unseeded_fallback_stays_and_a_replay_keeps_its_seed():
    p = planner()
    p.add(new("a", temperature=1.0))
    p.add(new("b", delivered=[50], temperature=1.0, seed=1234))
    seeds = {a.rid: SamplingParams.from_dict(a.params).seed for a in p.plan(0, 0).announce}
    assert seeds["a"] is not None and seeds["b"] == 1234


def test_a_replay_hits_the_prefix_cache_on_prompt_and_outputs_and_keeps_no_cached_count():
    p = planner(prefix_caching=True)
    drive(p, TOKENS, request=new())  # the first run leaves prompt + outputs (26 tokens: one full block) cached
    p.add(new(delivered=TOKENS[:5]))  # 25 tokens: its first block is cached
    (e,) = p.plan(0, 100).entries
    assert e.start == 16 and e.cached_ids == (PROMPT + TOKENS)[:16] and e.token_ids == PROMPT[16:]
    assert p.on_output(100, []) == []
    _, (out, *_) = drive(p, TOKENS[5:], seq=101)
    assert out.token_ids == [TOKENS[5]] and out.cached_tokens == 0  # the front end keeps the first count
