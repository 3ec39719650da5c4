#!/usr/bin/env bash
# bash benchmarks/fsdp_load_rss.sh OUTDIR OVERRIDES...
#
# Issue 34: two ranks of FSDP on this CPU (torchrun, gloo), each rank's RSS just before the model
# loads, its high-water mark over the setup (the load and fully_shard), after its last step, and
# after that with the C heap's free pages handed back (malloc_trim), and the adapter save's
# high-water mark: tests/dist_scripts/
# torch_rank_memory.py writes them. Run it from two checkouts to compare loads, e.g.
#   M="model=tiny model.config.hidden_size=1024 model.config.intermediate_size=3072 model.config.num_hidden_layers=8
#      model.config.num_attention_heads=8 model.config.num_key_value_heads=8"
#   bash benchmarks/fsdp_load_rss.sh /tmp/out $M method=qlora train.batch_size=1 [backend.cpu_offload=true]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=$1; shift
rm -rf "$out"; mkdir -p "$out/ranks"
cd "$REPO"
env PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 RANK_MEMORY_DIR="$out/ranks" \
  python3 -m torch.distributed.run --standalone --nproc-per-node=2 tests/dist_scripts/torch_rank_memory.py \
  backend=cuda backend.device=cpu train.steps=3 train.eval_every=0 train.progress=false train.warmup_steps=1 \
  backend.strategy=fsdp "$@" "hydra.run.dir=$out/run" > "$out/log" 2>&1
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
summary = json.load(open(f"{out}/run/summary.json"))
mib = lambda b: f"{b / 2**20:.0f} MiB"
for r in (0, 1):
    d = json.load(open(f"{out}/ranks/rank{r}.json"))
    b = d["rss_before_load"]
    print(f"rank {r}: RSS before the load {mib(b)}; growth to the setup's high-water mark {mib(d['peak_rss_setup'] - b)}, "
          f"to the run's peak {mib(summary['ranks'][r]['peak_rss'] - b)}, after the last step {mib(d['rss_after_step'] - b)}, "
          f"after it with malloc_trim {mib(d['rss_after_step_trimmed'] - b)}, to the adapter save's peak "
          f"{mib(d['peak_rss_save'] - b)} (the save itself: {mib(d['peak_rss_save'] - d['rss_before_save'])})")
plan = (summary.get("plan_error_run") or {}).get("peak_host") or {}
if plan.get("predicted"):
    print(f"the run's plan: host peak {mib(plan['predicted'])} (growth over its process base of 453 MiB "
          f"{mib(plan['predicted'] - 453 * 2**20)}); rank 0's measured peak RSS {mib(plan['measured'])}")
PY
