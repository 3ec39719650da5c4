"""Faults a run must survive: a checkpoint save that fails (disk full, permission), a damaged
newest checkpoint, a second signal while a checkpoint is being written. Most saves fail through
a test-only switch (FINETUNE_FAULT_SAVE=STEP raises ENOSPC inside the write): tests run as root
here, and root writes into a read-only directory regardless of its mode. One fills a real small
filesystem (a tmpfs, else a loop-mounted ext4 image, where this user may mount one) under the
run's checkpoints/: the libraries' own writers meet a real ENOSPC from the kernel."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import finetune_cmd, make_cfg, needs_torch
import warm_cli

from finetune.run import files as checkpoints
from finetune.errors import UserError
from finetune.run.loop import train
from finetune.resolver import resolve

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
    train(resolve(make_cfg(d, *ARGS, "train.steps=4")))
    return _losses(d)


@needs_torch
def test_failed_save_keeps_previous_checkpoint_and_resume_uses_it(tmp_path, monkeypatch, capsys, reference):
    run = tmp_path / "run"
    monkeypatch.setenv("FINETUNE_FAULT_SAVE", "3")
    with pytest.raises(UserError, match=r"checkpoint at step 3 not saved \(No space left on device\); the previous "
                                        r"checkpoint step_0000002 is intact; free space or fix permissions"):
        train(resolve(make_cfg(run, *ARGS, "train.steps=4")))
    assert [p.name for p in checkpoints.list_checkpoints(run)] == ["step_0000001", "step_0000002"]
    assert _leftovers(run) == [] and not (run / "summary.json").exists()
    monkeypatch.delenv("FINETUNE_FAULT_SAVE")
    resumed = train(resolve(make_cfg(run, *ARGS, "train.steps=4", "train.resume=true")))
    assert "resumed from" in capsys.readouterr().err and resumed["steps_this_run"] == 2
    assert _losses(run) == pytest.approx(reference, abs=1e-5)


@needs_torch
def test_failed_save_with_continue_goes_on_and_keep_checkpoints(tmp_path, monkeypatch, reference):
    run = tmp_path / "run"
    monkeypatch.setenv("FINETUNE_FAULT_SAVE", "2")
    summary = train(resolve(make_cfg(run, *ARGS, "train.steps=4", "train.on_save_error=continue", "train.keep_checkpoints=1")))
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
        train(resolve(make_cfg(run, *ARGS, "train.steps=2")))
    assert not (run / "summary.json").exists()


@needs_torch
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, capsys, reference):
    run = tmp_path / "run"
    train(resolve(make_cfg(run, *ARGS, "train.steps=3")))  # checkpoints step_2, step_3 (keep 2)
    newest = checkpoints.latest_checkpoint(run)
    assert newest.name == "step_0000003"
    weights = newest / "backend" / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a torn write
    capsys.readouterr()
    resumed = train(resolve(make_cfg(run, *ARGS, "train.steps=4", "train.resume=true")))
    err = capsys.readouterr().err
    assert "checkpoint step_0000003 is damaged" in err and "(the previous good checkpoint) at step 2" in err, err
    assert resumed["steps_this_run"] == 2
    assert _losses(run) == pytest.approx(reference, abs=1e-5)
    # every checkpoint damaged: one line, no traceback
    for c in checkpoints.list_checkpoints(run):
        (c / checkpoints.STATE_FILE).write_text("{not json")
    with pytest.raises(UserError, match="every checkpoint in .* is damaged"):
        train(resolve(make_cfg(run, *ARGS, "train.steps=5", "train.resume=true")))


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
    resumed = train(resolve(make_cfg(run, *ARGS, f"train.steps={last + 1}", "train.resume=true")))
    assert resumed["steps_this_run"] == 1


# ---- a real full disk ---------------------------------------------------------------------------
def _mount_small_fs(where: Path, work: Path) -> tuple[str | None, list[str]]:
    """Mount a 2 MiB filesystem on ``where``: a tmpfs, else an ext4 image on a loop device.
    Returns (what was mounted or None, why each way failed)."""
    tried = []
    if sys.platform != "linux" or shutil.which("mount") is None:
        return None, ["mount: not a Linux host with mount(8)"]
    r = warm_cli.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(where)], check=False,
                       capture_output=True, text=True)
    if r.returncode == 0:
        return "tmpfs", tried
    tried.append(f"tmpfs: {(r.stderr.strip() or f'exit {r.returncode}').splitlines()[-1]}")
    img = work / "small.ext4"
    with open(img, "wb") as f:
        f.truncate(2 * 2**20)
    r = warm_cli.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", str(img)], check=False,
                       capture_output=True, text=True)  # -m 0: no blocks reserved for root (who may use them)
    if r.returncode == 0:
        r = warm_cli.run(["mount", "-o", "loop", str(img), str(where)], check=False, capture_output=True, text=True)
        if r.returncode == 0:
            return "ext4 on a loop device", tried
    tried.append(f"loop ext4: {(r.stderr.strip() or f'exit {r.returncode}').splitlines()[-1]}")
    return None, tried


def _checkpoint_bytes(ckpt: Path, block: int) -> int:
    """What one checkpoint takes on a filesystem of ``block``-byte blocks: each file rounded up
    to whole blocks, plus a block per directory (tmpfs gives directories none: slack)."""
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    dirs = [p for p in ckpt.rglob("*") if p.is_dir()] + [ckpt]
    return sum(-(-p.stat().st_size // block) * block for p in files) + block * len(dirs)


@pytest.fixture(scope="module")
def full_disk_run(tmp_path_factory):
    """A CPU run (4 steps, a checkpoint each, keep 3) whose checkpoints/ is a small real
    filesystem left with room for two checkpoints and a half: the third save meets ENOSPC.
    Yields (the finished CLI process, the run dir, the filler file to delete to free space)."""
    work = tmp_path_factory.mktemp("full-disk")
    sizing = work / "sizing"
    train(resolve(make_cfg(sizing, *ARGS, "train.steps=1")))  # one checkpoint, to size the filesystem by
    run = work / "run"
    ckdir = run / "checkpoints"
    ckdir.mkdir(parents=True)
    how, tried = _mount_small_fs(ckdir, work)
    if how is None:
        pytest.skip("no small filesystem can be made here (" + "; ".join(tried) + "); the ENOSPC switch "
                    "(FINETUNE_FAULT_SAVE) covers the save path")
    try:
        st = os.statvfs(ckdir)
        one = _checkpoint_bytes(checkpoints.latest_checkpoint(sizing), st.f_frsize)
        filler = ckdir / ".filler"
        room = st.f_bavail * st.f_frsize - (2 * one + one // 2)
        assert room > 0, (st.f_bavail * st.f_frsize, one)
        with open(filler, "wb") as f:
            f.write(b"\0" * room)  # zeros written, not a sparse hole: the blocks are taken
            f.flush()
            os.fsync(f.fileno())
        proc = warm_cli.run([*finetune_cmd(), *ARGS, "train.steps=4", "train.keep_checkpoints=3",
                               f"hydra.run.dir={run}"], check=False, capture_output=True, text=True, timeout=600)
        yield proc, run, filler, how
    finally:
        warm_cli.run(["umount", "-l", str(ckdir)], check=False, capture_output=True)


@needs_torch
def test_a_real_full_disk_keeps_the_previous_checkpoint_and_resume_continues(full_disk_run, reference):
    """The kernel's ENOSPC in the middle of the third checkpoint: the two before it are intact,
    nothing half-written is left, no result is claimed; with space freed, train.resume=true
    continues from step 2 to the losses of an uninterrupted run."""
    proc, run, filler, how = full_disk_run
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert [p.name for p in checkpoints.list_checkpoints(run)] == ["step_0000001", "step_0000002"], how
    assert _leftovers(run) == [".filler"] and not (run / "summary.json").exists()
    assert checkpoints.read_state(checkpoints.latest_checkpoint(run))["step"] == 2
    filler.unlink()  # space freed
    resumed = train(resolve(make_cfg(run, *ARGS, "train.steps=4", "train.keep_checkpoints=3", "train.resume=true")))
    assert resumed["steps_this_run"] == 2
    assert [p.name for p in checkpoints.list_checkpoints(run)] == ["step_0000002", "step_0000003", "step_0000004"]
    assert _losses(run) == pytest.approx(reference, abs=1e-5)


@needs_torch
def test_a_real_full_disk_stops_with_one_line_naming_the_fix(full_disk_run):
    proc, run, _, _ = full_disk_run
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: checkpoint at step 3 not saved (No space left on device); the previous checkpoint "
                           "step_0000002 is intact; free space or fix permissions"), line
    assert f"train.resume=true hydra.run.dir={run}" in line, line
