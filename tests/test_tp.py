"""Tensor parallelism across real processes (gloo, ZMQ, the launcher's supervisor): every TP x PP layout gives
transformers' greedy tokens and TP=1's seeded samples; each rank holds its share of the weights; the seam
carries 1/tp of the activations per rank."""

from __future__ import annotations

import time

import pytest
import torch
from test_model_reference import hf_greedy, prompt_ids

from ringsched.engine import Engine
from ringsched.layout.partition import head_layers, resolve_partition, stage_ranges
from ringsched.layout.rank import StageInfo
from ringsched.models.llama import StageModel
from ringsched.models.random_model import random_config, write_random_model
from ringsched.sampling.params import SamplingParams
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow  # several processes and real weights

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}  # drafts on every step, however fast this host's rows are
SEEDED = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2)]


def _settled_stats(llm: Engine, key: str, timeout: float = 10.0) -> dict[int, dict]:
    """Every rank's stats once each has reported `key` after the last step (stats come every 0.5 s)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        llm.poll(0.3)
        now = {r: dict(s) for r, s in llm.supervisor.stats.items()}
        if last is not None and now == last and all(key in s for s in now.values()):
            return now
        last = now
    raise AssertionError(f"stats with {key!r} did not settle: {last}")


def _share_bytes(model_dir: str, pp: int, tp: int) -> list[float]:
    """What each rank of each stage should hold: 1/tp of the unsharded stage's weights (built on meta)."""
    cfg = ModelConfig.from_dir(model_dir)
    out = []
    for k, (s, e) in enumerate(stage_ranges(resolve_partition(cfg.num_layers, pp, None, head_layers(cfg)))):
        with torch.device("meta"):
            model = StageModel(cfg, StageInfo(k, pp, s, e))
        if cfg.tie_word_embeddings and pp == 1:
            model.lm_head.weight = model.model.embed_tokens.weight
        out.append(sum(p.numel() * p.element_size() for p in model.parameters()) / tp)  # tied: counted once
    return out


@pytest.fixture(scope="module")
def smol_reference(hf_smol):
    hf, tok = hf_smol
    prompts = [prompt_ids(tok, i) for i in (0, 1, 4, 5)]
    return prompts, [hf_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts]


SERVER_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smol_tp1(smollm2_dir, smol_reference) -> tuple[list[list[int]], str]:
    """TP=1's seeded samples of two prompts, and its greedy text for the server test's prompt (one engine)."""
    prompts, _ = smol_reference
    with Engine(model=str(smollm2_dir), kv_cache_memory="64M", threads_per_stage=1) as llm:
        samples = [o.token_ids for o in llm.generate([prompts[0], prompts[2]], SEEDED)]
        return samples, llm.generate([SERVER_PROMPT], SamplingParams(max_tokens=16, temperature=0.0))[0].text


@pytest.fixture(scope="module")
def smol_tp1_samples(smol_tp1) -> list[list[int]]:
    return smol_tp1[0]


@pytest.mark.parametrize(("pp", "tp", "spec"), [(1, 2, None), (2, 2, SPEC)], ids=["tp2", "tp2-pp2-drafts"])
def test_smollm2_tp_layouts_match_transformers_and_tp1(smollm2_dir, smol_reference, smol_tp1_samples, pp, tp, spec):
    """(At TP=2 x PP=2 with speculative drafts: the tokens are the same, and some drafts were kept.)"""
    prompts, want = smol_reference
    with Engine(model=str(smollm2_dir), pp_size=pp, tp_size=tp, kv_cache_memory="64M", threads_per_stage=1,
                speculative_config=spec) as llm:  # fmt: skip
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert [o.token_ids for o in llm.generate([prompts[0], prompts[2]], SEEDED)] == smol_tp1_samples
        info = {r: dict(i) for r, i in llm.supervisor.info.items()}
        stats = _settled_stats(llm, "seam_bytes_sent")
        assert spec is None or llm.wait_idle().get("spec_accepted_tokens", 0) > 0
    assert sorted(info) == list(range(pp * tp))
    share = _share_bytes(str(smollm2_dir), pp, tp)
    for r, i in info.items():
        assert abs(i["weights_bytes"] / share[i["stage"]] - 1) < 0.10, (r, i["weights_bytes"], share[i["stage"]])
    hidden = ModelConfig.from_dir(smollm2_dir).hidden_size
    for s in stats.values():
        if s["stage"] < pp - 1:  # each rank of a stage with a seam after it sends 1/tp of it
            assert s["seam_tokens_sent"] > 0
            assert s["seam_bytes_sent"] / s["seam_tokens_sent"] == 2 * hidden * 4 / tp
        else:
            assert s["seam_bytes_sent"] == 0
        assert s["tp_all_reduces"] > 0


