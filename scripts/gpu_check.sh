#!/usr/bin/env bash
# bash scripts/gpu_check.sh [OUT_DIR]
#
# On a CUDA machine (no model hub needed): full fine-tunes of a widened `tiny` Qwen2 (~126M
# parameters: hidden 1024, 8 layers, MLP 4096; the tokenizer's 512-token vocabulary is kept)
# for 10 steps with 8-bit AdamW and with *paged* 8-bit AdamW, then prints each run's memory
# reconciliation (allocator vs NVML, census, explanations) and checks the paged run shows its
# optimizer state outside the allocator; then scripts/gpu_oom_check.py (a real CUDA OOM at a capped
# memory fraction, adapted by the governor). Exit status 0 when every check passes.
#
# Extra optimizers to compare: GPU_CHECK_OPTIMS="adamw adamw_8bit paged_adamw_8bit" bash scripts/gpu_check.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
OUT_DIR="${1:-${OUT:-/tmp}/gpu_check}"
OPTIMS="${GPU_CHECK_OPTIMS:-adamw_8bit paged_adamw_8bit}"
STEPS="${GPU_CHECK_STEPS:-10}"
# GPU_CHECK_ARCH="model=tiny" bash scripts/gpu_check.sh   (a smoke test of this script on a CPU)
read -r -a ARCH <<< "${GPU_CHECK_ARCH:-model=tiny model.config.hidden_size=1024 model.config.num_hidden_layers=8 model.config.num_attention_heads=16 model.config.num_key_value_heads=4 model.config.intermediate_size=4096}"

if command -v finetune >/dev/null 2>&1; then
  FINETUNE=(finetune)
else
  FINETUNE=(python -m finetune.cli)  # not installed: run from the checkout
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

mkdir -p "$OUT_DIR"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv

cd "$REPO"
runs=()
for optim in $OPTIMS; do
  dir="$OUT_DIR/$optim"
  rm -rf "$dir"
  echo "=== finetune backend=cuda method=full optim=$optim train.steps=$STEPS ${ARCH[*]}"
  start=$(date +%s)
  # batch 4 x seq 256 (the defaults) keeps activations visible next to weights and state
  "${FINETUNE[@]}" backend=cuda method=full "optim=$optim" "train.steps=$STEPS" train.eval_every=0 \
      train.progress=false "${ARCH[@]}" "hydra.run.dir=$dir" 2>&1 | tee "$OUT_DIR/$optim.log" | tail -40 \
    || echo "!!! $optim: finetune failed (log: $OUT_DIR/$optim.log)"
  echo "--- $optim: $(( $(date +%s) - start )) s"
  runs+=("$dir")
done

rc=0
python "$HERE/gpu_check.py" "${runs[@]}" || rc=1
# A real CUDA out-of-memory error at a capped per-process memory fraction, caught by the governor
echo "=== python scripts/gpu_oom_check.py $OUT_DIR/oom"
python "$HERE/gpu_oom_check.py" "$OUT_DIR/oom" 2>&1 | grep -v "Loading weights" || rc=1
exit $rc
