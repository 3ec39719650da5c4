"""What strikes a run from outside: a signal to stop, and the test-only faults.

``StopOnSignal`` turns SIGTERM/SIGINT into "checkpoint at the end of this step, then exit".
``Faults`` stands in for what a test cannot cause on cue: an allocation failure that kills the
process, a full disk inside one particular write, a process stopped half-way through a
checkpoint, a leak. Each is switched on by an environment variable, read once when the run
starts (``Faults.from_env``), and is inert without it. The loop and the checkpointer call them
at the places those faults strike; nothing else does.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_LEAKED: list[Any] = []  # the planted leak's arrays: module-level, so no run's end frees them


@dataclass(frozen=True)
class Faults:
    """The test-only faults of one run, as its environment switched them on.

    Attributes:
        abort: FINETUNE_FAULT_ABORT=STEP:MICRO, (STEP, MICRO) or None.
        save_steps: FINETUNE_FAULT_SAVE=STEP[,STEP...], as written.
        save_pause: FINETUNE_FAULT_SAVE_PAUSE=FILE, or None.
        write: FINETUNE_FAULT_WRITE=NAME[,NAME...].
        pause_after: FINETUNE_FAULT_PAUSE_AFTER=STEP:FILE, (STEP, FILE) or None.
        leak_bytes: FINETUNE_FAULT_LEAK_BYTES=N (0: none).
        export_pause: FINETUNE_FAULT_EXPORT_PAUSE=FILE, or None (finetune-export --to gguf).
    """

    abort: tuple[int, int] | None = None
    save_steps: frozenset[str] = frozenset()
    save_pause: str | None = None
    write: frozenset[str] = frozenset()
    pause_after: tuple[int, str] | None = None
    leak_bytes: int = 0
    export_pause: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Faults:
        """The faults ``env`` switches on (an empty or unset variable switches nothing)."""
        abort = env.get("FINETUNE_FAULT_ABORT")
        pause = env.get("FINETUNE_FAULT_PAUSE_AFTER")
        at, _, marker = (pause or "").partition(":")
        return cls(abort=tuple(int(x) for x in abort.split(":")) if abort else None,  # type: ignore[arg-type]
                   save_steps=frozenset((env.get("FINETUNE_FAULT_SAVE") or "").split(",")) - {""},
                   save_pause=env.get("FINETUNE_FAULT_SAVE_PAUSE") or None,
                   write=frozenset((env.get("FINETUNE_FAULT_WRITE") or "").split(",")) - {""},
                   pause_after=(int(at), marker) if pause else None,
                   leak_bytes=int(env.get("FINETUNE_FAULT_LEAK_BYTES") or 0),
                   export_pause=env.get("FINETUNE_FAULT_EXPORT_PAUSE") or None)

    def abort_at(self, step: int, micro: int) -> None:
        """Stand-in for an allocation failure that kills the process (MLX on Metal aborts;
        nothing can catch it): abort at optimizer step STEP and after while the micro-batch is
        above MICRO. Used to test memory.supervise on any machine."""
        if self.abort is not None:
            at, above = self.abort
            if step >= at and micro > above:
                print(f"fault injection: abort at step {step} (micro-batch {micro} > {above})", file=sys.stderr)
                sys.stderr.flush()
                os.abort()

    def in_save(self, step: int, signalled: bool) -> None:
        """Faults inside a checkpoint write (after the tensors, before the state file): at a
        step of ``save_steps`` raise OSError(ENOSPC), as a full disk would (root ignores a
        read-only directory's mode, so tests cannot rely on one); with ``save_pause``, on a
        save a signal asked for (``signalled``), create that file and wait, so a test can send
        the second signal (or SIGKILL) while the checkpoint is half-written."""
        if str(step) in self.save_steps:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.save_pause and signalled:
            Path(self.save_pause).write_text(str(step))
            for _ in range(6000):  # at most 60 s: the second signal ends it long before
                time.sleep(0.01)

    def in_write(self, what: str) -> None:
        """Raise OSError(ENOSPC) at the write of each result named in ``write`` (``adapter``,
        ``summary``, ``memory.png``), as a full disk there would."""
        if what in self.write:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def pause_at(self, step: int) -> None:
        """Once step STEP of ``pause_after`` (and each step after it) is logged and its
        checkpoint saved, write the step into FILE and wait until the test deletes it (at most
        120 s), so the test can fill the disk between two of the run's writes."""
        if self.pause_after is None or step < self.pause_after[0]:
            return
        marker = Path(self.pause_after[1])
        marker.write_text(str(step))
        deadline = time.monotonic() + 120
        while marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def pause_in_export(self) -> None:
        """With ``export_pause``: once a GGUF export has passed its disk check and written its
        header (its tensors not yet), create FILE and wait until the test deletes it (at most
        120 s), so the test can fill the disk in the middle of the write."""
        if self.export_pause is None:
            return
        marker = Path(self.export_pause)
        marker.write_text("header written")
        deadline = time.monotonic() + 120
        while marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def leak(self) -> None:
        """Planted leak for benchmarks/soak.py: keep a ``leak_bytes`` array alive per optimizer
        step (never freed), which the soak must flag."""
        if self.leak_bytes > 0:
            import numpy as np

            # ones, not zeros: the pages are touched, so they count in RSS
            _LEAKED.append(np.ones(self.leak_bytes, np.uint8))


class StopOnSignal:
    """SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C): finish the step in flight,
    checkpoint, exit 128 + the signal's number (143, 130), as a shell reports a signal.

    A second signal (either) exits at once: KeyboardInterrupt (130) for SIGINT, SystemExit
    (143) for SIGTERM, raised wherever the process is, so a checkpoint being written is
    abandoned under its temporary name and the last good one stays as it was. A signal the
    process was started ignoring (SIGINT in a background job) stays ignored.
    """

    def __init__(self) -> None:
        import signal
        import threading

        self.requested: str | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handler)

    @property
    def exit_code(self) -> int:
        import signal

        return 128 + int(signal.Signals[self.requested or "SIGTERM"])

    def close(self) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def _handler(self, signum: int, frame: Any) -> None:
        import signal

        name = signal.Signals(signum).name
        if self.requested is not None:
            print(f"second {name}: exiting now; the last good checkpoint is kept", file=sys.stderr)
            self.close()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.requested = name
