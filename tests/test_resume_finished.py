"""``train.resume=true`` on a run that has no step left to train is refused in one line naming the
fix (raise train.steps), exit 2, its run dir byte-equal; with train.steps raised, it continues
from its newest checkpoint. Through the real `finetune` console script, one tiny run told as a
story: finished at 2, continued towards 4 and killed after step 3 (the test-only abort fault),
refused at train.steps=2, then finished at 4."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from conftest import finetune_cmd, needs_torch
import warm_cli

TRAIN = ("backend=cuda", "train.save_every=1", "train.eval_every=0", "train.progress=false", "data.num_samples=40")


def _finetune(run: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return warm_cli.run([*finetune_cmd(), *TRAIN, *args, f"hydra.run.dir={run}"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def _tree(run: Path) -> dict[str, str]:
    """Every file and directory under ``run`` (hidden ones included): a file's sha256, a
    directory as such, each with its mode."""
    out = {}
    for p in sorted(run.rglob("*")):
        kind = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(run))] = f"{kind} {p.stat().st_mode:o}"
    return out


def _refused(run: Path, steps: int, want: str) -> None:
    before = _tree(run)
    r = _finetune(run, f"train.steps={steps}", "train.resume=true")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [want] and r.stderr.rstrip().endswith(want), r.stderr[-3000:]
    assert _tree(run) == before  # not a byte of the run dir changed, no file came or went


def _steps(run: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()
            if ln.startswith('{"step"')]


@needs_torch
def test_a_finished_run_is_refused_and_a_raised_train_steps_continues(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = _finetune(run, "train.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]

    # finished at 2: train.steps=2 again would train nothing and rewrite its results
    _refused(run, 2, f"error: run finished at step 2 (run dir {run}); raise train.steps above 2 to continue it "
                     "(train.resume=true train.steps=4), or choose a new hydra.run.dir")

    # raised to 4: continues from step 2; killed at the start of step 4 (after step 3's checkpoint)
    r = _finetune(run, "train.steps=4", "train.resume=true", FINETUNE_FAULT_ABORT="4:0")
    assert r.returncode != 0 and "fault injection: abort at step 4" in r.stderr, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_0000002'} at step 2" in r.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002", "step_0000003"]

    # not finished (summary.json still says 2), but its newest checkpoint is past train.steps=2
    _refused(run, 2, f"error: train.steps=2 but the newest checkpoint of run dir {run} is at step 3; raise "
                     "train.steps to 3 or more to continue it, or choose a new hydra.run.dir")

    r = _finetune(run, "train.steps=4", "train.resume=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_0000003'} at step 3" in r.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_run"]) == (4, 1)
    assert _steps(run) == [1, 2, 3, 4]  # each step once: the killed run's lines after step 3 are gone
    assert (run / "checkpoints" / "step_0000004").is_dir() and (run / "adapter").is_dir()
