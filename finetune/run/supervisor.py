"""``memory.supervise=true``: run the job in a child process and restart it when it dies.

MLX aborts the process on a Metal allocation failure; nothing inside the process can catch
it. The supervisor sees the child die by a signal or an abort (exit 134), restarts it from
its last checkpoint (``train.save_every``) with half the micro-batch and twice the
accumulation, so the effective batch, the samples and their order stay the same, and
records the restart as an event in the run's metrics.jsonl (through the run log, which hands
it to the resumed child's loggers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from finetune.run.files import latest_state
from finetune.run.governor import smaller_divisor
from finetune.run.log import append_event

MAX_RESTARTS = 3
ABORT = 134  # 128 + SIGABRT, as a shell reports an abort


def argv_value(argv: list[str], key: str) -> str | None:
    """The value of the first ``key=value`` in ``argv``, or None."""
    for a in argv:
        if a.startswith(key + "="):
            return a.split("=", 1)[1]
    return None


def restart_event(run_dir: str | Path, rc: int) -> tuple[dict[str, Any], bool] | None:
    """The restart after a child died with exit ``rc``: the event to record and whether a
    checkpoint is there to resume from; None when the micro-batch is already 1."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(run_dir, ".hydra", "config.yaml"))
    eff = int(cfg.train.batch_size) * int(cfg.train.grad_accum)
    micro, step = int(cfg.train.batch_size), 0
    latest = latest_state(run_dir)
    if latest is not None:
        state = latest[1]
        micro, step = min(micro, int(state["micro_batch"])), int(state["step"])
    new = smaller_divisor(eff, micro)
    if new is None:
        return None
    return {"step": step, "trigger": "process_died", "action": "restart_lower_micro_batch",
            "before": {"batch_size": micro, "grad_accum": eff // micro, "exit": rc},
            "after": {"batch_size": new, "grad_accum": eff // new, "resume_from_step": step}}, latest is not None


def supervise(argv: list[str]) -> int:
    """Run ``finetune ARGV`` in a child; restart it after an uncatchable death (see the module
    docstring), at most MAX_RESTARTS times. Returns the exit code for the caller."""
    run_dir = argv_value(argv, "hydra.run.dir") or time.strftime("outputs/%Y-%m-%d/%H-%M-%S_supervised")
    args = [a for a in argv if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "FINETUNE_SUPERVISED": "1"}
    for restart in range(MAX_RESTARTS + 1):
        rc = subprocess.call([sys.executable, "-m", "finetune.cli", *args], env=env)
        if rc >= 0 and rc != ABORT:  # finished, or an ordinary error the child already reported
            return rc
        if restart == MAX_RESTARTS or not Path(run_dir, ".hydra", "config.yaml").is_file():
            print(f"error: the run died (exit {rc}) and supervision gave up; see {run_dir}", file=sys.stderr)
            return 1
        restart_with = restart_event(run_dir, rc)
        if restart_with is None:
            print(f"error: the run died (exit {rc}) at micro-batch 1; it does not fit: try finetune mode=plan",
                  file=sys.stderr)
            return 1
        event, resume = restart_with
        try:
            append_event(run_dir, event)
        except OSError as e:  # metrics.jsonl (RunLogWriteError): the disk is full; a restart would hit it too
            print(f"error: the run died (exit {rc}) and its restart cannot be recorded in {e.filename} "
                  f"({e.strerror or e}); free space, then rerun with train.resume=true hydra.run.dir={run_dir}",
                  file=sys.stderr)
            return 2
        after = event["after"]
        print(f"[supervisor] child died (exit {rc}); restarting from step {event['step']} with micro-batch "
              f"{after['batch_size']}", file=sys.stderr)
        keep = ("train.batch_size=", "train.grad_accum=", "train.resume=")
        args = [a for a in args if not a.startswith(keep)]
        args += [f"train.batch_size={after['batch_size']}", f"train.grad_accum={after['grad_accum']}",
                 f"train.resume={'true' if resume else 'false'}"]
    return 1
