"""`bench sweep`: config strings and the rate ladder as pure functions, the stage accounting and the report on
hand-made inputs, then one real sweep of two tiny-model servers (PP=1 and PP=2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")
from prometheus_client import CollectorRegistry, Gauge, generate_latest  # noqa: E402

from ringsched.bench.__main__ import main  # noqa: E402
from ringsched.bench.stage_metrics import parse_stage_metrics, stage_deltas  # noqa: E402
from ringsched.bench.sweep_plan import RateLadder, ServerConfig, SweepConfigError, parse_rates  # noqa: E402
from ringsched.bench.sweep_report import load_sweep, markdown_table, write_report  # noqa: E402

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("tpot_vs_rate.png", "throughput_vs_rate.png")


# -- configs and rates ---------------------------------------------------------------------------------------
def test_config_strings_become_launcher_flags():
    cfg = ServerConfig.parse(" pp=2, threads=1,depth=1,partition=4:2,dtype=bfloat16,mbs=8 ")
    assert cfg.label == "pp=2, threads=1,depth=1,partition=4:2,dtype=bfloat16,mbs=8"
    assert cfg.flags == [
        "--pp-size", "2", "--threads-per-stage", "1", "--pp-async-batch-depth", "1",
        "--pp-layer-partition", "4,2", "--dtype", "bfloat16", "--pp-max-micro-batch-size", "8",
    ]  # fmt: skip
    assert ServerConfig.parse("pp=2,partition=auto").flags == ["--pp-size", "2", "--pp-layer-partition", "auto"]
    assert ServerConfig.parse("pp=2,running=256").flags == ["--pp-size", "2", "--max-running-requests", "256"]
    assert ServerConfig.parse("threads=2").flags == ["--threads-per-stage", "2"]
    assert ServerConfig.parse("threads=1,tp=2").flags == ["--tp-size", "2", "--threads-per-stage", "1"]
    assert ServerConfig.parse("pp=2,flex=2,depth=0").flags == [
        "--pp-size", "2", "--pp-async-batch-depth", "0", "--pp-flex-layers", "2",
    ]  # fmt: skip
    assert ServerConfig.parse("pp=2,policy=ready,flex=2").flags == [
        "--pp-size", "2", "--pp-flex-layers", "2", "--pp-flex-policy", "ready",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "empty"),
        ("pp", "not key=value"),
        ("pp=", "not key=value"),
        ("pp=two", "pp must be an integer"),
        ("pp=0", "pp must be >= 1"),
        ("depth=-1", "depth must be >= 0"),
        ("pp=2,flex=-1", "flex must be >= 0"),
        ("pp=2,flex=2,policy=fast", "policy must be one of balance, ready, got 'fast'"),
        ("tp=0", "tp must be >= 1"),
        ("cp=2", "unknown key 'cp'"),
        ("pp=1,pp=2", "pp is given twice"),
        ("dtype=fp8", "dtype must be one of"),
        ("pp=2,partition=6", "partition has 1 stages but pp is 2"),
        ("pp=2,partition=6:0", "at least one layer"),
        ("pp=2,partition=3,3", "not key=value"),  # commas separate keys: stages take ':'
    ],
)
def test_bad_config_strings_name_the_flag(text, words):
    with pytest.raises(SweepConfigError, match="--config") as e:
        ServerConfig.parse(text)
    assert words in str(e.value)


def test_bad_flags_exit_2_with_a_message(capsys):
    assert main(["sweep", "--config", "pp=1", "--config", "pipeline=2"]) == 2
    assert "--config 'pipeline=2': unknown key" in capsys.readouterr().err
    assert main(["sweep"]) == 2
    assert "at least one --config" in capsys.readouterr().err
    assert main(["sweep", "--config", "pp=1", "--rates", "2,1"]) == 2
    assert "--rates" in capsys.readouterr().err


def test_rates_parse_ascending_and_finite():
    assert parse_rates("0.25, 0.5,1,2") == (0.25, 0.5, 1.0, 2.0)
    for bad in ("", "1,x", "2,1", "1,1", "0,1", "1,inf"):
        with pytest.raises(SweepConfigError, match="--rates"):
            parse_rates(bad)


def rungs_until_stop(ladder: RateLadder, throughput_at: dict[float, float]) -> list[float]:
    """The finite rates the sweep would run, given the output throughput each rate produces."""
    rates: list[float] = []
    while (rate := ladder.next_rate([throughput_at[r] for r in rates])) is not None:
        rates.append(rate)
    return rates


def test_ladder_doubles_until_throughput_stops_growing():
    # The server saturates near 100 tok/s: 4 -> 8 grows 2%, under the 5% threshold, so 8 is the last rung.
    tput = {1.0: 25.0, 2.0: 50.0, 4.0: 98.0, 8.0: 100.0, 16.0: 102.0, 32.0: 102.0}
    assert rungs_until_stop(RateLadder(min_rate=1.0, factor=2.0, threshold=0.05), tput) == [1, 2, 4, 8]
    # At a 1% threshold 4 -> 8 and 8 -> 16 (2% each) still count as growth; 16 -> 32 (0%) does not.
    assert rungs_until_stop(RateLadder(min_rate=1.0, threshold=0.01), tput) == [1, 2, 4, 8, 16, 32]
    assert rungs_until_stop(RateLadder(min_rate=0.5, factor=4.0), {0.5: 10.0, 2.0: 40.0, 8.0: 41.0}) == [0.5, 2, 8]
    assert rungs_until_stop(RateLadder(min_rate=1.0, max_rungs=3), tput) == [1, 2, 4]  # the safety cap
    # A throughput that falls (overload) stops the ladder too.
    assert rungs_until_stop(RateLadder(min_rate=1.0), {1.0: 30.0, 2.0: 20.0, 4.0: 90.0}) == [1, 2]


def test_explicit_rates_run_in_order_and_stop_at_saturation_too():
    tput = {0.25: 30.0, 0.5: 60.0, 1.0: 85.0, 2.0: 86.0, 4.0: 86.0}
    assert rungs_until_stop(RateLadder(rates=(0.25, 0.5, 1.0, 2.0, 4.0)), tput) == [0.25, 0.5, 1.0, 2.0]
    assert rungs_until_stop(RateLadder(rates=(0.25, 0.5)), tput) == [0.25, 0.5]  # the list ends first
    assert rungs_until_stop(RateLadder(rates=(0.25, 0.5, 1.0), max_rungs=2), tput) == [0.25, 0.5]


@pytest.mark.parametrize(
    "kwargs, flag",
    [({"min_rate": 0.0}, "--min-rate"), ({"factor": 1.0}, "--rate-factor"),
     ({"threshold": -0.1}, "--saturation-threshold"), ({"max_rungs": 0}, "--max-rungs")],
)  # fmt: skip
def test_bad_ladders_name_the_flag(kwargs, flag):
    with pytest.raises(SweepConfigError, match=flag):
        RateLadder(**kwargs)


# -- stage accounting ----------------------------------------------------------------------------------------
def prometheus_text(times: dict[int, dict[str, float]], peak: int) -> str:
    """What the server's /metrics says, written by prometheus_client itself with the server's metric names."""
    r = CollectorRegistry()
    g = Gauge("ringsched:stage_time_seconds", "time", ["stage", "kind"], registry=r)
    m = Gauge("ringsched:stage_peak_memory_bytes", "memory", ["stage"], registry=r)
    for stage, kinds in times.items():
        for kind, value in kinds.items():
            g.labels(stage=str(stage), kind=kind).set(value)
        m.labels(stage=str(stage)).set(peak)
    Gauge("ringsched:stage_busy_fraction", "not ours", ["stage"], registry=r).labels(stage="0").set(0.5)
    return generate_latest(r).decode()


def test_stage_accounting_is_the_difference_over_the_rung():
    t0 = {0: {"compute": 1.0, "wait": 0.5, "sched": 0.1, "comm": 0.0}, 1: {"compute": 2.0, "wait": 0.0}}
    t1 = {0: {"compute": 4.0, "wait": 1.5, "sched": 0.3, "comm": 0.2}, 1: {"compute": 5.0, "wait": 0.5}}
    before = parse_stage_metrics(prometheus_text(t0, peak=100))
    after = parse_stage_metrics(prometheus_text(t1, peak=300))
    assert before[0] == {"compute_s": 1.0, "wait_s": 0.5, "sched_s": 0.1, "comm_s": 0.0, "peak_memory_bytes": 100}
    rows = stage_deltas(before, after, duration=6.0)
    assert [r["stage"] for r in rows] == [0, 1]
    assert rows[0] == pytest.approx(
        {"stage": 0, "compute_s": 3.0, "wait_s": 1.0, "sched_s": 0.2, "comm_s": 0.2, "busy_fraction": 0.5,
         "peak_memory_bytes": 300}
    )  # fmt: skip
    assert rows[1]["sched_s"] == 0.0 and rows[1]["busy_fraction"] == pytest.approx(0.5)


# -- the report ----------------------------------------------------------------------------------------------
def fake_rung(rate: float | str, tok_s: float, tpot: float, busy: list[float]) -> dict:
    result = {
        "request_throughput": tok_s / 128, "output_throughput": tok_s, "median_ttft_ms": 100.0,
        "median_tpot_ms": tpot, "p99_itl_ms": 2 * tpot, "successful_requests": 8, "failed_requests": 0,
    }  # fmt: skip
    stages = [{"stage": i, "busy_fraction": b} for i, b in enumerate(busy)]
    return {"rate": rate, "result": result, "stages": stages}


def fake_sweep() -> dict:
    pp1 = [fake_rung(0.5, 60, 20.0, [0.4]), fake_rung(1.0, 80, 30.0, [0.7]), fake_rung("inf", 85, 45.0, [0.9])]
    pp2 = [fake_rung(0.5, 62, 25.0, [0.3, 0.3]), fake_rung(1.0, 120, 28.0, [0.6, 0.55]),
           fake_rung(2.0, 150, 35.0, [0.8, 0.75]), fake_rung("inf", 155, 40.0, [0.85, 0.8])]  # fmt: skip
    return {"model": "fake", "configs": [
        {"label": "pp=1,threads=1", "error": None, "rungs": pp1},
        {"label": "pp=2,threads=1", "error": None, "rungs": pp2},
        {"label": "pp=3", "error": "RuntimeError: the server exited with 2 while starting:", "rungs": [],
         "log_tail": ["error: --pp-size 3 is more stages than the model's 2 layers", ""]},
    ]}  # fmt: skip


def assert_pngs(out: Path) -> None:
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name


def test_report_writes_json_a_row_per_rung_and_two_plots(tmp_path):
    sweep = fake_sweep()
    table = write_report(sweep, tmp_path)
    assert load_sweep(tmp_path / "sweep.json") == sweep
    assert (tmp_path / "sweep.md").read_text() == table + "\n"
    rows = [line for line in table.splitlines() if line.startswith("| pp=")]
    assert len(rows) == 7  # 3 + 4 rungs; the failed config has none
    assert rows[2].split(" | ")[1:3] == ["inf", "0.66"]  # the configured rate, then the achieved req/s
    assert rows[-1].endswith("| 0 | 0.85 / 0.80 |")  # no failures, busy fraction per stage
    assert "pp=3: failed after 0 rungs: RuntimeError" in table and "(server log: error: --pp-size 3" in table
    assert_pngs(tmp_path)


def test_from_json_only_rewrites_the_table_and_plots(tmp_path, capsys):
    src = tmp_path / "sweep.json"
    src.write_text(json.dumps(fake_sweep()))
    assert main(["sweep", "--from-json", str(src)]) == 0
    assert capsys.readouterr().out.strip() == markdown_table(fake_sweep())
    assert_pngs(tmp_path)
    assert main(["sweep", "--from-json", str(tmp_path / "missing.json")]) == 2
    assert "--from-json" in capsys.readouterr().err


# -- one real sweep ------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_sweep_two_tiny_servers(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = main([
        "sweep", "--model", str(tiny_llama_dir), "--config", "pp=1,threads=1", "--config", "pp=2,threads=1",
        "--rates", "4", "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "8",
        "--warmup-prompts", "1", "--server-args=--kv-cache-memory 16M", "--out-dir", str(out),
    ])  # fmt: skip
    assert rc == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert [c["label"] for c in sweep["configs"]] == ["pp=1,threads=1", "pp=2,threads=1"]
    for cfg, n_stages in zip(sweep["configs"], (1, 2), strict=True):
        assert cfg["error"] is None
        assert [r["rate"] for r in cfg["rungs"]] == [4.0, "inf"]
        for rung in cfg["rungs"]:
            result = rung["result"]
            assert (result["successful_requests"], result["failed_requests"]) == (6, 0)
            assert result["total_output_tokens"] == 6 * 8  # --ignore-eos is on by default
            assert [s["stage"] for s in rung["stages"]] == list(range(n_stages))
            for s in rung["stages"]:
                assert s["compute_s"] > 0 and 0 < s["busy_fraction"] <= 1.05, s
                assert s["peak_memory_bytes"] > 0
    assert_pngs(out)
    printed = capsys.readouterr().out
    assert "| pp=2,threads=1 | inf |" in printed and printed.count("| pp=") == 4
