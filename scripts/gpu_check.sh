#!/usr/bin/env bash
# The GPU check of docs/gpu.md, one command of a few minutes: greedy on CUDA against the CPU (PP=1 with and without
# CUDA graphs, and with two GPUs or more PP=2 and TP=2), the op counter on CUDA, then TPOT at one request and
# throughput at 64, graphs on and off, against transformers' eager generate on the same GPU, and for an 8B shape of
# 4 layers; one table on stdout, and in $OUT/gpu_check.txt when OUT is set; then scripts/nccl_check.py (the NCCL
# ring, on one GPU through RINGSCHED_ONE_GPU=1), its table in $OUT/nccl_check.txt. Needs no network.
#
#   scripts/gpu_check.sh [--model DIR]      # or MODEL=DIR; default: random weights of SmolLM2-135M's shape
#   WHEELS=DIR scripts/gpu_check.sh         # pip-installs DIR's wheels (e.g. pyzmq) into a temporary directory
#
# On a machine without a GPU it says so and exits 0 without running anything.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
MODEL=${MODEL:-}
if [[ "${1:-}" == "--model" ]]; then MODEL=$2; fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: no GPU here (no nvidia-smi, or torch.cuda.is_available() is false); nothing run"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${WHEELS:-}" ]]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$tmp/site" "$WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:$tmp/site"
fi
if [[ -z "$MODEL" ]]; then  # SmolLM2-135M's shape (30 layers, 576 wide, 9 heads, 3 KV heads), random weights
    MODEL="$tmp/smollm2-135m-random"
    "$PYTHON" -m ringsched.models random --layers 30 --hidden 576 --heads 9 --kv-heads 3 --intermediate 1536 \
        --vocab 49152 --max-len 8192 --tie --out "$MODEL" >/dev/null
fi
# An 8B Llama's layer shape (4096 wide, 32 heads, 8 KV heads), 4 layers, random; a 32k vocabulary, tied: 4 GB
BIG="$tmp/8b-shape-4-layers"
"$PYTHON" -m ringsched.models random --layers 4 --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 \
    --vocab 32000 --max-len 8192 --tie --out "$BIG" >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" scripts/gpu_check.py --model "$MODEL" --big-model "$BIG" ${OUT:+--out "$OUT/gpu_check.txt"} || status=$?
# The NCCL ring: PP=2, TP=2, a PP=3 ring's seams, a rank killed mid-stream (one GPU: every rank on it)
"$PYTHON" scripts/nccl_check.py --model "$MODEL" ${OUT:+--out "$OUT/nccl_check.txt"} || status=$?
exit "${status:-0}"