@pytest.mark.parametrize(
    ("arch", "heads", "kv", "tp", "pp"),
    [("qwen3", 4, 1, 2, 1), ("llama", 8, 4, 4, 1), ("qwen3", 4, 1, 2, 2)],
    ids=["qwen3-1kv-tp2", "llama-4kv-tp4", "qwen3-1kv-tp2-pp2"],
)
def test_tiny_random_models_match_transformers_at_tp(tmp_path, arch, heads, kv, tp, pp):
    """One KV head at TP=2: each rank stores it whole (replicated); 4 KV heads at TP=4: one each, 4 processes."""
    from transformers import AutoModelForCausalLM

    config = random_config(arch, 4, 64, heads, kv, 128, 320, tie=arch == "llama")
    model_dir = write_random_model(tmp_path / arch, config, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 99, 3, 250, 7], [300, 12, 8], list(range(40, 90))]
    want = [hf_greedy(hf, ids, 24) for ids in prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with Engine(model=str(model_dir), pp_size=pp, tp_size=tp, kv_cache_memory="8M", threads_per_stage=1) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        kv_tokens = {r: i["kv_tokens"] for r, i in llm.supervisor.info.items()}
    # Each rank's pool holds its own KV heads (one: split 4 ways, or the one replicated), so the 8 MiB of each
    # holds `kv / local heads` times the tokens one rank of every head would.
    head_dim, layers = 64 // heads, 4 // pp
    blocks = (8 << 20) // (2 * 1 * head_dim * 4 * layers * 16)
    assert kv_tokens == {r: blocks * 16 for r in range(pp * tp)}


def test_server_at_tp2_pp2_serves_greedy_and_reports_the_seam_per_rank(smollm2_dir, smol_tp1):
    """The launcher at PP=2 x TP=2 behind real HTTP: the openai client gets TP=1's greedy text, and /metrics
    reports each rank's seam bytes per token (stage 0's ranks: 2 x 576 x 4 / 2) and all-reduces."""
    import re

    import httpx
    import openai

    from ringsched.bench.server_process import ServerProcess

    prompt, want = SERVER_PROMPT, smol_tp1[1]
    args = ["--pp-size", "2", "--tp-size", "2", "--threads-per-stage", "1", "--kv-cache-memory", "64M"]
    with ServerProcess(args) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == want
        deadline, seam = time.monotonic() + 10, {}
        while time.monotonic() < deadline and sorted(seam.values()) != [0.0, 0.0, 2304.0, 2304.0]:
            time.sleep(0.5)
            text = httpx.get(f"{srv.url}/metrics", timeout=10).text
            seam = {m[1]: float(m[2]) for m in re.finditer(
                r'^ringsched:seam_bytes_per_token\{rank="(\d)",stage="\d",tp="\d"\} (\S+)$', text, re.M)}
        assert seam == {"0": 2304.0, "1": 2304.0, "2": 0.0, "3": 0.0}, text
        reduces = re.findall(r'^ringsched:tp_all_reduces_per_batch\{rank="(\d)",stage="(\d)",tp="\d"\} (\S+)$', text,
                             re.M)  # fmt: skip
        # Two per layer of the default split, stage 0 one more for the embedding; the head's gather is not one.
        cfg = ModelConfig.from_dir(smollm2_dir)
        first, last = resolve_partition(cfg.num_layers, 2, None, head_layers(cfg))
        assert {(r, s): float(v) for r, s, v in reduces} == {("0", "0"): 2 * first + 1, ("1", "0"): 2 * first + 1,
                                                               ("2", "1"): 2 * last, ("3", "1"): 2 * last}  # fmt: skip
