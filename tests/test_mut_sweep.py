"""A sweep job the plan prunes: the file it leaves and the line it prints, in the units the
line names. Written for survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.config import compose
from finetune.sweep import prune_by_plan


def test_pruned_job_names_its_planned_peak_and_the_budget_in_gib(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = compose(tmp_path / "run", "backend=cuda", "memory.budget=2MB")
    rec = prune_by_plan(cfg, tmp_path / "job")
    assert rec is not None and rec["pruned"] == "plan_over_budget"
    assert json.loads((tmp_path / "job" / "pruned.json").read_text()) == rec
    assert rec["budget_bytes"] == 2_000_000 < rec["planned_peak_bytes"]  # MB: 10**6 bytes
    err = capsys.readouterr().err
    assert (f"[sweep] pruned by plan: peak {rec['planned_peak_bytes'] / 2**30:.2f} GiB > memory.budget 0.00 GiB "
            f"({tmp_path / 'job'})") in err


def test_a_job_that_fits_or_has_no_budget_is_not_pruned(tmp_path: Path) -> None:
    assert prune_by_plan(compose(tmp_path / "a", "backend=cuda"), tmp_path / "a") is None
    assert prune_by_plan(compose(tmp_path / "b", "backend=cuda", "memory.budget=64GB"), tmp_path / "b") is None
    assert not (tmp_path / "a" / "pruned.json").exists() and not (tmp_path / "b" / "pruned.json").exists()
