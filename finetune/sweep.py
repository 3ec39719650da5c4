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

Pruning: with ``search_objective`` set (an Optuna search), a job whose plan does not fit
``memory.budget`` is not run at all: it writes ``pruned.json`` (the planned peak, the budget)
and returns the worst objective value, so the sweeper never picks it and no weight is loaded.

A failed job does not end the sweep: it writes ``failed.json`` (its error line, exit code and
the file holding its output) into its directory, prints one line, and the sweep goes on; the
report lists it, and ``finetune -m`` exits 1 naming the failed jobs in its last line.
``fail_fast=true`` stops at the first failure instead (the report is still written).

Secrets: a job's directory is named by its number and its non-secret overrides (``job_dirname``,
conf/config.yaml ``hydra.sweep.subdir``); ``multirun.yaml`` and Hydra's launch lines are masked
(finetune/redact.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from finetune.redact import (
    config_secrets,
    env_secrets,
    is_secret_override,
    redact_multirun_yaml,
    redact_overrides,
    redact_text,
)
from finetune import planner
from finetune.errors import UserError
from finetune.spec import RunSpec
from finetune.io import atomic_write_json
from finetune.report import SweepReportCallback

FRESH_ENV = "FINETUNE_FRESH_PROCESS"
# set in every job submitit starts (local: its job id; SLURM: the executor), a process of its own
SUBMITIT_ENV = ("SUBMITIT_LOCAL_JOB_ID", "SUBMITIT_EXECUTOR")
# objective -> (summary.json key, direction)
OBJECTIVES = {"tokens_per_sec": ("tokens_per_sec", "maximize"), "val_loss": ("final_val_loss", "minimize"),
              "train_loss": ("final_train_loss", "minimize"),
              # a preference objective's last validation (summary.json pair_metrics.eval), TRL's
              # names, as TRL's metric_for_best_model takes them
              "eval_rewards/accuracies": ("pair_metrics.eval.eval_rewards/accuracies", "maximize"),
              "eval_rewards/margins": ("pair_metrics.eval.eval_rewards/margins", "maximize")}
PAIR_OBJECTIVES = ("eval_rewards/accuracies", "eval_rewards/margins")
FAILED_FILE = "failed.json"  # in a failed job's dir: {job, overrides, error, exit_code, log}
# the job process's stderr, as shown live (not *.log: a refused run puts back the *.log files
# it found, which would cut this one off while it is written)
JOB_STDERR = "stderr.txt"
NAME_MAX_BYTES = 200  # a job dir's name; file systems allow 255 bytes per path component


def in_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # not under Hydra (tests calling run(cfg) directly)
        return False


# search_objective=eval:TASK/METRIC: an eval.tasks metric of the job's adapter (summary.json "eval",
# finetune/evaluate.py); minimized where lm-eval's metric is a loss or a perplexity, else maximized
EVAL_PREFIX = "eval:"
_LOWER_IS_BETTER = ("perplexity", "bits_per_byte", "loss", "error", "ter")


def direction(objective: str) -> str:
    """maximize | minimize for ``objective`` (which ``check_objective`` accepted)."""
    if objective.startswith(EVAL_PREFIX):
        metric = objective[len(EVAL_PREFIX):].split("/")[1]
        return "minimize" if metric.endswith(_LOWER_IS_BETTER) else "maximize"
    return OBJECTIVES[objective][1]


def check_objective(objective: str, tree: dict[str, Any]) -> None:
    """One line for an objective the sweep cannot read: not one of OBJECTIVES, or an eval
    metric of a task the job does not run (eval.tasks)."""
    if objective.startswith(EVAL_PREFIX):
        parts = objective[len(EVAL_PREFIX):].split("/")
        tasks = ((tree.get("eval") or {}).get("tasks")) or []
        if len(parts) < 2 or not all(parts):
            raise UserError(f"search_objective={objective}: name a task and its metric, e.g. "
                            "search_objective=eval:gsm8k_local_ppl/bits_per_byte")
        if parts[0] not in tasks:
            raise UserError(f"search_objective={objective} ranks by task {parts[0]}, which the jobs do not evaluate: add "
                            f"eval.tasks=[{parts[0]}]")
        return
    if objective not in OBJECTIVES:
        raise UserError(f"search_objective={objective} is not valid; choose one of: {', '.join(OBJECTIVES)}, or "
                        "eval:TASK/METRIC")
    if objective in PAIR_OBJECTIVES:
        name = str((tree.get("objective") or {}).get("name") or "sft")
        if name == "sft":
            raise UserError(f"search_objective={objective} ranks by a preference objective's validation pairs, and the "
                            "jobs train objective=sft: add objective=dpo (or orpo, simpo) and a file of pairs")
        if not int((tree.get("train") or {}).get("eval_every") or 0):
            raise UserError(f"search_objective={objective} ranks by the validation pairs, which train.eval_every=0 "
                            "never scores: set train.eval_every=N")


def worst(objective: str) -> float:
    return -math.inf if direction(objective) == "maximize" else math.inf


def objective_value(summary: dict[str, Any] | None, objective: str | None) -> Any:
    """What a job returns to the sweeper: the objective's value, or the summary itself. An eval
    metric: TASK/METRIC of the summary's ``eval`` (the adapter's value)."""
    if not objective:
        return summary
    if summary is None:
        return worst(objective)
    if objective.startswith(EVAL_PREFIX):
        v = (summary.get("eval") or {}).get(objective[len(EVAL_PREFIX):])
    else:
        v = summary
        for part in OBJECTIVES[objective][0].split("."):  # a dotted path into summary.json
            v = v.get(part) if isinstance(v, dict) else None
    return worst(objective) if v is None else float(v)


@dataclass(frozen=True)
class Job:
    """A multirun job as finetune.cli hands it over: what the sweep reads of the job's config.
    ``spec`` resolves the config (its checks may refuse it: a failed job), ``run`` runs it in
    this process (``finetune.cli.run``)."""

    run_dir: Path
    mode: str
    objective: str | None
    isolate_jobs: bool
    fail_fast: bool
    tree: dict[str, Any]  # the job's config as composed, interpolations unresolved: its secrets
    spec: Callable[[], RunSpec]
    run: Callable[[], Any]


def prune_by_plan(spec: RunSpec, run_dir: Path) -> dict[str, Any] | None:
    """When ``memory.budget`` is set and the job's plan (as configured: its micro-batch,
    precision, method...) peaks above it, write ``pruned.json`` and return its content; else None."""
    if spec.memory.budget is None:
        return None

    p = planner.plan(spec, recommend=False)
    budget = p["budget_bytes"]
    if p["fits"] is not False or budget is None:  # fits is False only against a budget
        return None
    rec = {"pruned": "plan_over_budget", "planned_peak_bytes": p["fits_bytes"],
           "budget_bytes": budget, "backend": p["backend"], "method": p["method"], "optim": p["optim"],
           "precision": p["precision"], "batch_size": p["batch_size"], "seq_len": p["seq_len"]}

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "pruned.json", rec)
    print(f"[sweep] pruned by plan: peak {p['fits_bytes'] / 2**30:.2f} GiB > memory.budget "
          f"{budget / 2**30:.2f} GiB ({run_dir})", file=sys.stderr)
    return rec


