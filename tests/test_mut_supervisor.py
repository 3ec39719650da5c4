"""memory.supervise=true: the child's run directory found in its arguments, and a restart
that cannot be recorded (metrics.jsonl unwritable) stops with exit 2 and a line saying how to
resume."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from finetune.run.supervisor import argv_value, supervise


def test_argv_value_finds_the_first_key_equals_value() -> None:
    argv = ["mode=train", "hydra.run.dir=/runs/a=b", "hydra.run.dir=/runs/second", "hydra.run=x"]
    assert argv_value(argv, "hydra.run.dir") == "/runs/a=b"
    assert argv_value(argv, "hydra.run") == "x"
    assert argv_value(argv, "train.steps") is None


def test_a_restart_that_cannot_be_recorded_stops_with_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("train:\n  batch_size: 8\n  grad_accum: 1\n")
    (run / "metrics.jsonl").mkdir()  # a path that cannot be written as a file
    # the child: a process that dies as MLX's Metal allocation failure does (SIGABRT: exit 134)
    child = tmp_path / "aborts"
    child.write_text("#!/bin/sh\nexit 134\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    assert supervise(["mode=train", f"hydra.run.dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the run died (exit 134) and its restart cannot be recorded in {run / 'metrics.jsonl'} ")
    assert err.rstrip().endswith(f"free space, then rerun with train.resume=true hydra.run.dir={run}")
