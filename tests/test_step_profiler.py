"""The per-stage torch.profiler window (RINGSCHED_TORCH_PROFILER_DIR)."""

from __future__ import annotations

import pytest
import torch

from ringsched.stage.profiler import ENV_DIR, ENV_MIN_TOKENS, ENV_STEPS, ProfileWindow, StepProfiler
from ringsched.stage.times import StageTimes


def test_window_from_env(tmp_path):
    assert ProfileWindow.from_env({}) is None
    w = ProfileWindow.from_env({ENV_DIR: str(tmp_path), ENV_STEPS: "3:2", ENV_MIN_TOKENS: "8"})
    assert (w.out_dir, w.start, w.count, w.min_tokens) == (tmp_path, 3, 2, 8)
    assert ProfileWindow.from_env({ENV_DIR: str(tmp_path)}).start == 40
    with pytest.raises(ValueError, match=ENV_STEPS):
        ProfileWindow.from_env({ENV_DIR: str(tmp_path), ENV_STEPS: "40"})
    with pytest.raises(ValueError, match="count"):
        ProfileWindow.from_env({ENV_DIR: str(tmp_path), ENV_STEPS: "4:0"})


def test_profiles_only_the_window(tmp_path):
    times = StageTimes()
    prof = StepProfiler(ProfileWindow(tmp_path, start=2, count=3, min_tokens=8), rank=1, size=2)
    a, b = torch.randn(32, 48), torch.randn(48, 16)

    def step(tokens: int, op) -> None:
        op()
        times.batches += 1
        times.tokens += tokens
        times.compute += 0.5
        prof.after_step(tokens, times)

    step(8, lambda: torch.cat([a, a]))  # before the window: not in the table
    step(4, lambda: torch.cat([a, a]))  # too few tokens: not counted towards the start
    step(8, lambda: torch.cat([a, a]))
    assert prof.written is None
    for tokens in (8, 2, 8, 8):  # the window: three counted steps and the small one between them
        step(tokens, lambda: a @ b)
    step(8, lambda: torch.relu(a))  # after the window
    path = tmp_path / "stage1_of2.txt"
    assert prof.written == path
    text = path.read_text()
    assert "aten::mm" in text and "[[32, 48], [48, 16]]" in text
    assert "aten::cat" not in text and "aten::relu" not in text
    assert "window: micro-batches 4, tokens 26, layer-tokens 0, compute s 2," in text


@pytest.mark.slow
def test_a_ring_writes_each_stage_table_and_keeps_serving(tiny_llama_dir, tmp_path, monkeypatch):
    """Both stages of a real two-process ring (gloo, ZMQ) profile their window, write their tables and go on
    serving: the ring outlives the window and answers the same as before it. (The abort that keeping the
    profiler object avoids showed with SmolLM2's 128-row micro-batches, not with this tiny model.)"""
    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    monkeypatch.setenv(ENV_DIR, str(tmp_path / "prof"))
    monkeypatch.setenv(ENV_STEPS, "2:3")
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    with Engine(model=str(tiny_llama_dir), pp_size=2, threads_per_stage=1, kv_cache_memory="16M",
                log_level="warning") as llm:  # fmt: skip
        first = [o.token_ids for o in llm.generate(prompts, p)]
        again = [o.token_ids for o in llm.generate(prompts, p)]
    assert again == first and all(len(t) == 8 for t in first)
    for rank in (0, 1):
        text = (tmp_path / "prof" / f"stage{rank}_of2.txt").read_text()
        # These steps' few rows go through the native kernels (no aten::mm); their output buffers are torch's.
        assert "aten::empty" in text and "window: micro-batches 3," in text