class SweepStopped(SystemExit):
    """``fail_fast=true``: the first failed job ends the sweep (exit 1); the CLI writes the
    report of the jobs so far and names the failure."""

    def __init__(self, sweep_dir: Path, failure: dict[str, Any]):
        super().__init__(1)
        self.sweep_dir, self.failure = sweep_dir, failure


def job_dirname(num: Any, overrides: Any) -> str:
    """A job directory's name (resolver ``job_dirname`` in ``hydra.sweep.subdir``): the job's
    number, then its overrides as Hydra's ``override_dirname`` writes them (sorted, ``,``
    between), less ``hydra.*`` keys and keys named like a secret (``+extra.api_key=...``);
    a ``/`` in a value becomes ``_`` (a path is not a tree of directories), and the name is
    cut to NAME_MAX_BYTES (the number keeps it unique)."""
    secrets = env_secrets()
    kept = sorted(str(o) for o in (overrides or [])
                  if not str(o).lstrip("+~").startswith("hydra.") and not is_secret_override(str(o))
                  and not any(v in str(o) for v in secrets))
    name = f"{num}_{','.join(kept)}" if kept else str(num)
    name = name.replace(os.sep, "_").replace("\0", "")
    return name.encode()[:NAME_MAX_BYTES].decode(errors="ignore")


