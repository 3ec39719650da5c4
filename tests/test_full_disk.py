"""Every write a run makes survives a full disk or a power cut (issue 20).

The disk fills on a real small filesystem (a 4 MiB tmpfs, mountable as root; skipped, saying
why, elsewhere) at a chosen moment: the run pauses between two of its writes through a test-only
switch (FINETUNE_FAULT_PAUSE_AFTER, finetune/run/faults.py) while the test fills the disk. Each
interrupted run then resumes to the losses of an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import fill_disk, finetune_cmd, make_cfg, needs_torch

from finetune.run import files as checkpoints
from finetune.errors import UserError
from finetune.run.loop import train
from finetune.resolver import resolve

ARGS = ("backend=cuda", "train.schedule=constant", "train.warmup_steps=0", "optim.lr=1e-2", "train.eval_every=0",
        "train.progress=false", "data.num_samples=100", "memory.sample_every=0", "train.save_every=1")


def _losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of uninterrupted runs, by number of steps (constant lr: a longer run's first N
    steps are the N-step run's)."""
    d = tmp_path_factory.mktemp("ref") / "run"
    train(resolve(make_cfg(d, *ARGS, "train.steps=24")))
    return _losses(d)


def _fill_when(marker: Path, mnt: Path) -> threading.Thread:
    """In the background: once the run pauses (marker written), fill the disk, let it go on."""
    def go() -> None:
        deadline = time.monotonic() + 300
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        fill_disk(mnt)
        marker.unlink()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@needs_torch
