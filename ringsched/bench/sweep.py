"""`python -m ringsched.bench sweep`: launch one server per configuration and run `bench serve` against it at
a ladder of request rates, then write a JSON record, a Markdown table and two plots.

    python -m ringsched.bench sweep --config pp=1,threads=1 --config pp=2,threads=1 --rates 0.25,0.5,1,2

For each `--config` (keys in `sweep_plan.CONFIG_FLAGS`; `--server-args` go to every server) the sweep starts
a server on a free local port with `ServerProcess` (the launcher's `main` in its own process group, so
stopping it leaves no stage behind) and sends a few unmeasured warm-up requests. Then come the finite rungs
(`--rates`, else `--min-rate` times `--rate-factor` per rung) until output throughput grows by less than
`--saturation-threshold` over the rung before or `--max-rungs` is reached, then one `inf` rung (every
request at once) for the saturated throughput; the server is stopped however the config ends. Every rung
sends the same `--num-prompts` requests (same `--seed`), so rungs and configs do the same work. Around each
rung the server's `/metrics` is read (once the stages have reported again) for the compute, wait, sched and
comm seconds each stage spent during the rung; busy fraction = compute seconds / rung duration.

Contract: `add_sweep_args(parser)` adds the flags; `run_sweep(args)` returns the exit code: 0; 1 when a
configuration failed (its error and log tail are in the record, the others still run); 2 for a bad flag;
130 on Ctrl-C, after stopping the server and writing what was measured. `--from-json FILE` only rewrites
the table and plots from an earlier `sweep.json`; `sweep_report.py` describes the outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import signal
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ringsched.bench.serve import ServeConfig, benchmark, load_requests, run_serve
from ringsched.bench.server_process import ServerProcess
from ringsched.bench.stage_metrics import scrape_stages, settled, stage_deltas
from ringsched.bench.sweep_args import DEFAULT_OUT_DIR
from ringsched.bench.sweep_args import add_sweep_args as add_sweep_args  # `bench` takes both from here
from ringsched.bench.sweep_plan import RateLadder, ServerConfig, SweepConfigError, parse_rates
from ringsched.bench.sweep_report import load_sweep, save_json, write_report
from ringsched.weights.fetch import FetchError

# Stages report their times every 0.5 s (an idle stage too), so two equal reads this far apart mean the
# stages have reported since the rung ended; a fixed wait undercounted when a loaded host delayed a report.
STATS_SETTLE_S = 0.7
STATS_SETTLE_DEADLINE_S = 10.0
# Flags the sweep sets itself, so --server-args may not.
OWN_FLAGS = ("--host", "--port", "--model", "--api-key")
SERVE_FLAGS = ("num_prompts", "random_input_len", "random_output_len", "random_range_ratio", "burstiness", "seed")


@dataclass(frozen=True)
class SweepPlan:
    """Everything one sweep runs, validated: the servers, the ladder and the requests of every rung."""

    model: str
    configs: tuple[ServerConfig, ...]
    server_args: tuple[str, ...]
    ladder: RateLadder
    serve: ServeConfig  # the requests of a rung; base_url and request_rate are filled in per rung
    warmup_prompts: int = 4
    startup_timeout: float = 300.0

    def __post_init__(self) -> None:
        check_configs(self.configs)
        for flag in OWN_FLAGS:
            if any(a == flag or a.startswith(f"{flag}=") for a in self.server_args):
                raise SweepConfigError(f"--server-args may not set {flag}; the sweep sets it")
        if self.warmup_prompts < 0:
            raise SweepConfigError(f"--warmup-prompts must be >= 0, got {self.warmup_prompts}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SweepPlan:
        configs = tuple(ServerConfig.parse(c) for c in args.config or ())
        check_configs(configs)  # before the model is fetched for its vocabulary size: a typo fails at once
        ladder = RateLadder(
            rates=parse_rates(args.rates) if args.rates else (),
            min_rate=args.min_rate,
            factor=args.rate_factor,
            threshold=args.saturation_threshold,
            max_rungs=args.max_rungs,
        )
        vocab = args.random_vocab_size or min(10000, _vocab_size(args.model))
        serve = ServeConfig(
            **{k: getattr(args, k) for k in SERVE_FLAGS},
            random_vocab_size=vocab,
            ignore_eos=args.ignore_eos,
            disable_tqdm=True,
        )
        return cls(
            model=args.model,
            configs=configs,
            server_args=_split_server_args(args.server_args),
            ladder=ladder,
            serve=serve,
            warmup_prompts=args.warmup_prompts,
            startup_timeout=args.startup_timeout,
        )

    def server_flags(self, cfg: ServerConfig) -> list[str]:
        # The config's flags come last so that they win over the same flag in --server-args.
        return ["--model", self.model, *self.server_args, *cfg.flags]


def check_configs(configs: tuple[ServerConfig, ...]) -> None:
    if not configs:
        raise SweepConfigError("give at least one --config, e.g. --config pp=1,threads=1")
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise SweepConfigError(f"--config given twice: {labels}; each configuration is one line of the plots")


def _split_server_args(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        raise SweepConfigError(f"--server-args {text!r}: {e}; quote it as a shell would") from None


def _vocab_size(model: str) -> int:
    """The model's vocabulary size: random prompt ids must stay below it or the server refuses them."""
    from ringsched.weights.fetch import resolve_model
    from ringsched.weights.model_config import ModelConfig

    return ModelConfig.from_dir(resolve_model(model, quiet=True)).vocab_size


