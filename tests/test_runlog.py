"""The run log (metrics.jsonl, the loggers), checkpoint discovery, the supervisor's restart
decision and the CLI's reading of list overrides: each on files in a temporary run dir, no
training."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from finetune.run import files as checkpoints
from finetune.cli import check_group_choices, group_values
from finetune.errors import UserError
from finetune.io import atomic_dir, atomic_write_json
from finetune.loggers import Logger, scalars, summary_scalars
from finetune.run.log import RunLog, append_event
import warm_cli


def _lines(run: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def _ev(step: int, action: str = "lower_micro_batch") -> dict[str, Any]:
    return {"step": step, "trigger": "oom", "action": action, "before": {"batch_size": 4}, "after": {"batch_size": 2}}


def _rec(step: int, **kw: Any) -> dict[str, Any]:
    return {"step": step, "loss": 1.0 / step, "lr": 1e-3, "grad_norm": None, "tokens_per_sec": 100.0,
            "rss_bytes": 1000 + step, "memory_phase": "optimizer", "system_fresh": True, **kw}


class Recorder(Logger):
    """A logger that keeps what the run log handed it (a user's own logger would subclass the same)."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__({})
        self.calls: list[tuple[str, Any]] = []

    def open(self, run_dir: Path, start_step: int, config: dict[str, Any]) -> None:
        self.calls.append(("open", start_step))

    def log_step(self, rec: dict[str, Any], values: dict[str, float]) -> None:
        self.calls.append(("step", rec["step"], values))

    def log_event(self, ev: dict[str, Any]) -> None:
        self.calls.append(("event", ev["step"], ev["action"]))

    def close(self, status: str) -> None:
        self.calls.append(("close", status))


# ---- metrics.jsonl -------------------------------------------------------------------------

def test_metrics_jsonl_lines_are_the_records_as_json_one_per_line_written_as_they_come(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 9, "loss": 0.1}\n')  # an earlier run's: a fresh start drops it
    rl = RunLog(tmp_path)
    rl.event(_ev(0, "set_limits"))  # before begin: held, then written first
    rl.begin(0)
    rl.step(_rec(1))
    # line-buffered: a reader sees the whole line before the run ends
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps({"event": _ev(0, "set_limits")}) + "\n" + \
        json.dumps(_rec(1)) + "\n"
    rl.event(_ev(2))
    rl.step(_rec(2))
    rl.close()
    assert _lines(tmp_path) == [{"event": _ev(0, "set_limits")}, _rec(1), {"event": _ev(2)}, _rec(2)]


def test_resume_drops_the_abandoned_future_and_hands_the_supervisors_event_to_the_loggers(tmp_path):
    rl = RunLog(tmp_path)
    rl.begin(0)
    for s in range(1, 6):
        if s == 4:
            rl.event(_ev(4))
        rl.step(_rec(s))
    rl.close()
    # the supervisor, between children: the restart from the step-3 checkpoint
    append_event(tmp_path, _ev(3, "restart_lower_micro_batch"))
    rl = RunLog(tmp_path)
    rec = Recorder()
    rl.loggers = [rec]
    rl.event(_ev(0, "set_limits"))  # this process's setup, before begin
    rl.begin(3)
    rl.step(_rec(4))
    rl.close()
    assert _lines(tmp_path) == [_rec(1), _rec(2), _rec(3), {"event": _ev(3, "restart_lower_micro_batch")},
                                {"event": _ev(0, "set_limits")}, _rec(4)]
    assert rec.calls[:3] == [("open", 3), ("event", 3, "restart_lower_micro_batch"), ("event", 0, "set_limits")]
    assert rec.calls[3][:2] == ("step", 4) and rec.calls[-1] == ("close", "finished")


def test_close_before_begin_appends_the_held_events_and_a_failure_closes_loggers_as_failed(tmp_path):
    """A run that stops in setup (nothing fits) still leaves its decisions in metrics.jsonl."""
    rec = Recorder()
    with pytest.raises(UserError), RunLog(tmp_path) as rl:
        rl.loggers = [rec]
        rl.event(_ev(0))
        raise UserError("does not fit")
    assert _lines(tmp_path) == [{"event": _ev(0)}]
    assert rec.calls == [("close", "failed")]  # never opened: the loggers start with the steps
    with pytest.raises(SystemExit), RunLog(tmp_path / "b") as rl:
        rl.loggers = [rec2 := Recorder()]
        rl.begin(0)
        raise SystemExit(143)  # stopped by SIGTERM after its checkpoint
    assert rec2.calls == [("open", 0), ("close", "killed")]


def test_a_logger_failing_mid_run_is_warned_about_once_and_dropped(tmp_path, caplog):
    rl = RunLog(tmp_path, {"csv": {"path": None}})
    rec = Recorder()
    rl.loggers.append(rec)
    rl.begin(0)
    rl.step(_rec(1))
    rl.loggers[0]._file.close()  # the CSV file gone from under it (a full disk, an unmounted share)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        for s in (2, 3, 4):
            rl.step(_rec(s))
    rl.close()
    warnings = [r.getMessage() for r in caplog.records if "logger csv failed" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on" in warnings[0]
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3, 4]  # metrics.jsonl has every step
    assert [c[1] for c in rec.calls if c[0] == "step"] == [1, 2, 3, 4]  # the other loggers too


def test_a_logger_that_cannot_start_is_a_one_line_user_error(tmp_path):
    (tmp_path / "blocked").write_text("a file where the directory should be")
    rl = RunLog(tmp_path, {"csv": {"path": str(tmp_path / "blocked" / "metrics.csv")}})
    with pytest.raises(UserError, match="logger=csv could not start"):
        rl.begin(0)
    rl.close("failed")


def test_scalars_by_tag_leave_out_what_was_not_measured(tmp_path):
    values = scalars(_rec(2, val_loss=0.7, mlx_peak_bytes=None))
    assert values == {"train/loss": 0.5, "train/lr": 1e-3, "train/tokens_per_sec": 100.0, "memory/rss_bytes": 1002,
                      "train/val_loss": 0.7}  # None, strings and booleans are no scalars
    s = {"steps": 3, "final_train_loss": 1.5, "model": "tiny", "memory": {"peaks": {"rss_bytes": 7, "allocated_bytes": None}}}
    assert summary_scalars(s) == {"steps": 3, "final_train_loss": 1.5, "peak/rss_bytes": 7}


# ---- csv -------------------------------------------------------------------------------

def test_csv_widens_its_header_when_a_key_first_appears_and_keeps_rows_up_to_a_resume(tmp_path):
    rl = RunLog(tmp_path, {"csv": {}})
    rl.begin(0)
    rl.step({"step": 1, "loss": 2.0})
    rl.step({"step": 2, "loss": 1.5, "val_loss": 1.7})  # a new column: the file is rewritten once
    rl.step({"step": 3, "loss": 1.2})
    rl.close()
    text = (tmp_path / "metrics.csv").read_text()
    assert text == "step,loss,val_loss\n1,2.0,\n2,1.5,1.7\n3,1.2,\n"
    rl = RunLog(tmp_path, {"csv": {}})
    rl.begin(2)
    rl.step({"step": 3, "loss": 1.25})
    rl.close()
    with (tmp_path / "metrics.csv").open(newline="") as f:
        assert [(r["step"], r["loss"]) for r in csv.DictReader(f)] == [("1", "2.0"), ("2", "1.5"), ("3", "1.25")]


# ---- checkpoints -----------------------------------------------------------------------

def _ckpt(run: Path, step: int) -> Path:
    with atomic_dir(checkpoints.checkpoint_path(run, step)) as tmp:
        atomic_write_json(tmp / checkpoints.STATE_FILE, {"step": step, "micro_batch": 4})
    return checkpoints.checkpoint_path(run, step)


def test_checkpoints_latest_is_by_step_number_and_skips_incomplete_ones(tmp_path):
    assert checkpoints.latest_checkpoint(tmp_path) is None and checkpoints.latest_state(tmp_path) is None
    for s in (2, 10, 4):
        _ckpt(tmp_path, s)
    (tmp_path / "checkpoints" / ".step_0000012.abc.tmp").mkdir()  # atomic_dir's in-flight name
    (tmp_path / "checkpoints" / "step_0000011").mkdir()  # no trainer_state.json: not a checkpoint
    big = tmp_path / "checkpoints" / "step_10000000"  # past 7 digits: still after step 10
    big.mkdir()
    atomic_write_json(big / checkpoints.STATE_FILE, {"step": 10_000_000, "micro_batch": 1})
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == \
        ["step_0000002", "step_0000004", "step_0000010", "step_10000000"]
    path, state = checkpoints.latest_state(tmp_path)
    assert path == big and state["step"] == 10_000_000
    removed = checkpoints.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["step_0000002", "step_0000004"] and not removed[0].exists()
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["step_0000010", "step_10000000"]


# ---- the supervisor's decision ---------------------------------------------------------

def test_supervisor_restarts_from_the_latest_checkpoint_at_a_smaller_micro_batch(tmp_path):
    from omegaconf import OmegaConf

    from finetune.run.supervisor import restart_event

    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create({"train": {"batch_size": 4, "grad_accum": 2}}), tmp_path / ".hydra" / "config.yaml")
    event, resume = restart_event(tmp_path, -6)  # no checkpoint yet: from the start
    assert not resume and event == {"step": 0, "trigger": "process_died", "action": "restart_lower_micro_batch",
                                    "before": {"batch_size": 4, "grad_accum": 2, "exit": -6},
                                    "after": {"batch_size": 2, "grad_accum": 4, "resume_from_step": 0}}
    _ckpt(tmp_path, 6)
    event, resume = restart_event(tmp_path, 134)
    assert resume and event["step"] == 6 and event["after"] == {"batch_size": 2, "grad_accum": 4, "resume_from_step": 6}
    with atomic_dir(checkpoints.checkpoint_path(tmp_path, 8)) as tmp:  # a checkpoint already at micro-batch 1
        atomic_write_json(tmp / checkpoints.STATE_FILE, {"step": 8, "micro_batch": 1})
    assert restart_event(tmp_path, 134) is None


