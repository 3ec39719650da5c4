"""The run log: the one place a run's step records and events are written.

The loop hands it one record per optimizer step and every event (the governor's actions
through the loop, the supervisor's restarts); it fans them out to ``metrics.jsonl`` (always),
the progress bar, and the loggers the ``logger`` config group chose (finetune/loggers.py).

metrics.jsonl: one JSON object per line, either a step record ``{"step": N, "loss": ...}``
or an event ``{"event": {"step", "trigger", "action", "before", "after"}}``. An event is
written before the record of the step it happened in. The file is opened once, line-buffered,
so a reader (or a crash) sees whole lines; the per-step cost is one ``json.dumps`` and one
write, plus what the chosen loggers cost.

A logger that fails after it opened is warned about once and dropped; training goes on.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from finetune.io import atomic_write_text

log = logging.getLogger("finetune")

METRICS = "metrics.jsonl"


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
        from finetune import loggers as loggers_mod

        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS
        self.config = config or {}
        self.loggers = loggers_mod.build(loggers)
        self._scalars = loggers_mod.scalars
        self._file: Any = None
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
        if start_step == 0:
            mode = "w"
        else:
            mode = "a"
            if start_step is not None and self.path.exists():
                keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and record_step(ln) <= start_step]
                atomic_write_text(self.path, "".join(k + "\n" for k in keep))
                # events written after the last step the previous process logged (the
                # supervisor's restart) reached no logger yet
                for ln in reversed(keep):
                    if not ln.startswith('{"event"'):
                        break
                    unseen.insert(0, json.loads(ln)["event"])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open(mode, buffering=1)  # line-buffered: whole lines on disk
        self._began = True
        if start_step is not None:
            opened = []
            try:
                for lg in self.loggers:
                    lg.open(self.run_dir, start_step, self.config)
                    opened.append(lg)
            except Exception as e:  # a logger that cannot start is a setup error, said in one line
                from finetune.config import UserError

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
            self.begin(None)
        if self._file is not None:
            self._file.close()
            self._file = None
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
        self._file.write(json.dumps(rec) + "\n")
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
        self._file.write(json.dumps({"event": ev}) + "\n")
        if self._loggers_open:
            self._to_loggers("log_event", ev)

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
    nothing (every rank's memory reaches rank 0 at the end of the run, see finetune/loop.py)."""

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