def run_sweep(args: argparse.Namespace) -> int:
    if args.from_json:
        try:
            sweep = load_sweep(args.from_json)
        except (OSError, ValueError) as e:
            print(f"error: --from-json {args.from_json}: {e}", file=sys.stderr)
            return 2
        print(write_report(sweep, Path(args.out_dir or Path(args.from_json).parent), json_too=False))
        return 0
    try:
        plan = SweepPlan.from_args(args)
    except (ValueError, OSError, FetchError) as e:  # SweepConfigError, ServeConfig's checks, a missing model
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir or DEFAULT_OUT_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "model": plan.model,
        "server_args": list(plan.server_args),
        "ladder": dataclasses.asdict(plan.ladder),
        "serve": _serve_settings(plan.serve),
        "configs": [],
    }
    # SIGTERM (a job scheduler, `kill`) takes the Ctrl-C path, so the running server is stopped too.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for i, cfg in enumerate(plan.configs):
            record = new_record(plan, cfg, out_dir / f"server-{i}.log")
            sweep["configs"].append(record)
            run_config(plan, cfg, record)
            save_json(sweep, out_dir / "sweep.json")  # after every config: a crash later keeps what was measured
    except KeyboardInterrupt:
        if sweep["configs"]:  # its server is stopped; keep the rungs it finished
            sweep["configs"][-1]["error"] = "interrupted (Ctrl-C)"
        print(write_report(sweep, out_dir))
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(write_report(sweep, out_dir))
    failed = [c["label"] for c in sweep["configs"] if c["error"]]
    if failed:
        print(f"configurations that failed (their server logs are in {out_dir}): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _serve_settings(cfg: ServeConfig) -> dict[str, Any]:
    keep = (*SERVE_FLAGS, "random_vocab_size", "ignore_eos")
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k in keep}


def new_record(plan: SweepPlan, cfg: ServerConfig, log_path: Path) -> dict[str, Any]:
    return {
        "label": cfg.label,
        "flags": plan.server_flags(cfg),
        "error": None,
        "server_log": str(log_path),
        "rungs": [],
    }


def run_config(plan: SweepPlan, cfg: ServerConfig, record: dict[str, Any]) -> None:
    """Start a server for `cfg`, run its ladder into `record["rungs"]` and stop the server, however this ends.
    An error (the server would not start, died, or failed every request of a rung) goes into
    `record["error"]`, with the end of the server's log, and the sweep goes on; Ctrl-C is raised."""
    print(f"=== {cfg.label}: starting the server ({' '.join(record['flags'])})", flush=True)
    server = ServerProcess(record["flags"], startup_timeout=plan.startup_timeout)
    try:
        server.start()
        warm_up(plan, server.url)
        run_ladder(plan, server.url, cfg.label, record["rungs"])
    except Exception as e:  # one broken configuration must not lose the others' results
        record["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        record["log_tail"] = server.log().splitlines()[-20:]
        tail = "\n".join(record["log_tail"])
        print(f"=== {cfg.label}: failed: {record['error']}\nserver log ends:\n{tail}", file=sys.stderr, flush=True)
    finally:
        server.stop()
        Path(record["server_log"]).write_text(server.log())
        server.log_path.unlink(missing_ok=True)


def warm_up(plan: SweepPlan, url: str) -> None:
    """A few requests, not measured: the first forward passes of a fresh server are slow."""
    if plan.warmup_prompts:
        cfg = dataclasses.replace(plan.serve, base_url=url, num_prompts=plan.warmup_prompts, seed=plan.serve.seed + 1)
        asyncio.run(benchmark(cfg, load_requests(cfg)))


def run_ladder(plan: SweepPlan, url: str, label: str, rungs: list[dict[str, Any]]) -> None:
    """The finite rungs until the ladder stops, then the `inf` rung; each appended to `rungs` as it ends."""
    throughputs: list[float] = []
    # The server is idle between rungs (idle time is not counted), so one rung's closing snapshot of the
    # stage times is the next rung's opening one.
    snapshot = settled_stages(url)
    while (rate := plan.ladder.next_rate(throughputs)) is not None:
        rung, snapshot = run_rung(plan, url, label, rate, snapshot)
        rungs.append(rung)
        throughputs.append(rung["result"]["output_throughput"])
    rungs.append(run_rung(plan, url, label, float("inf"), snapshot)[0])


def settled_stages(url: str) -> dict[int, dict[str, float]]:
    """The stages' times once they have stopped moving (the server is idle between rungs)."""
    return settled(lambda: scrape_stages(url), lambda a, b: a != b, STATS_SETTLE_S, STATS_SETTLE_DEADLINE_S)


def run_rung(
    plan: SweepPlan, url: str, label: str, rate: float, before: dict[int, dict[str, float]]
) -> tuple[dict[str, Any], dict[int, dict[str, float]]]:
    """One `bench serve` run at `rate` and the stages' accounting since `before`; returns the rung record and
    the closing snapshot. Raises if every request failed (the server is likely gone)."""
    print(f"=== {label}: {rate:g} requests/s, {plan.serve.num_prompts} requests", flush=True)
    cfg = dataclasses.replace(plan.serve, base_url=url, request_rate=rate)
    result = run_serve(argparse.Namespace(**dataclasses.asdict(cfg)))
    if result["successful_requests"] == 0:
        raise RuntimeError(f"every request at {rate:g} requests/s failed; first error: {result['errors'][0]}")
    after = settled_stages(url)
    rung = {"rate": result["request_rate"], "result": result, "stages": stage_deltas(before, after, result["duration"])}
    return rung, after
