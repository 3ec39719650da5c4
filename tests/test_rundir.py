"""One run per directory (issue 20): a run holds an fcntl lock on <run dir>/.lock, a new run
does not land on another run's checkpoints or result, a refused command leaves the directory
byte-for-byte as it was (Hydra's .hydra/ files and log included), and a resume must be the
same run (backend, model, method, seed, data)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import finetune_cmd, make_cfg, make_spec, needs_torch
import warm_cli

from finetune.run import files as checkpoints
from finetune.errors import UserError
from finetune.io import lock_dir
from finetune.run.loop import data_identity, train
from finetune.resolver import resolve

ARGS = ("backend=cuda", "train.schedule=constant", "train.warmup_steps=0", "optim.lr=1e-2", "train.eval_every=0",
        "train.progress=false", "data.num_samples=100", "memory.sample_every=0", "train.save_every=1")


def _hashes(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def _steps(run: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


@pytest.fixture(scope="module")
def two_at_once(tmp_path_factory):
    """Two identical CLI runs started together into one hydra.run.dir."""
    run = tmp_path_factory.mktemp("both") / "run"
    cmd = [*finetune_cmd(), *ARGS, "train.steps=3", f"hydra.run.dir={run}"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    return run, [(p.returncode, e) for p, e in zip(procs, errs)]


@needs_torch
def test_two_runs_at_once_one_is_refused_the_other_whole(two_at_once):
    run, results = two_at_once
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], [(rc, e[-2000:]) for rc, e in results]
    refused = next(e for rc, e in results if rc == 2)
    assert "Traceback" not in refused and refused.count("error:") == 1, refused
    assert refused.strip().splitlines()[-1] == (f"error: run dir {run} is in use by another run (it holds the lock on "
                                                f"{run / '.lock'}); wait for that run to end, or choose another "
                                                "hydra.run.dir"), refused
    assert _steps(run) == [1, 2, 3] and (run / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((run / "summary.json").read_text())["steps_this_run"] == 3
    assert "train.steps=3" in (run / ".hydra" / "overrides.yaml").read_text()


@needs_torch
@pytest.mark.parametrize("extra, says", [
    ((), ("holds another run (summary.json, adapter/, 2 checkpoints); continue it with train.resume=true, choose a "
          "new hydra.run.dir, or replace it with train.overwrite=true")),
    (("train.resume=true", "train.steps=4", "train.seed=1"), "is from another run (seed=0, this run has 1)"),
])
def test_a_refused_command_leaves_a_finished_run_byte_for_byte(two_at_once, extra, says):
    """A new run into a finished run's dir (refused before loading), and a resume of it with
    another seed (refused after loading): one line, exit 2, every file as it was."""
    run, _ = two_at_once
    before = _hashes(run)
    r = warm_cli.run([*finetune_cmd(), *ARGS, "train.steps=3", *extra, f"hydra.run.dir={run}"], check=False,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and says in last, last
    assert _hashes(run) == before


@needs_torch
def test_overwrite_replaces_the_earlier_run(tmp_path):
    run = tmp_path / "run"
    train(resolve(make_cfg(run, *ARGS, "train.steps=3")))
    with pytest.raises(UserError, match="holds another run"):
        train(resolve(make_cfg(run, *ARGS, "train.steps=2")))
    summary = train(resolve(make_cfg(run, *ARGS, "train.steps=2", "train.save_every=0", "train.overwrite=true")))
    assert summary["steps_this_run"] == 2 and _steps(run) == [1, 2]
    assert checkpoints.list_checkpoints(run) == []  # the old run's checkpoints went: nothing to resume into


@needs_torch
def test_a_locked_dir_is_refused_before_loading_and_kill_9_leaves_no_stale_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    code = f"import time; from finetune.io import lock_dir; lock_dir({str(run)!r}); print('held', flush=True); " \
           "time.sleep(300)"
    holder = subprocess.Popen([sys.executable, "-c", code],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(UserError, match=r"is in use by another run"):
            train(resolve(make_cfg(run, *ARGS, "train.steps=1")))
        assert time.monotonic() - t0 < 30  # refused before the model is loaded
    finally:
        holder.kill()  # SIGKILL: the OS drops its lock
        holder.wait()
    lock_dir(run).release()  # free again at once


def test_resume_without_a_checkpoint_is_refused_before_loading(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(UserError, match="holds no checkpoint"):
        train(resolve(make_cfg(run, *ARGS, "train.steps=1", "train.resume=true")))
    assert not run.exists()  # made by this command, removed again


def test_the_data_identity_changes_with_the_file(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    cfg = make_spec(tmp_path / "run", "data=jsonl", f"data.path={data}")
    before = data_identity(cfg.data)
    data.write_text('{"text": "a"}\n{"text": "b"}\n')
    after = data_identity(cfg.data)
    assert before["path"] == after["path"] == str(data.resolve()) and before["size"] != after["size"]
    assert data_identity(make_spec(tmp_path / "run", "data.num_samples=5").data)["num_samples"] == 5
