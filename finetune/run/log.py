"""The run log: the one place a run's step records and events are written.

The loop hands it one record per optimizer step and every event (the governor's actions
through the loop, the supervisor's restarts); it fans them out to ``metrics.jsonl`` (always),
the progress bar, and the loggers the ``logger`` config group chose (finetune/loggers.py).

metrics.jsonl: one JSON object per line, either a step record ``{"step": N, "loss": ...}``
or an event ``{"event": {"step", "trigger", "action", "before", "after"}}``. An event is
written before the record of the step it happened in. Each line goes down in one ``os.write``
(no buffer for a crash to lose); a write the disk refuses (ENOSPC, EIO) is cut back off the
file, so no torn line is left, and raises RunLogWriteError, which stops the run the way a
failed checkpoint does. A torn last line left by a power cut is dropped when the run resumes.
The per-step cost is one ``json.dumps`` and one write, plus what the chosen loggers cost.

A logger that fails after it opened is warned about once and dropped; training goes on.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from finetune.io import atomic_write_text
from finetune import loggers as loggers_mod
from finetune.errors import UserError

log = logging.getLogger("finetune")

METRICS = "metrics.jsonl"


class RunLogWriteError(OSError):
    """metrics.jsonl could not be written (the disk is full, an I/O error); ``step`` is the
    step whose record or event was lost."""

    def __init__(self, e: OSError, path: Path, step: int | None):
        super().__init__(e.errno, e.strerror or str(e), str(path))
        self.step = step


def read_lines(path: Path) -> list[str]:
    """metrics.jsonl's whole lines. A last line cut short (a power cut, a full disk before
    this version cut torn lines back) is dropped, saying so in one line on stderr; a damaged
    line before the last is an error naming it (UserError)."""
    raw = path.read_bytes()
    lines = raw.decode("utf-8", errors="replace").splitlines()
    good = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            record_step(ln)
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:
                print(f"{path}: dropped a torn last line ({len(ln.encode())} bytes, a write cut short); the lines "
                      "before it are whole", file=sys.stderr)
                break

            raise UserError(f"{path} line {i + 1} is damaged (not a metrics record); remove that line, then "
                            "resume again") from None
        good.append(ln)
    return good


def record_step(line: str) -> int:
    """The step a metrics.jsonl line belongs to (an event's own step for event lines)."""
    rec = json.loads(line)
    return int(rec["event"]["step"] if "event" in rec else rec["step"])


def append_event(run_dir: str | Path, ev: dict[str, Any]) -> None:
    """Append one event to a run's metrics.jsonl from outside a training process (the
    supervisor, between children). A resumed child hands it to its loggers (RunLog.begin)."""
    with RunLog(run_dir) as rl:
        rl.begin(None)
        rl.event(ev)


class RunLog:
    """Receives a run's step records and events; writes metrics.jsonl, the progress bar and
    the loggers.

    Events that arrive before ``begin`` (the governor's decisions before loading) are kept
    and written once the loop knows whether it starts afresh or resumes.

    Args:
        run_dir: the run directory (metrics.jsonl goes there).
        loggers: the chosen logger settings (``cfg.logger``); their packages are imported
            now, so a missing one stops the run before anything is loaded.
        config: the composed config as a plain dict, for loggers that record it.
    """

    def __init__(self, run_dir: str | Path, loggers: Any = None, config: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS
        self.config = config or {}
        self.loggers = loggers_mod.build(loggers)
        self._scalars = loggers_mod.scalars
        self._fd: int | None = None
        self._size = 0  # bytes of whole lines in metrics.jsonl: a failed write is cut back to it
        self._pending: list[dict[str, Any]] = []
        self._bar: Any = None
        self._began = False
        self._loggers_open = False  # loggers open with the steps; a run stopped in setup never opens them
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    def begin(self, start_step: int | None, *, progress: bool = False, total: int = 0) -> None:
        """Open metrics.jsonl and the loggers.

        Args:
            start_step: 0: a fresh run (metrics.jsonl starts empty); N > 0: resumed after
                step N (lines past N belong to the abandoned future and are dropped); None:
                append as it is (the supervisor's events).
            progress: show a progress bar on stderr, ``total`` steps long.
            total: the run's last step.
        """
        unseen: list[dict[str, Any]] = []
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if start_step == 0:
                flags |= os.O_TRUNC
            elif self.path.exists():
                keep = read_lines(self.path)
                if start_step is not None:  # resumed: the lines after the checkpoint go
                    keep = [ln for ln in keep if record_step(ln) <= start_step]
                    # events written after the last step the previous process logged (the
                    # supervisor's restart) reached no logger yet
                    for ln in reversed(keep):
                        if not ln.startswith('{"event"'):
                            break
                        unseen.insert(0, json.loads(ln)["event"])
                text = "".join(k + "\n" for k in keep).encode()
                raw = self.path.read_bytes()
                if raw.startswith(text):  # the usual case: cut the tail off in place (needs no free space)
                    if len(raw) != len(text):
                        os.truncate(self.path, len(text))
                else:  # an event of the supervisor's after lines that go: rewrite whole
                    atomic_write_text(self.path, text.decode())
            self._fd = os.open(self.path, flags, 0o666)  # as the umask says
            self._size = os.fstat(self._fd).st_size
        except OSError as e:
            raise RunLogWriteError(e, self.path, start_step) from None
        self._began = True
        if start_step is not None:
            opened = []
            try:
                for lg in self.loggers:
                    lg.open(self.run_dir, start_step, self.config)
                    opened.append(lg)
            except Exception as e:  # a logger that cannot start is a setup error, said in one line

                for done in opened:
                    _quiet_close(done, "failed")
                self.loggers = []
                raise UserError(f"logger={lg.name} could not start: {type(e).__name__}: {e}") from e
            self._loggers_open = True
            for ev in unseen:
                self._to_loggers("log_event", ev)
        pending, self._pending = self._pending, []
        for ev in pending:
            self.event(ev)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start_step or 0, desc="train", file=sys.stderr,
                             dynamic_ncols=True, mininterval=0.5)

    def close_progress(self) -> None:
        """Close the progress bar (the steps are done; the end-of-run table follows)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def summary(self, summary: dict[str, Any]) -> None:
        """The run's summary.json content, for loggers that keep a run summary."""
        self._to_loggers("log_summary", summary)

    def close(self, status: str = "finished") -> None:
        """Close the bar, metrics.jsonl and every logger (``status``: finished | failed |
        killed). Events still pending (the run stopped before it began) are appended."""
        if self._closed:
            return
        self._closed = True
        self.close_progress()
        if not self._began and self._pending:
            try:
                self.begin(None)
            except OSError as e:  # the run is already ending on its own error; do not hide it
                log.warning("%d event(s) not written to %s: %s", len(self._pending), self.path, e.strerror or e)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for lg in self.loggers:
            _quiet_close(lg, status)
        self.loggers = []

    def __enter__(self) -> RunLog:  # noqa: PYI034 (no subclasses)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(_status(exc_type))

    # -- the hot path ------------------------------------------------------------------------
    def step(self, rec: dict[str, Any], progress_text: Callable[[], str] | None = None) -> None:
        """One optimizer step's record: a metrics.jsonl line, the bar, each logger."""
        self._append(json.dumps(rec) + "\n", rec.get("step"))
        if self.loggers:
            values = self._scalars(rec)
            for lg in tuple(self.loggers):  # a copy: a failing logger leaves the list
                try:
                    lg.log_step(rec, values)
                except Exception as e:
                    self._drop(lg, e)
        if self._bar is not None:
            tps = rec.get("tokens_per_sec") or 0
            extra = f" | {progress_text()}" if progress_text is not None else ""
            self._bar.set_postfix_str(f"loss {rec['loss']:.4f} | {tps:,.0f} tok/s{extra}", refresh=False)
            self._bar.update(1)

    def event(self, ev: dict[str, Any]) -> None:
        """One event (``step, trigger, action, before, after``)."""
        if not self._began:
            self._pending.append(ev)
            return
        self._append(json.dumps({"event": ev}) + "\n", ev.get("step"))
        if self._loggers_open:
            self._to_loggers("log_event", ev)

    def _append(self, line: str, step: int | None) -> None:
        """One whole line onto metrics.jsonl, or none of it: a write the disk refuses is cut
        back off the file (truncating frees space, so it works on a full disk) and raises
        RunLogWriteError."""
        data = line.encode()
        assert self._fd is not None, "metrics.jsonl is written between begin() and close()"
        try:
            done = os.write(self._fd, data)
            while done < len(data):  # a short write: the disk filled in the middle of the line
                done += os.write(self._fd, data[done:])
        except OSError as e:
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
            raise RunLogWriteError(e, self.path, step) from None
        self._size += len(data)

    def _to_loggers(self, method: str, ev: dict[str, Any]) -> None:
        for lg in tuple(self.loggers):
            try:
                getattr(lg, method)(ev)
            except Exception as e:
                self._drop(lg, e)

    def _drop(self, lg: Any, e: Exception) -> None:
        log.warning("logger %s failed (%s: %s); training goes on without it (metrics.jsonl has every step)",
                    lg.name, type(e).__name__, e)
        if lg in self.loggers:
            self.loggers.remove(lg)
        _quiet_close(lg, "failed")


def _status(exc_type: Any) -> str:
    if exc_type is None:
        return "finished"
    if issubclass(exc_type, (SystemExit, KeyboardInterrupt)):
        return "killed"
    return "failed"


def _quiet_close(lg: Any, status: str) -> None:
    try:
        lg.close(status)
    except Exception as e:  # closing a broken logger must not hide the run's own outcome
        log.warning("logger %s did not close cleanly: %s: %s", lg.name, type(e).__name__, e)


class RankRunLog(RunLog):
    """The run log of a rank other than 0 in a run of several processes: rank 0 writes
    metrics.jsonl, the progress bar and the loggers for all of them, so this one keeps
    nothing (every rank's memory reaches rank 0 at the end of the run, see finetune/run/loop.py)."""

    def __init__(self, run_dir: str | Path):
        super().__init__(run_dir, None, None)

    def begin(self, start_step: int | None, *, progress: bool = False, total: int = 0) -> None:
        self._began = True

    def step(self, rec: dict[str, Any], progress_text: Callable[[], str] | None = None) -> None:
        pass

    def event(self, ev: dict[str, Any]) -> None:
        pass

    def summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self, status: str = "finished") -> None:
        self._closed = True
