"""Print and check the memory reconciliation of finished CUDA runs (used by gpu_check.sh).

    python scripts/gpu_check.py RUN_DIR [RUN_DIR ...]

For each run dir (with summary.json): the Device/Overall table rebuilt from the summary, the
census, the explanations and the sampling overhead; then checks that hold on any CUDA device:
NVML and the allocator were measured, the census agrees with the allocator, paged 8-bit AdamW
keeps its state outside the allocator, and sampling stays cheap. Exit 1 if a check fails.
Imports neither torch nor mlx.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from finetune.accounting import fmt_bytes as fb
from finetune.accounting import render_summary_table

MiB = 1 << 20
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'PASS' if ok else 'FAIL'}] {what}")
    if not ok:
        failures.append(what)


def report(run: Path) -> dict[str, Any] | None:
    path = run / "summary.json"
    print(f"\n===== {run.name}: {path}")
    if not path.is_file():
        check(False, f"{run.name}: summary.json exists (see {run}.log)")
        return None
    s = json.loads(path.read_text())
    mem = s["memory"]
    last, acc = mem.get("last") or {}, mem.get("accounting") or {}
    params, optim = s.get("params_trainable") or 0, s.get("optim")
    print(f"optim={optim} params_trainable={params:,} steps={s.get('steps_this_run')} device={s.get('device')} "
          f"tokens/s={s.get('tokens_per_sec') or 0:,.0f}")
    print(render_summary_table(mem))
    first = mem.get("census_first_optimizer") or {}
    print("census at the first optimizer step: "
          + ", ".join(f"{k[:-6]} {fb(v)}" for k, v in first.items() if k.endswith("_bytes")))
    for e in mem.get("explanations", []):
        print(f"  - [{e['severity']}] {e['rule']}: {e['text']}")
    print(f"accounting: {acc.get('samples')} samples, {acc.get('per_sample_us_mean') or 0:.0f} us/sample mean, "
          f"{acc.get('per_sample_us_max') or 0:.0f} us max; {(acc.get('fraction_of_step_time') or 0):.3%} of step "
          f"time ({(acc.get('own_fraction_of_step_time') or 0):.3%} outside backend calls); census "
          f"{acc.get('census_calls')} calls, {(acc.get('census_seconds') or 0) * 1e3:.1f} ms")
    if mem.get("nvml", {}).get("error"):
        print(f"NVML error: {mem['nvml']['error']}")

    ints = lambda *ks: all(isinstance(last.get(k), int) for k in ks)
    check(ints("allocated_bytes", "reserved_bytes", "step_peak_allocated_bytes"), "allocator figures are ints")
    check(ints("device_used_bytes", "device_total_bytes", "non_allocator_bytes"), "NVML device_used measured")
    check(isinstance(last.get("other_processes_used_bytes"), int),
          "NVML per-process list read (other processes' usage known)")
    ao = last.get("census_activations_and_other_bytes")
    check(ao is not None and ao >= -MiB, f"census within the allocator at the last sample (other = {fb(ao)})")
    rules = {e["rule"] for e in mem.get("explanations", [])}
    check("lazy_optimizer_state" in rules, "lazy optimizer-state creation explained")
    check("non_allocator" in rules, "NVML vs reserved gap explained")
    ctx = last.get("cuda_context_bytes")
    check(isinstance(ctx, int) and ctx > 0, f"CUDA context measured at setup ({fb(ctx)})")
    check("leak" not in rules, "no leak flagged")
    check((acc.get("own_fraction_of_step_time") or 1) < 0.01, "own sampling overhead under 1% of step time")
    state = (first.get("optimizer_state_bytes") or 0) + (first.get("optimizer_state_paged_bytes") or 0)
    paged = first.get("optimizer_state_paged_bytes") or 0
    if params:
        print(f"optimizer state {fb(state)} = {state / params:.3f} bytes/param (paged {fb(paged)})")
    if optim in ("adamw_8bit", "paged_adamw_8bit") and params:
        # two 8-bit moments + blockwise absmax; small tensors (< 4096 elements) keep 32-bit state
        check(1.9 <= state / params <= 2.5, f"8-bit AdamW state is ~2 bytes/param ({state / params:.3f})")
    if optim and optim.startswith("paged"):
        check(paged > 0.9 * state, f"paged optimizer: state outside the allocator ({fb(paged)} of {fb(state)})")
        check(last.get("paged_optimizer_state_bytes") == last.get("census_optimizer_state_paged_bytes"),
              "paged state is a known part of the NVML gap")
    elif optim:
        check(paged == 0, "unpaged optimizer: no paged state")
    return s


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    summaries = {Path(a).name: report(Path(a)) for a in argv}
    a, b = summaries.get("adamw_8bit"), summaries.get("paged_adamw_8bit")
    if a and b:
        la, lb = a["memory"]["last"], b["memory"]["last"]
        pa, pb = a["memory"]["peaks"], b["memory"]["peaks"]
        print("\n===== adamw_8bit vs paged_adamw_8bit (paged minus unpaged)")
        for k in ("allocated_bytes", "reserved_bytes", "device_used_bytes", "non_allocator_bytes"):
            va, vb = la.get(k), lb.get(k)
            print(f"  {k:32s} {fb(va):>10s} {fb(vb):>10s}  {fb(vb - va) if va is not None and vb is not None else 'n/a':>10s}")
        print(f"  {'peak allocated':32s} {fb(pa.get('allocated_bytes')):>10s} {fb(pb.get('allocated_bytes')):>10s}")
        if la.get("allocated_bytes") is not None and lb.get("allocated_bytes") is not None:
            check(lb["allocated_bytes"] < la["allocated_bytes"],
                  "paging moves optimizer state out of the allocator (allocated lower)")
    print(f"\n{len(failures)} check(s) failed" + (": " + "; ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
