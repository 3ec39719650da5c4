"""Checkpoint discovery and the run dir's files, in one place, without a model: where a run's
checkpoints live, which is the latest, which to prune; making, claiming and cleaning a run dir.
The checkpointer (finetune/run/checkpoint.py) saves and resumes through these; the CLI and the
supervisor read them before anything loads.

A checkpoint is ``<run_dir>/checkpoints/step_<7 digits>/`` holding ``backend/`` and
``trainer_state.json``. It is written by ``finetune.io.atomic_dir`` under a dotted temporary
name, so a half-written one never matches ``step_*`` and is never found here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any
from finetune.errors import UserError
from finetune.io import DirBusy, lock_dir

STATE_FILE = "trainer_state.json"
KEEP = 2  # default train.keep_checkpoints: the newest, and one in case it is damaged
_NAME = re.compile(r"step_(\d+)")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint after optimizer step ``step`` goes."""
    return checkpoints_dir(run_dir) / f"step_{step:07d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (by step number, not by name)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _NAME.fullmatch(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def read_state(ckpt: str | Path) -> dict[str, Any]:
    """A checkpoint's trainer state: step, micro_batch, grad_checkpointing, effective_batch,
    tokens, samples."""
    return json.loads((Path(ckpt) / STATE_FILE).read_text())


def latest_state(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint and its trainer state, or None."""
    ckpt = latest_checkpoint(run_dir)
    return (ckpt, read_state(ckpt)) if ckpt is not None else None


def prune(run_dir: str | Path, keep: int = KEEP) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (at least one: the newest is never
    deleted; call this only once a new checkpoint is complete); return what was deleted."""
    old = list_checkpoints(run_dir)[:-max(1, keep)]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


RESULTS = ("summary.json", "adapter", "memory.png")  # what a run leaves besides checkpoints and metrics


def results_in(run_dir: str | Path) -> list[str]:
    """What in ``run_dir`` another run would take for its own result or resume from: its
    checkpoints, summary.json, adapter/ (empty: nothing there)."""
    d = Path(run_dir)
    found = [name + ("/" if (d / name).is_dir() else "") for name in RESULTS[:2] if (d / name).exists()]
    n = len(list_checkpoints(d))
    return found + ([f"{n} checkpoint{'s' if n > 1 else ''}"] if n else [])


def clear_results(run_dir: str | Path) -> None:
    """Remove an earlier run's results and checkpoints (a new run with train.overwrite=true),
    so nothing of it is found beside the new run's, nor resumed from."""
    d = Path(run_dir)
    shutil.rmtree(checkpoints_dir(d), ignore_errors=True)
    for name in RESULTS:
        p = d / name
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _is_temporary(name: str) -> bool:
    """A name our atomic writers give a file or directory before it is complete:
    io.atomic_write_* and io.atomic_dir ``.NAME.XXXX.tmp``, io.finalize_dir's ``.NAME.old``,
    accounting.report.save_png's ``.tmp-XXXX.png``."""
    return name.startswith(".") and (name.endswith((".tmp", ".old"))
                                     or (name.startswith(".tmp-") and name.endswith(".png")))


def remove_dead_temporaries(run_dir: Path) -> list[Path]:
    """Remove what killed writers left in ``run_dir`` and its checkpoints/ (a ``kill -9`` during a
    checkpoint save, an adapter or a summary), and return it. Called once a run holds the run
    dir's lock and its checks have passed: the lock's holder is the only writer there, so every
    temporary found then belongs to a process that is gone."""
    removed: list[Path] = []
    for d in (Path(run_dir), Path(run_dir) / "checkpoints"):
        try:
            children = list(d.iterdir())
        except OSError:
            continue
        for p in children:
            if not _is_temporary(p.name) or p.is_symlink():
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            if not p.exists():
                removed.append(p)
    return removed


def lock_run_dir(run_dir: Path) -> Any:
    """Take ``run_dir``'s lock (finetune.io.lock_dir) for this run, or refuse in one line: the
    CLI's guard (before Hydra writes into the dir) and the loop's claim both ask here."""
    try:
        return lock_dir(run_dir)
    except DirBusy:
        raise UserError(f"run dir {run_dir} is in use by another run (it holds the lock on {run_dir / '.lock'}); "
                        "wait for that run to end, or choose another hydra.run.dir") from None
    except OSError as e:
        raise UserError(f"run dir {run_dir}: its lock file cannot be made ({e.strerror or e}); set "
                        "hydra.run.dir= to a writable directory") from None


def take_over(run_dir: Path, lock: Any, clear: bool) -> None:
    """Once every check has passed, the run's results go into ``run_dir``: mark the lock begun
    (this process holds it), remove what killed writers left (``remove_dead_temporaries``)
    and, with ``clear`` (a fresh run under train.overwrite=true), the earlier run's results."""
    if lock is not None:
        lock.begun = True
        gone = remove_dead_temporaries(run_dir)  # a killed writer's, this run holding the lock
        if gone:
            print(f"removed {len(gone)} temporary file(s) a killed run left in {run_dir}: "
                  f"{', '.join(p.name for p in gone)}", file=sys.stderr)
    if clear:
        clear_results(run_dir)  # the earlier run's results (the claim refused them otherwise)


def drop_rank_run_dir(run_dir: Path, created: bool) -> None:
    """Under several ranks, rank 0's run dir is the run's: remove this rank's own ``run_dir``
    when this process ``created`` it or it holds only what Hydra wrote (.hydra/, its log)."""
    if created or all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)


