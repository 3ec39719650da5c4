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

