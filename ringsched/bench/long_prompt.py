"""`python -m ringsched.bench offline --long-prompt N`: the time to first token of one N-token prompt, and with
`--decoding-streams K` what it does to K streams that are already decoding.

Alone, the prompt is sent `--repeat` times (each a fresh random prompt, one at a time) and the median of its
TTFTs is reported. With streams, K requests of `--input-len` tokens start
first and decode without end (`ignore_eos`); once every one has produced tokens for a while, their gaps between
tokens are the TPOT *before*; then the long prompt arrives and every gap until its first token is the TPOT
*during*; the streams are aborted after it.
"""

from __future__ import annotations

import random
import statistics
import time

WARM_TOKENS = 8  # tokens every stream produces before its gaps count as "before"
BEFORE_TOKENS = 16  # tokens each stream produces while the "before" gaps are taken


def _ids(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def time_long_prompts(llm, length: int, repeat: int, vocab: int, rng: random.Random, output_len: int = 1) -> dict:
    """TTFT of `repeat` single `length`-token prompts, one after another; with `output_len > 1` also the time
    per output token after the first (decodes at a context of `length` tokens)."""
    from ringsched.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ttfts, tpots = [], []
    for _ in range(repeat):
        time.sleep(0.3)  # the previous prompt's free reaches every stage
        start = time.perf_counter()
        rid = llm.submit(_ids(length, vocab, rng), params)
        first = last = None
        while True:
            outs = [o for o in llm.poll(0.01) if o.rid == rid]
            for o in outs:
                if o.finish_reason == "error":
                    raise RuntimeError(f"the long prompt failed: {o.error}")
                if o.token_ids:
                    last = time.perf_counter() - start
                    first = last if first is None else first
            if any(o.finish_reason for o in outs):
                break
        ttfts.append(first)
        if output_len > 1:
            tpots.append((last - first) / (output_len - 1))
    out = {"long_prompt": length, "ttft_s": statistics.median(ttfts), "ttft_runs_s": ttfts}
    if tpots:
        out |= {"tpot_s": statistics.median(tpots), "tpot_runs_s": tpots, "output_len": output_len}
    return out


def decodes_beside_a_long_prompt(
    llm, length: int, streams: int, input_len: int, vocab: int, rng: random.Random
) -> dict:
    """Median TPOT of `streams` decoding requests before and while a `length`-token prompt prefills."""
    from ringsched.sampling.params import SamplingParams

    endless = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)
    rids = [llm.submit(_ids(input_len, vocab, rng), endless) for _ in range(streams)]
    last: dict[str, float] = {}
    counts = dict.fromkeys(rids, 0)
    before: list[float] = []
    during: list[float] = []
    long_rid, long_start, ttft = None, 0.0, None
    deadline = time.monotonic() + 3600
    try:
        while ttft is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the long prompt did not produce a token within an hour")
            for o in llm.poll(0.02):
                now = time.perf_counter()
                if o.finish_reason == "error":
                    raise RuntimeError(f"request {o.rid} failed: {o.error}")
                if o.rid == long_rid and o.token_ids:
                    ttft = now - long_start
                    continue
                if o.rid not in counts or not o.token_ids:
                    continue
                counts[o.rid] += len(o.token_ids)
                if o.rid in last and counts[o.rid] > WARM_TOKENS:
                    (during if long_rid else before).append((now - last[o.rid]) / len(o.token_ids))
                last[o.rid] = now
            if long_rid is None and min(counts.values()) >= WARM_TOKENS + BEFORE_TOKENS:
                long_start = time.perf_counter()
                long_rid = llm.submit(_ids(length, vocab, rng), SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        for rid in rids:
            llm.abort(rid)
    tpot_before, tpot_during = statistics.median(before), statistics.median(during)
    return {
        "long_prompt": length,
        "decoding_streams": streams,
        "ttft_s": ttft,
        "tpot_before_s": tpot_before,
        "tpot_during_s": tpot_during,
        "tpot_ratio": tpot_during / tpot_before,
        "tpot_during_max_s": max(during),
    }


def print_long_prompt(r: dict, cfg) -> None:
    head = (
        f"pp={cfg.pp_size} tp={cfg.tp_size} cp={cfg.cp_size} threads/rank={cfg.threads} "
        f"chunk={cfg.chunked_prefill_size}"
        f"{' dynamic' if cfg.enable_dynamic_chunking else ''}: a {r['long_prompt']}-token prompt"
    )
    if "decoding_streams" in r:
        print(
            f"{head} beside {r['decoding_streams']} decoding streams: TTFT {r['ttft_s']:.2f}s; their median TPOT "
            f"{r['tpot_before_s'] * 1e3:.1f} ms before, {r['tpot_during_s'] * 1e3:.1f} ms while it prefills "
            f"({r['tpot_ratio']:.2f}x; longest gap {r['tpot_during_max_s'] * 1e3:.0f} ms)"
        )
    else:
        runs = ", ".join(f"{t:.2f}" for t in r["ttft_runs_s"])
        print(f"{head}: TTFT {r['ttft_s']:.2f}s (median of {len(r['ttft_runs_s'])}: {runs})")
        if "tpot_s" in r:
            runs = ", ".join(f"{t * 1e3:.1f}" for t in r["tpot_runs_s"])
            print(f"  then {r['output_len']} tokens at that context: TPOT {r['tpot_s'] * 1e3:.1f} ms ({runs})")
