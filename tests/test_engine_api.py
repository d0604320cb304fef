"""The offline Engine's API on a tiny random model (fast): strings and ids, per-prompt params, streaming,
finish reasons, and the one-shot CLI."""

import subprocess
import sys

import pytest

from ringsched.engine import Engine
from ringsched.sampling.params import SamplingParams

MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with Engine(model=str(tiny_llama_dir), pp_size=2, pp_async_batch_depth=1, threads_per_stage=1,
                kv_cache_memory="16M", log_level="warning") as engine:
        yield engine


def test_generate_strings_and_ids_in_order(llm):
    outs = llm.generate(["hello world", [5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("hello world")
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)
    again = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert again[0].token_ids == outs[1].token_ids


def test_per_prompt_params_and_stop_token(llm):
    first = llm.generate([[9, 9, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    j = max(i for i in range(len(first)) if first[i] not in first[:i])  # the last token seen for the first time
    outs = llm.generate(
        [[9, 9, 9], [9, 9, 9]],
        [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[first[j]], ignore_eos=True)],
    )  # fmt: skip
    assert outs[0].token_ids == first[:3] and outs[0].finish_reason == "length"
    assert outs[1].token_ids == first[: j + 1] and outs[1].finish_reason == "stop"
    with pytest.raises(ValueError, match="one or one each"):
        llm.generate([[1], [2]], [SamplingParams()])


def test_stop_strings_end_the_request_and_cut_the_text(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate([[9, 8, 7]], params)[0]
    stop = full.text[len(full.text) // 2 :][:3]  # a piece from the middle of the text
    assert stop and stop in full.text
    out = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert len(out.token_ids) < len(full.token_ids) and full.token_ids[: len(out.token_ids)] == out.token_ids
    assert llm.wait_idle()["kv_usage"] == 0  # aborted on the ring: its KV is freed


def test_stream_yields_tokens_as_they_come(llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    events = list(llm.stream([[3, 4], [5]], params))
    per = {0: [], 1: []}
    for ev in events:
        per[ev.index] += ev.token_ids
    assert len(events) >= 8 and all(len(v) == 4 for v in per.values())
    assert [e.finish_reason for e in events if e.finish_reason] == ["length", "length"]
    assert per[0] == llm.generate([[3, 4]], params)[0].token_ids


def test_seeded_sampling_reproducible(llm):
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([[1, 2, 3]] * 3, p)
    assert a[0].token_ids == a[1].token_ids == a[2].token_ids
    b = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=1.0, seed=8, ignore_eos=True))
    assert b[0].token_ids != a[0].token_ids


def test_generate_cli(tiny_llama_dir):
    p = subprocess.run([sys.executable, "-m", "ringsched.generate", "--model", str(tiny_llama_dir), "--pp-size", "2",
                        "--threads-per-stage", "1", "--kv-cache-memory", "16M", "--max-tokens", "4", "hi there"],
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "'hi there' (length, 4 tokens)" in p.stdout


def test_idle_ring_with_async_depth_settles_and_survives(tiny_llama_dir):
    """With depth > 0 the last stage holds outputs back; when the ring goes idle they must still reach stage 0
    (so KV is freed everywhere) and no stage may sit on an unfinished send past --stage-timeout."""
    import time

    from ring_utils import stage_kv_usage

    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with Engine(model=str(tiny_llama_dir), pp_size=3, pp_async_batch_depth=1, threads_per_stage=1,
                kv_cache_memory="16M", stage_timeout=3, log_level="warning") as llm:  # fmt: skip
        first = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], p)]
        assert stage_kv_usage(llm, 5) == {0: 0.0, 1: 0.0, 2: 0.0}
        time.sleep(5)  # idle for longer than the stage timeout
        assert [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], p)] == first
        assert stage_kv_usage(llm, 5) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_async_engine_streams_stops_and_aborts(hf_smol, smollm2_dir):
    """`AsyncEngine`: concurrent requests stream growing outputs equal to transformers' greedy tokens, a stop string
    ends one, leaving an iteration early aborts its request (every stage's KV freed), a refused request ends with an
    error output."""
    import asyncio

    from ringsched import AsyncEngine

    prompts = ["The capital of France is", "One, two, three,", "def add(a, b):"]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    from test_model_reference import hf_greedy

    from ringsched.tokenizer import Tokenizer

    hf, tok = hf_smol[0], Tokenizer(smollm2_dir)
    # transformers' argmax at each step (with its KV cache), EOS not stopping it (as ignore_eos)
    expected = [hf_greedy(hf, tok.encode(p), 12) for p in prompts]

    async def main():
        async with AsyncEngine(MODEL, pp_size=2, threads_per_stage=1, kv_cache_memory="64M",
                               log_level="warning") as llm:  # fmt: skip
            async def last(prompt, params):
                seen = []
                async for out in llm.generate(prompt, params):
                    seen.append(len(out.token_ids))
                return out, seen

            results = await asyncio.gather(*(last(p, greedy) for p in prompts))
            stopped, _ = await last(prompts[1], SamplingParams(max_tokens=30, temperature=0, stop=[" five"]))
            async for out in llm.generate(prompts[2], SamplingParams(max_tokens=400, ignore_eos=True)):
                if len(out.token_ids) >= 3:
                    break  # aborts it
            refused, _ = await last([1] * 10, SamplingParams(max_tokens=10**6))
            for _ in range(100):  # the abort reaches every stage
                usage = [s.get("kv_usage") for s in llm.client.stage_stats().values()]
                if usage == [0.0, 0.0] and llm.client.sched_stats.get("running") == 0:
                    break
                await asyncio.sleep(0.1)
            return results, stopped, refused, usage

    results, stopped, refused, usage = asyncio.run(main())
    assert [out.token_ids for out, _ in results] == expected
    assert all(seen == sorted(seen) and seen[-1] == 12 for _, seen in results)
    assert all(out.finish_reason == "length" and out.text for out, _ in results)
    assert stopped.finish_reason == "stop" and " five" not in stopped.text
    assert refused.finish_reason == "error" and "KV" in refused.error
    assert usage == [0.0, 0.0]


def test_an_error_without_with_exits_and_leaves_no_stage(tiny_llama_dir):
    """An engine left open by an uncaught error: the interpreter exits (multiprocessing's exit hook alone would
    wait forever on stages that ignore SIGTERM) and no stage process outlives it."""
    import psutil

    script = (
        "from ringsched.engine import Engine\n"
        f"llm = Engine(model={str(tiny_llama_dir)!r}, pp_size=2, threads_per_stage=1, kv_cache_memory='16M', "
        "log_level='warning')\n"
        "print('pids', *[p.pid for p in llm.supervisor.procs], flush=True)\n"
        "raise RuntimeError('boom')\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "RuntimeError: boom" in p.stderr, p.stderr
    pids = [int(x) for x in p.stdout.split("pids", 1)[1].split()]
    assert len(pids) == 2

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    alive = [pid for pid in pids if running(pid)]
    assert not alive, f"stage processes {alive} outlived the interpreter"
