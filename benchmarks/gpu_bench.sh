#!/usr/bin/env bash
# bash benchmarks/gpu_bench.sh [--quick | --smoke] [--parts peers,chunk,grid] [other flags of gpu_bench.py]
#
# Issue 14's GPU bench on a CUDA machine (no download): a random Qwen2-0.5B-shaped model in bf16,
# ours vs HF Trainer + PEFT (real tokens/s, peak reserved), chunked loss on/off, and the planner's
# peak vs the measured one over 14 configurations and FSDP-QLoRA with CPU + activation offload at world
# size 1 (issue 34). ~7-8 min on one H200; --quick about half;
# --smoke runs it all on a CPU with a tiny shape. Report: stdout and $OUT/gpu_bench.txt where
# $OUT is set. Exit 1 only when a run crashed; a missed target is printed, never an error.
#
# On a lent machine (python3 there has torch, transformers, peft, accelerate; not hydra-core,
# omegaconf, antlr4-python3-runtime or bitsandbytes): carry them as wheels plus GSM8K, e.g.
#   GPU_BENCH_WHEELS=.whl FINETUNE_GSM8K=.whl/gsm8k_train.jsonl bash benchmarks/gpu_bench.sh
# GPU_BENCH_WHEELS=DIR installs DIR/*.whl into /tmp/gpu_bench_site first (no index, no deps).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PY="${PYTHON:-python3}"

if [ -n "${GPU_BENCH_WHEELS:-}" ]; then
  site=/tmp/gpu_bench_site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$GPU_BENCH_WHEELS"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, installed or not
export PYTHONUNBUFFERED=1
export GPU_BENCH_CMD="bash benchmarks/gpu_bench.sh${*:+ $*}"

exec "$PY" "$HERE/gpu_bench.py" "$@"
