"""The planner's verdicts on their edges: a budget exactly the planned peak fits (one byte
less does not). Written for survivors of the
mutation run (benchmarks/mutation/)."""

from __future__ import annotations

from pathlib import Path

from finetune.config import compose
from finetune.planner import plan
from finetune.planner.fit import fit_to_budget


def test_a_budget_equal_to_the_planned_peak_fits(tmp_path: Path) -> None:
    cfg = compose(tmp_path / "run", "backend=cuda", "train.batch_size=4", "train.grad_accum=1")
    peak = plan(cfg, recommend=False)["max_device_peak_bytes"]
    exact = fit_to_budget(cfg, peak)
    assert (exact.fits, exact.batch_size, exact.grad_accum, exact.events) == (True, 4, 1, [])
    below = fit_to_budget(cfg, peak - 1)
    assert below.fits and below.events, "one byte under the peak must change the run"
    assert below.batch_size * below.grad_accum == 4



def test_the_plan_table_prints_gib_of_2_30_bytes(tmp_path: Path) -> None:
    from finetune.planner import format_table

    p = plan(compose(tmp_path / "run", "backend=cuda", "memory.budget=2GiB"), recommend=False)
    text = format_table(p)
    head = text.splitlines()[0]
    assert f"peak {p['max_device_peak_bytes'] / 2**30:.2f} GiB per device vs budget 2.00 GiB" in head
    w = p["bytes"]["weights"]
    assert f"  {'weights':32s}{w / 2**30:9.3f} {w:16,d}" in text.splitlines()


def test_a_cuda_plan_without_a_budget_asks_for_one_per_gpu(tmp_path: Path) -> None:
    from finetune.planner import format_table

    p = plan(compose(tmp_path / "run", "backend=cuda", "backend.device=cuda"), recommend=False)
    if p.get("budget_bytes") is not None:
        import pytest

        pytest.skip("a CUDA device is visible: the plan has the device's size as its budget")
    assert ("  fits is unknown: no CUDA device is visible here; set memory.budget (bytes per GPU), "
            "e.g. memory.budget=48GiB") in format_table(p).splitlines()


def test_a_two_rank_plan_prints_both_ranks(tmp_path: Path) -> None:
    from finetune.planner import format_table

    p = plan(compose(tmp_path / "run", "backend=cuda", "backend.num_devices=2", "memory.budget=8GiB"),
             recommend=False)
    rows = [ln.split()[:2] for ln in format_table(p).splitlines() if ln.startswith("    rank")]
    assert rows == [["rank", "0"], ["rank", "1"]]
    assert "the same as rank 0" not in format_table(p)
