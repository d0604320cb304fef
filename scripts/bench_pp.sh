#!/usr/bin/env bash
# The "adding a stage" measurement of docs/performance.md, run back to back on an otherwise idle machine:
# how much parallel compute the CPUs give, then PP=1 against PP=2 (even and balanced split, async depth 0/1)
# with SmolLM2, 256 requests of 128 prompt and 128 new tokens, one thread per stage.
# Usage: scripts/bench_pp.sh [OUT_DIR] [NUM_PROMPTS]
set -euo pipefail
out=${1:-bench-out}
n=${2:-256}
mkdir -p "$out"
common="--threads-per-stage 1 --num-prompts $n --input-len 128 --output-len 128 --kv-cache-memory 1G --json"
python -m ringsched.bench cores --cpus 2 --repeat 3 --json | tail -1 > "$out/cores.json"
python -m ringsched.bench offline --pp-size 1 $common | tail -1 > "$out/pp1.json"
python -m ringsched.bench offline --pp-size 2 $common | tail -1 > "$out/pp2_even.json"
python -m ringsched.bench offline --pp-size 2 --pp-layer-partition 19,11 $common | tail -1 > "$out/pp2_balanced.json"
python -m ringsched.bench offline --pp-size 2 --pp-layer-partition 19,11 --pp-async-batch-depth 1 $common \
    | tail -1 > "$out/pp2_balanced_d1.json"
python - "$out" <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
c = json.loads((d / "cores.json").read_text())
print(f"CPUs {c['cpus']}: one alone {c['gflops_one_alone']:.1f} GFLOP/s, both at once {c['gflops_all_together']:.1f} "
      f"GFLOP/s ({c['scaling']:.2f}x)")
base = json.loads((d / "pp1.json").read_text())["output_tokens_per_s"]
for name in ("pp1", "pp2_even", "pp2_balanced", "pp2_balanced_d1"):
    r = json.loads((d / f"{name}.json").read_text())
    busy = ", ".join(f"{b:.0%}" for b in r["stage_busy_fraction"])
    print(f"{name:18s} partition {r['partition']} depth {r['pp_async_batch_depth']}: "
          f"{r['output_tokens_per_s']:.1f} tok/s ({r['output_tokens_per_s'] / base:.2f}x PP=1), busy {busy}")
PY
