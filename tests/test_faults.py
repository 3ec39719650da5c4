"""Faults a run must survive: a checkpoint save that fails (disk full, permission), a damaged
newest checkpoint, a second signal while a checkpoint is being written. Saves fail through a
test-only switch (FINETUNE_FAULT_SAVE=STEP raises ENOSPC inside the write): tests run as root
here, and root writes into a read-only directory regardless of its mode."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from finetune import checkpoints
from finetune.config import UserError
from finetune.loop import train

from conftest import finetune_cmd, make_cfg, needs_torch

ARGS = ("backend=cuda", "train.schedule=constant", "train.warmup_steps=0", "optim.lr=1e-2", "train.eval_every=0",
        "train.progress=false", "data.num_samples=100", "memory.sample_every=0", "train.save_every=1")


def _losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


def _leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-step run: the losses every resumed run must reproduce."""
    d = tmp_path_factory.mktemp("ref") / "run"
    train(make_cfg(d, *ARGS, "train.steps=4"))
    return _losses(d)


@needs_torch
def test_failed_save_keeps_previous_checkpoint_and_resume_uses_it(tmp_path, monkeypatch, capsys, reference):
    run = tmp_path / "run"
    monkeypatch.setenv("FINETUNE_FAULT_SAVE", "3")
    with pytest.raises(UserError, match=r"checkpoint at step 3 not saved \(No space left on device\); the previous "
                                        r"checkpoint step_0000002 is intact; free space or fix permissions"):
        train(make_cfg(run, *ARGS, "train.steps=4"))
    assert [p.name for p in checkpoints.list_checkpoints(run)] == ["step_0000001", "step_0000002"]
    assert _leftovers(run) == [] and not (run / "summary.json").exists()
    monkeypatch.delenv("FINETUNE_FAULT_SAVE")
    resumed = train(make_cfg(run, *ARGS, "train.steps=4", "train.resume=true"))
    assert "resumed from" in capsys.readouterr().err and resumed["steps_this_run"] == 2
    assert _losses(run) == pytest.approx(reference, abs=1e-5)


@needs_torch
def test_failed_save_with_continue_goes_on_and_keep_checkpoints(tmp_path, monkeypatch, reference):
    run = tmp_path / "run"
    monkeypatch.setenv("FINETUNE_FAULT_SAVE", "2")
    summary = train(make_cfg(run, *ARGS, "train.steps=4", "train.on_save_error=continue", "train.keep_checkpoints=1"))
    assert summary["steps_this_run"] == 4 and (run / "summary.json").is_file() and (run / "adapter").is_dir()
    assert [p.name for p in checkpoints.list_checkpoints(run)] == ["step_0000004"]  # keep_checkpoints=1
    events = [json.loads(ln)["event"] for ln in (run / "metrics.jsonl").read_text().splitlines() if '"event"' in ln]
    assert any(ev["trigger"] == "save_error" and ev["step"] == 2 for ev in events)
    assert _losses(run) == pytest.approx(reference, abs=1e-6)


@needs_torch
def test_a_file_where_the_checkpoints_dir_goes_stops_cleanly(tmp_path):
    """A real write failure (no switch): the checkpoints directory cannot be made."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory")
    with pytest.raises(UserError, match=r"checkpoint at step 1 not saved .*no earlier checkpoint exists"):
        train(make_cfg(run, *ARGS, "train.steps=2"))
    assert not (run / "summary.json").exists()


@needs_torch
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, capsys, reference):
    run = tmp_path / "run"
    train(make_cfg(run, *ARGS, "train.steps=3"))  # checkpoints step_2, step_3 (keep 2)
    newest = checkpoints.latest_checkpoint(run)
    assert newest.name == "step_0000003"
    weights = newest / "backend" / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a torn write
    capsys.readouterr()
    resumed = train(make_cfg(run, *ARGS, "train.steps=4", "train.resume=true"))
    err = capsys.readouterr().err
    assert "checkpoint step_0000003 is damaged" in err and "(the previous good checkpoint) at step 2" in err, err
    assert resumed["steps_this_run"] == 2
    assert _losses(run) == pytest.approx(reference, abs=1e-5)
    # every checkpoint damaged: one line, no traceback
    for c in checkpoints.list_checkpoints(run):
        (c / checkpoints.STATE_FILE).write_text("{not json")
    with pytest.raises(UserError, match="every checkpoint in .* is damaged"):
        train(make_cfg(run, *ARGS, "train.steps=5", "train.resume=true"))


@needs_torch
def test_second_sigterm_during_a_save_exits_at_once_keeping_the_last_good_checkpoint(tmp_path):
    """The first SIGTERM asks for a checkpoint; the save pauses half-written (test switch); a
    second SIGTERM then exits 143 at once: the half-written one is gone, the earlier ones are
    intact, and resume continues from the newest of them."""
    run, marker = tmp_path / "run", tmp_path / "saving"
    env = {**__import__("os").environ, "FINETUNE_FAULT_SAVE_PAUSE": str(marker)}
    proc = subprocess.Popen([*finetune_cmd(), *ARGS, "train.steps=100000", f"hydra.run.dir={run}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # guards against a hung child; no timing decides the outcome
        while not (run / "metrics.jsonl").is_file() or len(_losses(run)) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "second SIGTERM: exiting now; the last good checkpoint is kept" in err and "Traceback" not in err, err
    half = int(marker.read_text())  # the step whose save was abandoned half-written
    names = [p.name for p in checkpoints.list_checkpoints(run)]
    # its temporary is gone; a step_<half> listed is the complete one the regular save_every
    # save wrote before the signal save of the same step began
    assert names and _leftovers(run) == [], (names, _leftovers(run))
    assert all(int(n[5:]) <= half for n in names), names
    last = checkpoints.read_state(checkpoints.latest_checkpoint(run))["step"]
    resumed = train(make_cfg(run, *ARGS, f"train.steps={last + 1}", "train.resume=true"))
    assert resumed["steps_this_run"] == 1