def test_full_disk_at_a_metrics_line_stops_in_one_line_and_resume_continues(small_fs, tmp_path, reference):
    """The run pauses after each step; the test fills the disk at the first pause where the next
    metrics line cannot fit in the slack of metrics.jsonl's last page (tmpfs fills whole pages),
    so that line, not the next checkpoint, is the write that meets the full disk."""
    run, marker = small_fs / "run", tmp_path / "paused"
    env = {**os.environ, "FINETUNE_FAULT_PAUSE_AFTER": f"2:{marker}"}
    proc = subprocess.Popen([*finetune_cmd(), *ARGS, "train.steps=100", "train.keep_checkpoints=3",
                             f"hydra.run.dir={run}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    filler, full_after = None, None
    try:
        deadline = time.monotonic() + 300
        while filler is None:
            while not marker.exists():
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.02)
            metrics = (run / "metrics.jsonl").read_bytes()
            slack = -len(metrics) % os.statvfs(small_fs).f_frsize
            if slack < len(metrics.splitlines()[-1]) - 20:  # step numbers and floats vary a little in length
                full_after = int(marker.read_text())
                filler = fill_disk(small_fs)
            marker.unlink()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    at = full_after + 1
    assert line == (f"error: {run / 'metrics.jsonl'} not written at step {at} (No space left on device); the checkpoint "
                    f"step_{full_after:07d} is intact; free space or fix permissions on {run}, then continue with "
                    f"train.resume=true hydra.run.dir={run}"), line
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n") and len(_losses(run)) == full_after  # the failed line was cut off: no torn line
    filler.unlink()
    if at + 1 > len(reference):
        pytest.skip(f"the disk filled after step {full_after}; the reference has {len(reference)} steps")
    resumed = train(resolve(make_cfg(run, *ARGS, f"train.steps={at + 1}", "train.keep_checkpoints=3", "train.resume=true")))
    assert resumed["steps_this_run"] == 2
    assert _losses(run) == pytest.approx(reference[:at + 1], abs=1e-5)


@needs_torch
def test_a_torn_last_line_is_dropped_on_resume(tmp_path, capsys, reference):
    """A power cut in the middle of a metrics line: resume drops it, says so, and continues."""
    run = tmp_path / "run"
    train(resolve(make_cfg(run, *ARGS, "train.steps=3")))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 6.2')  # the start of step 4's line, cut off
    capsys.readouterr()
    resumed = train(resolve(make_cfg(run, *ARGS, "train.steps=4", "train.resume=true")))
    err = capsys.readouterr().err
    assert f"{run / 'metrics.jsonl'}: dropped a torn last line" in err, err
    assert resumed["steps_this_run"] == 1
    assert _losses(run) == pytest.approx(reference[:4], abs=1e-5)


@needs_torch
def test_sigkill_during_a_checkpoint_save_resumes_to_the_same_losses(tmp_path, reference):
    """SIGTERM asks for a checkpoint, which pauses half-written (FINETUNE_FAULT_SAVE_PAUSE);
    SIGKILL then ends the process. Its lock goes with it, and resume continues from the last
    complete checkpoint to an uninterrupted run's losses."""
    run, marker = tmp_path / "run", tmp_path / "saving"
    env = {**os.environ, "FINETUNE_FAULT_SAVE_PAUSE": str(marker)}
    proc = subprocess.Popen([*finetune_cmd(), *ARGS, "train.steps=100000", f"hydra.run.dir={run}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").is_file() or len(_losses(run)) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.kill()  # SIGKILL, mid-save
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert (run / ".lock").exists()  # the file stays; its lock died with the process
    last = checkpoints.read_state(checkpoints.latest_checkpoint(run))["step"]
    if last + 2 > len(reference):
        pytest.skip(f"the run got to step {last} before the signal; the reference has {len(reference)}")
    resumed = train(resolve(make_cfg(run, *ARGS, f"train.steps={last + 2}", "train.resume=true")))
    assert resumed["steps_this_run"] == 2
    assert _losses(run) == pytest.approx(reference[:last + 2], abs=1e-5)


@needs_torch
def test_an_unwritable_final_adapter_keeps_the_trained_state_and_resume_writes_it(tmp_path, monkeypatch):
    """train.save_every=0: the adapter's write fails (the ENOSPC switch); a checkpoint of the
    trained state is written instead, and train.resume=true then writes the adapter as told."""
    run = tmp_path / "run"
    args = [a for a in ARGS if not a.startswith("train.save_every")]
    monkeypatch.setenv("FINETUNE_FAULT_WRITE", "adapter")
    with pytest.raises(UserError, match=r"adapter not saved to .* \(No space left on device\); the trained state after "
                                        r"step 3 is kept as checkpoints/step_0000003: .* then train.resume=true "
                                        r"hydra.run.dir=.* writes the adapter \(no step is trained again\)"):
        train(resolve(make_cfg(run, *args, "train.steps=3")))
    assert not (run / "adapter").exists() and not (run / "summary.json").exists()
    monkeypatch.delenv("FINETUNE_FAULT_WRITE")
    summary = train(resolve(make_cfg(run, *args, "train.steps=3", "train.resume=true")))
    assert summary["steps_this_run"] == 0 and (run / "adapter" / "adapter_model.safetensors").is_file()
    assert (run / "summary.json").is_file() and len(_losses(run)) == 3


@needs_torch
def test_a_full_disk_at_the_final_adapter_says_what_is_lost(small_fs, tmp_path, monkeypatch):
    """No room for the adapter nor for a checkpoint: the message says the steps are lost
    (and does not send the user to a resume that cannot work)."""
    run, marker = small_fs / "run", tmp_path / "paused"
    args = [a for a in ARGS if not a.startswith("train.save_every")]
    monkeypatch.setenv("FINETUNE_FAULT_PAUSE_AFTER", f"3:{marker}")
    filler = _fill_when(marker, small_fs)
    with pytest.raises(UserError) as e:
        train(resolve(make_cfg(run, *args, "train.steps=3")))
    filler.join()
    msg = str(e.value)
    assert msg.startswith(f"adapter not saved to {run / 'adapter'} (No space left on device), nor a checkpoint of step "
                          "3 (No space left on device): the 3 trained steps are lost (metrics.jsonl keeps their "
                          "losses)"), msg
    assert "resume" not in msg and checkpoints.list_checkpoints(run) == []
    assert [p.name for p in run.iterdir() if p.name.startswith(".") and p.name != ".lock"] == []  # no temporaries


@needs_torch
def test_export_and_report_onto_a_full_disk_fail_in_one_line(small_fs, tmp_path, capsys):
    from finetune import export, report

    run = tmp_path / "run"
    train(resolve(make_cfg(run, *ARGS, "train.steps=1")))
    fill_disk(small_fs)
    capsys.readouterr()
    for argv in (["--to", "mlx", str(run), str(small_fs / "mlx")], ["--merge", str(run), str(small_fs / "merged")]):
        assert export.main(argv) == 2, argv
        err = capsys.readouterr().err  # (transformers' own "Loading weights" bar may come first)
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in err and err.count("error:") == 1, err
        assert last.startswith("error: cannot write ") and "No space left on device" in last, last
        assert not any(p.name != "filler" for p in small_fs.iterdir())  # nothing half-written left
    assert report.main([str(run), "--out", str(small_fs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot write ") and "No space left on device" in err[0], err


@needs_torch
def test_a_full_disk_at_the_summary_keeps_the_adapter_and_says_what_is_missing(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("FINETUNE_FAULT_WRITE", "summary")
    with pytest.raises(UserError) as e:
        train(resolve(make_cfg(run, *ARGS, "train.steps=2")))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"summary.json not written to {run} (No space left on device); the "
                                              f"adapter in {run / 'adapter'} is complete")
    assert (run / "adapter" / "adapter_model.safetensors").is_file() and not (run / "summary.json").exists()
    assert len(_losses(run)) == 2
    assert [p.name for p in run.iterdir() if p.name.startswith(".") and p.name != ".lock"] == []


@needs_torch
def test_a_full_disk_at_memory_png_costs_only_the_chart(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    monkeypatch.setenv("FINETUNE_FAULT_WRITE", "memory.png")
    summary = train(resolve(make_cfg(run, *ARGS, "train.steps=2", "memory.sample_every=1")))
    assert summary["steps_this_run"] == 2 and (run / "summary.json").is_file() and not (run / "memory.png").exists()
    assert any("memory.png not written" in r.getMessage() for r in caplog.records)


@needs_torch
def test_a_killed_writers_temporaries_are_removed_when_the_next_run_begins(tmp_path, capsys):
    """What a kill -9 mid-save leaves (an atomic_dir temporary in checkpoints/, a half-written
    summary's temporary file, a chart's) goes once a run holds the dir and its checks passed; a
    refused command removes nothing."""
    run = tmp_path / "run"
    train(resolve(make_cfg(run, *ARGS, "train.steps=2")))
    left = [run / "checkpoints" / ".step_0000003.abcd1234.tmp", run / ".adapter.x1y2.tmp"]
    for d in left:
        d.mkdir(parents=True)
        (d / "part").write_bytes(b"\0" * 10)
    (run / ".summary.json.q9.tmp").write_text("{")
    (run / ".tmp-zz.png").write_bytes(b"\x89PNG")
    with pytest.raises(UserError):  # refused (a new run onto a finished one): nothing removed
        train(resolve(make_cfg(run, *ARGS, "train.steps=2")))
    assert all(p.exists() for p in left) and (run / ".summary.json.q9.tmp").exists()
    capsys.readouterr()
    train(resolve(make_cfg(run, *ARGS, "train.steps=3", "train.resume=true")))
    assert not any(p.exists() for p in left)
    assert not (run / ".summary.json.q9.tmp").exists() and not (run / ".tmp-zz.png").exists()
    assert "removed 4 temporary file(s) a killed run left" in capsys.readouterr().err


def test_report_reads_past_a_torn_metrics_line(tmp_path, capsys):
    """finetune-report on a run whose metrics.jsonl ends in a torn line (a power cut mid-write):
    the report is written from the lines before it, no traceback."""
    from finetune.report import main as report_main

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"backend": "cuda", "steps": 4, "final_train_loss": 2.0}))
    lines = [json.dumps({"step": i, "loss": 2.0 + i / 10}) for i in range(1, 5)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')
    assert report_main([str(run)]) == 0
    assert (run / "sweep_summary.csv").is_file()