if not OmegaConf.has_resolver("job_dirname"):
    OmegaConf.register_new_resolver("job_dirname", job_dirname, use_cache=False)


def _error_line(stderr_tail: str, returncode: int) -> str:
    """The one line that says why a job's process failed: its ``error: ...`` line (the CLI's
    one-line refusals), else its last line (a traceback's exception), else how it ended."""
    lines = [ln.strip() for ln in stderr_tail.replace("\r", "\n").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    if returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
        return how + (" (out of memory? see the kernel log: dmesg)" if returncode == -signal.SIGKILL else "")
    if errors:
        return errors[-1][len("error: "):]
    return lines[-1] if lines else f"exited {returncode} without a message"


def _run_child(cmd: list[str], env: dict[str, str], log_path: Path) -> tuple[int, str]:
    """Run a job's process: its stdout passes through, its stderr is shown live and kept in
    ``log_path``. Returns (exit code, its error line)."""
    tail = b""
    log = None
    try:
        log = open(log_path, "wb")
    except OSError as e:  # a full or read-only disk: run the job anyway, say where no log is
        print(f"[sweep] cannot keep the job's output in {log_path} ({e.strerror or e})", file=sys.stderr)
    out = getattr(sys.stderr, "buffer", None)
    p = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    assert p.stderr is not None
    try:
        # chunks, not lines: a progress bar's \r updates reach the terminal as they come
        while chunk := os.read(p.stderr.fileno(), 1 << 16):
            if out is not None:
                sys.stderr.flush()
                out.write(chunk)
                out.flush()
            else:
                sys.stderr.write(chunk.decode(errors="replace"))
            if log is not None:
                try:
                    log.write(chunk)
                    log.flush()
                except OSError:
                    log.close()
                    log = None
            tail = (tail + chunk)[-(1 << 14):]  # the error line is in the last 16 KiB
    finally:
        rc = p.wait()
        p.stderr.close()
        if log is not None:
            log.close()
    return rc, _error_line(tail.decode(errors="replace"), rc)


def _secrets(job: Job) -> list[str]:
    return sorted(set(env_secrets()) | set(config_secrets(job.tree)),
                  key=len, reverse=True)


def record_failure(job: Job, num: Any, overrides: list[str], error: str, exit_code: int, log: Path) -> dict[str, Any]:
    """Write the job's ``failed.json`` (secrets masked) and print its one line; returns the record."""
    secrets = _secrets(job)
    run_dir = job.run_dir
    rec = {"failed": True, "job": num, "overrides": redact_overrides(overrides, secrets),
           "error": redact_text(error, secrets), "exit_code": exit_code, "log": str(log)}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / FAILED_FILE, rec)
    except OSError as e:
        print(f"[sweep] cannot write {run_dir / FAILED_FILE} ({e.strerror or e})", file=sys.stderr)
    print(f"[sweep] job {num} failed (exit {exit_code}): {rec['error']}; log: {log}", file=sys.stderr)
    return rec


def run_job(job: Job) -> Any:
    """One multirun job: pruned by plan where the sweep searches, else run in a fresh process
    (or in this one where ``isolate_jobs=false`` or the launcher already gave it one). A job
    that fails is recorded (``record_failure``) and returns None (the worst value to a search);
    with ``fail_fast=true`` it ends the sweep (SweepStopped)."""
    from hydra.core.hydra_config import HydraConfig

    objective = job.objective
    if objective:
        check_objective(objective, job.tree)
    hc = HydraConfig.get()
    run_dir = job.run_dir
    redact_multirun_yaml(Path(str(hc.sweep.dir)) / "multirun.yaml", _secrets(job))
    (run_dir / FAILED_FILE).unlink(missing_ok=True)  # a job run again into the same sweep dir
    overrides = [o for o in hc.overrides.task if not o.startswith(("hydra.run.dir=", "hydra.sweep."))]
    try:
        if objective and job.mode == "train" and prune_by_plan(job.spec(), run_dir) is not None:
            return worst(objective)
        fresh = os.environ.get(FRESH_ENV) or any(os.environ.get(k) for k in SUBMITIT_ENV)
        if not job.isolate_jobs or fresh or job.mode != "train":
            return objective_value(job.run(), objective)
    except Exception as e:  # in this process: the error as the CLI would say it, the traceback in the job's log
        log = run_dir / f"{hc.job.name}.log"
        try:
            with open(log, "a") as f:
                f.write(traceback.format_exc())
        except OSError:
            pass
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        failure = record_failure(job, hc.job.num, overrides, line if isinstance(e, UserError) else
                                 f"{type(e).__name__}: {line}", 2 if isinstance(e, UserError) else 1, log)
        return _failed(job, hc, failure, objective)
    quoted = str(run_dir).replace("\\", "\\\\").replace("'", "\\'")  # the job dir holds '=' and ','
    cmd = [sys.executable, "-m", "finetune", *overrides, f"hydra.run.dir='{quoted}'",
           # the job's own dir already holds the multirun's .hydra/; the child writes its own beside
           "hydra.output_subdir=.hydra"]
    env = {**os.environ, FRESH_ENV: "1"}
    # the file exists before the child starts, so a refused child leaves the job dir where it is
    log = run_dir / JOB_STDERR
    rc, error = _run_child(cmd, env, log)
    if rc != 0:
        return _failed(job, hc, record_failure(job, hc.job.num, overrides, error, rc, log), objective)
    summary = run_dir / "summary.json"
    return objective_value(json.loads(summary.read_text()) if summary.is_file() else None, objective)