# ---- the CLI reads list overrides ------------------------------------------------------

def test_group_values_read_lists_sweeps_and_leave_sweep_functions_to_hydra():
    assert group_values("tensorboard") == ["tensorboard"]
    assert group_values("[tensorboard,mlflow]") == ["tensorboard", "mlflow"]
    assert group_values("[csv],[csv, wandb]") == ["csv", "csv", "wandb"]
    assert group_values("[]") == [] and group_values("choice(a,b)") == [] and group_values("glob(*)") == []
    check_group_choices(["logger=[tensorboard,mlflow]", "logger=[]", "optim=adamw,sgd", "+logger=[csv]"])
    with pytest.raises(UserError, match="logger=mlfow is not an option; choose one of: csv, jsonl, mlflow"):
        check_group_choices(["logger=[tensorboard,mlfow]"])
    with pytest.raises(UserError, match="optim=adamx is not an option"):
        check_group_choices(["optim=adamw,adamx"])


def test_shell_completion_answers_through_the_cli(tmp_path):
    """`eval "$(finetune -sc install=bash)"` installs a function that asks `finetune -sc
    query=bash` with the typed line in COMP_LINE: our own entry (group check, --help template)
    lets Hydra answer, logger options included."""
    import os
    import sys

    code = "import sys; from finetune.cli import main; sys.argv = ['finetune'] + sys.argv[1:]; main()"
    r = warm_cli.run([sys.executable, "-c", code, "-sc", "install=bash"], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "hydra_bash_completion" in r.stdout, r.stderr[-2000:]
    env = {**os.environ, "COMP_LINE": "finetune logger=", "COMP_POINT": "16"}
    r = warm_cli.run([sys.executable, "-c", code, "-sc", "query=bash"], check=False, capture_output=True, text=True, timeout=60,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(r.stdout.split()) == {f"logger={o}" for o in ("csv", "jsonl", "mlflow", "tensorboard", "wandb")}
