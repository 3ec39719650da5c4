"""A sweep job the plan prunes: the file it leaves and the line it prints, in the units the
line names. Written for survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from finetune.config import compose
from finetune.resolver import resolve
from finetune.sweep import prune_by_plan


def test_pruned_job_names_its_planned_peak_and_the_budget_in_gib(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = compose(tmp_path / "run", "backend=cuda", "memory.budget=2MB")
    rec = prune_by_plan(resolve(cfg), tmp_path / "job")
    assert rec is not None and rec["pruned"] == "plan_over_budget"
    assert json.loads((tmp_path / "job" / "pruned.json").read_text()) == rec
    assert rec["budget_bytes"] == 2_000_000 < rec["planned_peak_bytes"]  # MB: 10**6 bytes
    err = capsys.readouterr().err
    assert (f"[sweep] pruned by plan: peak {rec['planned_peak_bytes'] / 2**30:.2f} GiB > memory.budget 0.00 GiB "
            f"({tmp_path / 'job'})") in err


def test_a_job_that_fits_or_has_no_budget_is_not_pruned(tmp_path: Path) -> None:
    assert prune_by_plan(resolve(compose(tmp_path / "a", "backend=cuda")), tmp_path / "a") is None
    assert prune_by_plan(resolve(compose(tmp_path / "b", "backend=cuda", "memory.budget=64GB")), tmp_path / "b") is None
    assert not (tmp_path / "a" / "pruned.json").exists() and not (tmp_path / "b" / "pruned.json").exists()


@pytest.fixture
def sweep_job(tmp_path: Path):
    """A multirun job's config as Hydra hands it to finetune.cli (its HydraConfig set), with its
    job directory holding the summary.json its child will have written."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from finetune.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="finetune.conf", version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=[
            "backend=cuda", "train.steps=1", f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.job.num=0"],
            return_hydra_config=True)
    GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)
    OmegaConf.set_struct(cfg, False)
    job = tmp_path / "sweep" / "0_train.steps=1"
    job.mkdir(parents=True)
    cfg.run_dir = str(job)
    yield cfg, job
    HydraConfig.instance().cfg = None


def test_a_job_whose_process_finished_returns_its_summary(sweep_job, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from finetune.cli import sweep_job as job_of
    from finetune.sweep import run_job

    cfg, job = sweep_job
    (job / "summary.json").write_text(json.dumps({"tokens_per_sec": 123.0, "final_train_loss": 1.5}))
    # the job's own process (python -m finetune ...): one that trained and exited 0
    child = tmp_path / "finished-job"
    child.write_text("#!/bin/sh\nexit 0\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    assert run_job(replace(job_of(cfg), run=lambda: pytest.fail("an isolated job runs in its own process"))) == {
        "tokens_per_sec": 123.0, "final_train_loss": 1.5}
