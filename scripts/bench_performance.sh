#!/usr/bin/env bash
# Every measurement of docs/performance.md, one after another, on an otherwise idle machine (~65 minutes on
# two vCPUs). Each step writes JSON (and the sweep its Markdown and plots) under OUT_DIR.
# Usage: scripts/bench_performance.sh [OUT_DIR]
set -euo pipefail
out=${1:-bench-perf}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
off="python -m ringsched.bench offline --threads-per-stage 1 --input-len 128 --output-len 128 --kv-cache-memory 2G --json"
step() { echo "== $(date +%T) $*" >&2; }

# 1. Adding a stage, each stage with the same resources (one core, 2G of KV): PP=2 holds twice the requests.
step "pairs"
# The flexible cut at the default depth 0 (two micro-batches of 128 rows), decided while each micro-batch runs
# (`--pp-flex-policy ready`): the fastest configuration in docs/performance.md.
KV=2G PP1_ARGS="--max-running-requests 128" "$here/bench_pairs.sh" "$out/pairs" 3 256 \
    --max-running-requests 256 --pp-layer-partition auto --pp-flex-layers 2 --pp-flex-policy ready > "$out/pairs.txt"

# 2. The sweep: PP=1 and PP=2 at one thread per stage, PP=1 at two threads; a ladder of rates to saturation.
step "sweep"
python -m ringsched.bench sweep --rates 0.5,1,2 --num-prompts 24 --out-dir "$out/sweep" \
    --server-args="--kv-cache-memory 2G" \
    --config pp=1,threads=1,running=128 \
    --config pp=2,threads=1,running=256,partition=auto,depth=0,flex=2,policy=ready \
    --config pp=1,threads=2,running=128 > "$out/sweep.txt"

# 3. bfloat16 (AMX on this CPU) beside float32.
step "bf16"
$off --pp-size 1 --num-prompts 128 --max-running-requests 128 --dtype bfloat16 | tail -1 > "$out/pp1_bf16.json"
$off --pp-size 2 --num-prompts 128 --max-running-requests 256 --pp-layer-partition auto --dtype bfloat16 \
    | tail -1 > "$out/pp2_bf16.json"

# 4. A random ~1B Llama: the weight-bandwidth-bound regime (few requests, decode-heavy). 256-token prefill
#    chunks halve the ring's fill and transition waits; PP=1 runs as fast with them as with 512.
step "1B"
big=${RINGSCHED_CACHE:-$HOME/.cache/ringsched}/models/random-llama-1b
[[ -f $big/config.json ]] || python -m ringsched.models random --layers 20 --hidden 2048 --intermediate 5632 \
    --heads 32 --kv-heads 8 --vocab 32000 --out "$big" >/dev/null
for pp in 1 2; do
    python -m ringsched.bench offline --model "$big" --pp-size "$pp" --threads-per-stage 1 --num-prompts 64 \
        --input-len 32 --output-len 64 --max-running-requests $((32 * pp)) --kv-cache-memory 1G \
        --pp-layer-partition auto --chunked-prefill-size 256 --warmup-prompts 2 --json \
        | tail -1 > "$out/big_pp$pp.json"
done

# 5. transformers on the same requests (float32 and bfloat16, both cores).
step "hf"
python -m ringsched.bench hf --num-prompts 128 --batch-sizes 64,128 --json | tail -1 > "$out/hf_fp32.json"
$off --pp-size 2 --num-prompts 128 --max-running-requests 256 --pp-layer-partition auto | tail -1 > "$out/pp2_128.json"
python -m ringsched.bench hf --num-prompts 128 --batch-sizes 64,128 --dtype bfloat16 --json | tail -1 \
    > "$out/hf_bf16.json"
$off --pp-size 2 --num-prompts 128 --max-running-requests 256 --pp-layer-partition auto --dtype bfloat16 \
    | tail -1 > "$out/pp2_128_bf16.json"
# 6. The same PP=2 with the even split and with async depth 1 (a third micro-batch in flight).
step "pp2 variants"
$off --pp-size 2 --num-prompts 256 --max-running-requests 256 --pp-layer-partition 15,15 | tail -1 > "$out/pp2_even.json"
$off --pp-size 2 --num-prompts 256 --max-running-requests 258 --pp-max-micro-batch-size 86 \
    --pp-async-batch-depth 1 --pp-layer-partition auto | tail -1 > "$out/pp2_depth1.json"

step "done"
