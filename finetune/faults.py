"""Test-only faults, each switched on by an environment variable and inert without it.

They stand in for what a test cannot cause on cue: an allocation failure that kills the
process, a full disk inside one particular write, a process stopped half-way through a
checkpoint, a leak. The loop calls them at the places those faults strike; nothing else does.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import Any

_LEAKED: list[Any] = []


def abort_at(step: int, micro: int) -> None:
    """Test-only stand-in for an allocation failure that kills the process (MLX on Metal
    aborts; nothing can catch it): FINETUNE_FAULT_ABORT=STEP:MICRO aborts at optimizer step
    STEP while the micro-batch is above MICRO. Used to test memory.supervise on any machine."""
    spec = os.environ.get("FINETUNE_FAULT_ABORT")
    if spec:
        at, above = (int(x) for x in spec.split(":"))
        if step >= at and micro > above:
            print(f"fault injection: abort at step {step} (micro-batch {micro} > {above})", file=sys.stderr)
            sys.stderr.flush()
            os.abort()


def in_save(step: int, signalled: bool) -> None:
    """Faults inside a checkpoint write (after the tensors, before the state file):
    FINETUNE_FAULT_SAVE=STEP[,STEP...] raises OSError(ENOSPC) at those steps, as a full disk
    would (root ignores a read-only directory's mode, so tests cannot rely on one);
    FINETUNE_FAULT_SAVE_PAUSE=FILE, on a save a signal asked for (``signalled``), creates FILE
    and waits, so a test can send the second signal (or SIGKILL) while the checkpoint is
    half-written."""
    spec = os.environ.get("FINETUNE_FAULT_SAVE")
    if spec and str(step) in spec.split(","):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    marker = os.environ.get("FINETUNE_FAULT_SAVE_PAUSE")
    if marker and signalled:
        Path(marker).write_text(str(step))
        for _ in range(6000):  # at most 60 s: the second signal ends it long before
            time.sleep(0.01)


def in_write(what: str) -> None:
    """FINETUNE_FAULT_WRITE=NAME[,NAME...] raises OSError(ENOSPC) at the write of each named
    result (``adapter``, ``summary``), as a full disk there would."""
    spec = os.environ.get("FINETUNE_FAULT_WRITE")
    if spec and what in spec.split(","):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def pause_after(step: int) -> None:
    """FINETUNE_FAULT_PAUSE_AFTER=STEP:FILE: once step STEP (and each step after it) is logged
    and its checkpoint saved, write the step into FILE and wait until the test deletes it (at
    most 120 s), so the test can fill the disk between two of the run's writes."""
    spec = os.environ.get("FINETUNE_FAULT_PAUSE_AFTER")
    if not spec:
        return
    at, _, marker = spec.partition(":")
    if step < int(at):
        return
    Path(marker).write_text(str(step))
    deadline = time.monotonic() + 120
    while Path(marker).exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def leak() -> None:
    """Planted leak for benchmarks/soak.py: FINETUNE_FAULT_LEAK_BYTES=N keeps an N-byte array
    alive per optimizer step (never freed), which the soak must flag."""
    n = int(os.environ.get("FINETUNE_FAULT_LEAK_BYTES") or 0)
    if n > 0:
        import numpy as np

        _LEAKED.append(np.ones(n, np.uint8))  # ones, not zeros: the pages are touched, so they count in RSS
