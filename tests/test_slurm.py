"""SLURM end to end on a one-node cluster of this machine (scripts/slurm_one_node.sh starts
one; where none answers, these skip): `srun -n 2` runs one finetune run as two ranks without
torchrun (the rendezvous from SLURM's own ids), and Hydra's submitit launcher submits one
SLURM job per sweep point, a job of two tasks being one two-rank run."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, needs_torch
import warm_cli


def _cluster() -> bool:
    if shutil.which("sinfo") is None or shutil.which("srun") is None:
        return False
    r = warm_cli.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0 and ("idle" in r.stdout or "mix" in r.stdout)


pytestmark = needs_torch


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    """Asked when this file's tests run, not when it is collected: where sinfo is installed but
    no controller answers, it retries for ~9 s, which every xdist worker paid while collecting."""
    if not _cluster():
        pytest.skip("no SLURM cluster answers here (bash scripts/slurm_one_node.sh starts a one-node one, as root)")

COMMON = ["backend=cuda", "backend.device=cpu", "model=tiny", "train.steps=3", "train.batch_size=2",
          "train.eval_every=0", "train.progress=false", "train.warmup_steps=1"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
            if ln.startswith('{"step"')]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("slurm") / "one"
    r = warm_cli.run([sys.executable, "-m", "finetune", *COMMON, "train.batch_size=4", f"hydra.run.dir={d}"],
                       capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_srun_two_tasks_is_one_two_rank_run(reference: Path, tmp_path: Path) -> None:
    d = tmp_path / "srun"
    r = warm_cli.run(["srun", "-n", "2", "--cpus-per-task=1", sys.executable, "-m", "finetune", *COMMON,
                        f"hydra.run.dir={d}"], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 ranks (ddp)" in r.stderr and "memory per rank (2 ranks)" in r.stderr
    summary = json.loads((d / "summary.json").read_text())
    assert [x["rank"] for x in summary["ranks"]] == [0, 1]
    assert _losses(d) == pytest.approx(_losses(reference), rel=1e-5)


def test_submitit_launcher_one_job_per_point_and_a_two_task_job(reference: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    launcher = ["hydra/launcher=slurm", "hydra.launcher.partition=debug", "hydra.launcher.gpus_per_node=0",
                "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=10",
                "hydra.launcher.tasks_per_node=2"]
    r = warm_cli.run([sys.executable, "-m", "finetune", "-m", *launcher, *COMMON, "optim=adamw,sgd",
                        f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert [p.name.split("_")[0] for p in jobs] == ["0", "1"]
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["world_size"] == 2 and [x["rank"] for x in summary["ranks"]] == [0, 1]
    adamw = next(j for j in jobs if "optim=adamw" in j.name)
    assert _losses(adamw) == pytest.approx(_losses(reference), rel=1e-5)
    assert (sweep / "sweep_summary.md").is_file()
