"""Multirun jobs: each from its own baseline, pruned by plan when the sweep searches a budget.

Why a fresh process per job: memory is measured per process. With Hydra's basic launcher every
job of ``finetune -m`` runs in one Python process, so a later job inherits the imports, caches
and allocator pools of the earlier ones (three optimizer jobs of one model measured 0.380, 0.452
and 0.473 GiB peak RSS in that order, and a reversed sweep ranks them differently). No reset
inside a process provably restores that baseline (glibc keeps freed arenas, frameworks keep
their caching allocators, imported libraries stay mapped), so each job runs in its own child
process: ``python -m finetune <the job's overrides> hydra.run.dir=<the job's dir>``. A job that
submitit started (its own process already) is not nested again; ``isolate_jobs=false`` runs
jobs in-process (faster, peaks not comparable).

Pruning: with ``objective`` set (an Optuna search), a job whose plan does not fit
``memory.budget`` is not run at all: it writes ``pruned.json`` (the planned peak, the budget)
and returns the worst objective value, so the sweeper never picks it and no weight is loaded.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

FRESH_ENV = "FINETUNE_FRESH_PROCESS"
# set in every job submitit starts (local: its job id; SLURM: the executor), a process of its own
SUBMITIT_ENV = ("SUBMITIT_LOCAL_JOB_ID", "SUBMITIT_EXECUTOR")
# objective -> (summary.json key, direction)
OBJECTIVES = {"tokens_per_sec": ("tokens_per_sec", "maximize"), "val_loss": ("final_val_loss", "minimize"),
              "train_loss": ("final_train_loss", "minimize")}


def in_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # not under Hydra (tests calling run(cfg) directly)
        return False


def worst(objective: str) -> float:
    return -math.inf if OBJECTIVES[objective][1] == "maximize" else math.inf


def objective_value(summary: dict[str, Any] | None, objective: str | None) -> Any:
    """What a job returns to the sweeper: the objective's value, or the summary itself."""
    if not objective:
        return summary
    if summary is None:
        return worst(objective)
    v = summary.get(OBJECTIVES[objective][0])
    return worst(objective) if v is None else float(v)


def prune_by_plan(cfg: Any, run_dir: Path) -> dict[str, Any] | None:
    """When ``memory.budget`` is set and the job's plan (as configured: its micro-batch,
    precision, method...) peaks above it, write ``pruned.json`` and return its content; else None."""
    if cfg.memory.budget is None:
        return None
    from finetune import planner

    p = planner.plan(cfg, recommend=False)
    if p["fits"] is not False:
        return None
    rec = {"pruned": "plan_over_budget", "planned_peak_bytes": p["max_device_peak_bytes"],
           "budget_bytes": p["budget_bytes"], "backend": p["backend"], "method": p["method"], "optim": p["optim"],
           "precision": p["precision"], "batch_size": p["batch_size"], "seq_len": p["seq_len"]}
    from finetune.io import atomic_write_json

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "pruned.json", rec)
    print(f"[sweep] pruned by plan: peak {p['max_device_peak_bytes'] / 2**30:.2f} GiB > memory.budget "
          f"{p['budget_bytes'] / 2**30:.2f} GiB ({run_dir})", file=sys.stderr)
    return rec


def run_job(cfg: Any, run: Any) -> Any:
    """One multirun job: pruned by plan where the sweep searches, else run in a fresh process
    (or in this one where ``isolate_jobs=false`` or the launcher already gave it one)."""
    from hydra.core.hydra_config import HydraConfig

    objective = cfg.get("objective")
    if objective and objective not in OBJECTIVES:
        from finetune.config import UserError

        raise UserError(f"objective={objective} is not valid; choose one of: {', '.join(OBJECTIVES)}")
    run_dir = Path(str(cfg.run_dir))
    if objective and cfg.mode == "train" and prune_by_plan(cfg, run_dir) is not None:
        return worst(objective)
    fresh = os.environ.get(FRESH_ENV) or any(os.environ.get(k) for k in SUBMITIT_ENV)
    if not cfg.get("isolate_jobs", True) or fresh or cfg.mode != "train":
        return objective_value(run(cfg), objective)
    hc = HydraConfig.get()
    overrides = [o for o in hc.overrides.task if not o.startswith(("hydra.run.dir=", "hydra.sweep."))]
    quoted = str(run_dir).replace("\\", "\\\\").replace("'", "\\'")  # the job dir holds '=' and ','
    cmd = [sys.executable, "-m", "finetune", *overrides, f"hydra.run.dir='{quoted}'",
           # the job's own dir already holds the multirun's .hydra/; the child writes its own beside
           "hydra.output_subdir=.hydra"]
    env = {**os.environ, FRESH_ENV: "1"}
    r = subprocess.run(cmd, env=env, check=False)
    if r.returncode != 0:
        from finetune.config import UserError

        raise UserError(f"sweep job {hc.job.num} ({' '.join(overrides)}) exited {r.returncode}; its log is in {run_dir}")
    summary = run_dir / "summary.json"
    return objective_value(json.loads(summary.read_text()) if summary.is_file() else None, objective)
