"""finetune-report's chart and help as a user sees them. Written for survivors of the
mutation run (benchmarks/mutation/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from finetune.report import GIB, main, write_chart

BUDGET_RED = np.array([0xD6, 0x27, 0x28]) / 255  # the budget line's colour (#d62728)


def _job(name: str, peak_gib: float, budget_gib: float | None) -> dict:
    return {"job": name, "status": "ran", "weights_bytes": int(0.5 * GIB), "activations_bytes": int(0.3 * GIB),
            "peak_reserved_bytes": int(peak_gib * GIB), "budget_bytes": int(budget_gib * GIB) if budget_gib else None,
            "peak_rss_bytes": int(2 * GIB), "tokens_per_sec": 100.0}


def _widest_red_run(png: Path) -> int:
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]
    red = np.all(np.abs(img - BUDGET_RED) < 0.06, axis=-1)
    return int(red.sum(axis=1).max())


def test_chart_draws_the_sweeps_one_budget_as_a_line(tmp_path: Path) -> None:
    write_chart([_job("optim=adamw", 1.0, 2.0), _job("optim=sgd", 1.5, 2.0)], tmp_path / "one.png")
    write_chart([_job("optim=adamw", 1.0, 2.0), _job("optim=sgd", 1.5, 3.0)], tmp_path / "two.png")
    write_chart([_job("optim=adamw", 1.0, None), _job("optim=sgd", 1.5, None)], tmp_path / "none.png")
    # one budget shared by the jobs: a red line across the axes (880 px wide at 8 in x 110 dpi)
    assert _widest_red_run(tmp_path / "one.png") > 400
    # two budgets, or none: no line to draw
    assert _widest_red_run(tmp_path / "two.png") < 50
    assert _widest_red_run(tmp_path / "none.png") < 50


def test_help_opens_with_what_the_command_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "finetune-report DIR``: one run or a whole sweep side by side." in capsys.readouterr().out