def _failed(job: Job, hc: Any, failure: dict[str, Any], objective: str | None) -> Any:
    if job.fail_fast:
        raise SweepStopped(Path(str(hc.sweep.dir)), failure)
    return worst(objective) if objective else None


def failed_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """The ``failed.json`` records under a sweep dir, by job number."""
    out = []
    for f in Path(sweep_dir).rglob(FAILED_FILE):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            rec = {"error": f"{f} unreadable"}
        if isinstance(rec, dict):
            out.append({**rec, "dir": str(f.parent)})
    return sorted(out, key=lambda r: (r.get("job") if isinstance(r.get("job"), int) else 1 << 62, r["dir"]))


_ENDED: list[Path] = []  # sweep dirs whose multirun ended in this process (SweepOutcome)


def multirun_exit_code() -> int:
    """After ``finetune -m``: 1 when a job of the sweep failed, naming them in one line; else 0."""
    failed = [r for d in _ENDED for r in failed_jobs(d)]
    if not failed:
        return 0
    named = "; ".join(f"#{r.get('job')} ({' '.join(r.get('overrides') or []) or r['dir']}): {r.get('error')}"
                      for r in failed)
    n = len({r["dir"] for r in failed})
    print(f"error: {n} sweep job{'s' if n != 1 else ''} failed: {named} (each dir holds its {FAILED_FILE})",
          file=sys.stderr)
    return 1


def stopped(stop: SweepStopped) -> int:
    """``fail_fast=true`` ended the sweep: its report, then the one line; returns the exit code."""
    print(f"[sweep] fail_fast=true: stopped after job {stop.failure.get('job')} failed", file=sys.stderr)
    redact_multirun_yaml(stop.sweep_dir / "multirun.yaml", env_secrets())
    SweepReportCallback().write(stop.sweep_dir)
    _ENDED.append(stop.sweep_dir)
    return multirun_exit_code()


# the loggers that print a job's overrides as it starts (a filter acts on its own logger only)
LAUNCH_LOGGERS = ("hydra._internal.core_plugins.basic_launcher", "hydra_plugins.hydra_joblib_launcher._core",
                  "hydra_plugins.hydra_submitit_launcher.submitit_launcher")


class _MaskLaunchLines(logging.Filter):
    """Hydra's launchers log each job's overrides (``#0 : ... +extra.api_key=...``): masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg, secrets = record.getMessage(), env_secrets()
        clean = redact_text(" ".join(redact_overrides(msg.split(" "), secrets)), secrets)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


class SweepOutcome(Callback):
    """Hydra callback (conf/config.yaml ``hydra.callbacks``): masks secrets in Hydra's launch
    lines and ``multirun.yaml``, and notes the sweep's end so the CLI's exit code can say
    whether a job failed (``multirun_exit_code``)."""

    def __init__(self) -> None:
        for name in LAUNCH_LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _MaskLaunchLines) for f in logger.filters):
                logger.addFilter(_MaskLaunchLines())

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        root = Path(str(config.hydra.sweep.dir))
        redact_multirun_yaml(root / "multirun.yaml", env_secrets())
        _ENDED.append(root)