def make_run_dir(run_dir: Path) -> bool:
    """Make ``run_dir`` if needed and check it takes a file; return whether this call made it
    (a run dir this process made is removed again if the run fails on a bad input before
    writing anything a user could take for a result: ``remove_if_no_result``)."""
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"run dir {run_dir} cannot be created or written ({e.strerror or e}); "
                        "set hydra.run.dir= to a writable directory") from None
    return created


def check_claim(run_dir: Path, resume: bool, overwrite: bool, steps: int) -> None:
    """UserError unless a resume finds a checkpoint in ``run_dir`` with steps left to train
    (``steps``: train.steps) and a new run lands on no other run's checkpoints or result
    (``overwrite``: the run replaces them once it begins)."""
    d = run_dir
    if resume and not list_checkpoints(d):
        raise UserError(f"train.resume=true but {d}/checkpoints holds no checkpoint; point hydra.run.dir "
                        "at the run to continue, or set train.save_every")
    if resume:
        check_steps_left(d, steps)
    held = [] if resume or overwrite else results_in(d)
    if held:
        again = "continue it with train.resume=true, " if list_checkpoints(d) else ""
        raise UserError(f"run dir {d} holds another run ({', '.join(held)}); {again}choose a new "
                        "hydra.run.dir, or replace it with train.overwrite=true")


def finished_at(run_dir: Path) -> int | None:
    """The step the run in ``run_dir`` finished at: its summary.json's ``steps`` when its newest
    checkpoint is of that step (a run that ended wrote both); None for a run that has not
    finished (stopped, killed, or its adapter not written: a resume then writes it)."""
    ckpt = latest_checkpoint(run_dir)
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        done = int(summary["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if ckpt is None or _step_of(ckpt) != done:
        return None
    return done


def _step_of(ckpt: Path) -> int:
    m = _NAME.fullmatch(ckpt.name)
    return int(m.group(1)) if m else -1


def check_steps_left(run_dir: Path, steps: int) -> None:
    """UserError, before anything loads or is written, when a resume would train no step: the
    run finished at ``train.steps`` (a resume would only write its adapter, checkpoint and
    summary again, over the ones it has), or its newest checkpoint is past ``train.steps``."""
    ckpt = latest_checkpoint(run_dir)
    at = _step_of(ckpt) if ckpt is not None else -1
    done = finished_at(run_dir)
    if done is not None and done >= steps:
        raise UserError(f"run finished at step {done} (run dir {run_dir}); raise train.steps above {done} to "
                        f"continue it (train.resume=true train.steps={2 * done}), or choose a new hydra.run.dir")
    if at > steps:
        raise UserError(f"train.steps={steps} but the newest checkpoint of run dir {run_dir} is at step {at}; "
                        f"raise train.steps to {at} or more to continue it, or choose a new hydra.run.dir")


def remove_if_no_result(run_dir: Path, created: bool) -> None:
    """After a bad input: remove the run dir this process ``created`` when it holds no result
    (summary.json, adapter/, a checkpoint, a non-empty metrics.jsonl: a run that trained or
    adapted before it stopped keeps its record), so nothing half-made looks like a run."""
    d = run_dir
    if not created or not d.is_dir():
        return
    if results_in(d):
        return
    m = d / "metrics.jsonl"
    if m.is_file() and m.stat().st_size > 0:  # steps ran or the governor acted: the record of why it stopped
        return
    shutil.rmtree(d, ignore_errors=True)
