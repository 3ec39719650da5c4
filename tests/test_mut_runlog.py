"""metrics.jsonl as the run log writes it: events that come before the run begins, the
supervisor's events between children, and a run log closed by its ``with`` block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.run.log import RunLog, append_event

EV = {"step": 0, "trigger": "budget", "action": "lower_micro_batch", "before": {"batch_size": 8},
      "after": {"batch_size": 4}}


def _lines(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_events_before_begin_are_written_once_the_run_begins(tmp_path: Path) -> None:
    with RunLog(tmp_path) as rl:
        rl.event(EV)  # the governor decided before loading
        assert not (tmp_path / "metrics.jsonl").exists()
        rl.begin(0)
        rl.step({"step": 1, "loss": 2.5})
    assert _lines(tmp_path) == [{"event": EV}, {"step": 1, "loss": 2.5}]


def test_the_supervisors_event_is_one_line_and_no_progress_bar(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with RunLog(tmp_path) as rl:
        rl.begin(0)
        rl.step({"step": 1, "loss": 2.5})
    capsys.readouterr()
    restart = {"step": 1, "trigger": "oom_exit", "action": "restart", "before": {}, "after": {"batch_size": 4}}
    append_event(tmp_path, restart)
    assert _lines(tmp_path) == [{"step": 1, "loss": 2.5}, {"event": restart}]
    assert capsys.readouterr().err == ""


def test_a_torn_last_line_is_dropped_on_resume_and_a_damaged_middle_line_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from finetune.errors import UserError
    from finetune.run.log import read_lines

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n{"step": 3, "lo')
    assert read_lines(p) == ['{"step": 1, "loss": 2.5}', '{"step": 2, "loss": 2.4}']
    assert capsys.readouterr().err == (f"{p}: dropped a torn last line (15 bytes, a write cut short); the lines "
                                       "before it are whole\n")
    p.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo\n{"step": 3, "loss": 2.3}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl line 2 is damaged \(not a metrics record\)"):
        read_lines(p)
