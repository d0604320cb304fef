#!/usr/bin/env bash
# Interleaved repeats of the "adding a stage" pair (docs/performance.md): for each repeat, how much
# parallel compute the two CPUs give right now (`bench cores`), then PP=1 and PP=2 (even split) back to back,
# alternating which goes first. Prints each pair's ratio and the medians. Run on an otherwise idle machine.
# Usage: [KV=2G] [PP1_ARGS="..."] scripts/bench_pairs.sh [OUT_DIR] [REPEATS] [NUM_PROMPTS] [extra PP=2 flags...]
# e.g. each stage holding the same resources (one core, 2G of KV), so PP=2 runs twice the requests:
#   KV=2G PP1_ARGS="--max-running-requests 128" scripts/bench_pairs.sh out 3 256 \
#       --max-running-requests 256 --pp-layer-partition auto --pp-flex-layers 2
set -euo pipefail
out=${1:-bench-pairs}
reps=${2:-3}
n=${3:-256}
shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$out"
common="--threads-per-stage 1 --num-prompts $n --input-len 128 --output-len 128 --kv-cache-memory ${KV:-1G} --json"
for i in $(seq 1 "$reps"); do
    python -m ringsched.bench cores --cpus 2 --repeat 3 --json | tail -1 > "$out/cores_$i.json"
    if (( i % 2 )); then order="1 2"; else order="2 1"; fi
    for pp in $order; do
        extra="${PP1_ARGS:-}"; if [[ $pp == 2 ]]; then extra="$*"; fi
        python -m ringsched.bench offline --pp-size "$pp" $common $extra | tail -1 > "$out/pp${pp}_$i.json"
    done
done
python - "$out" "$reps" <<'PY'
import json, pathlib, statistics, sys
d, reps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
load = lambda name: json.loads((d / name).read_text())
ratios = []
for i in range(1, reps + 1):
    c, p1, p2 = load(f"cores_{i}.json"), load(f"pp1_{i}.json"), load(f"pp2_{i}.json")
    r = p2["output_tokens_per_s"] / p1["output_tokens_per_s"]
    ratios.append(r)
    busy = ", ".join(f"{b:.0%}" for b in p2["stage_busy_fraction"])
    # The stages' compute seconds against PP=1's on the same requests: where the host, not the ring, moved the
    # ratio (docs/performance.md, "Where the time goes": 0.96x to 1.22x on the same code).
    compute = lambda p: sum(s["compute_s"] for s in p["runs"][0]["stage_deltas"])
    print(f"pair {i}: cores {c['scaling']:.2f}x | PP=1 {p1['output_tokens_per_s']:.1f} tok/s | "
          f"PP=2 {p2['partition']} {p2['output_tokens_per_s']:.1f} tok/s = {r:.2f}x, busy {busy}, "
          f"compute {compute(p2) / compute(p1):.2f}x PP=1's")
print(f"median PP=2/PP=1 over {reps} pairs: {statistics.median(ratios):.2f}x")
PY
