"""finetune-report: runs side by side, in an order that does not depend on finishing order."""

from __future__ import annotations

import csv

from conftest import needs_torch

from finetune.run.loop import train
from finetune.report import main
from finetune.resolver import resolve


@needs_torch
def test_report_puts_runs_side_by_side(cfg_factory, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for name, optim in (("1_optim=adamw_8bit", "adamw_8bit"), ("0_optim=adamw", "adamw")):  # finish out of order
        train(resolve(cfg_factory("backend=cuda", f"optim={optim}", "method=full", "train.steps=3", "train.eval_every=0",
                          "train.progress=false", "data.num_samples=100", run_dir=sweep / name)))
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(ln for ln in out if ln.startswith("job "))
    assert head.split()[:2] == ["job", "optim"]  # what the jobs share is on a line below the table
    assert any(ln.startswith("same in every job: status ran; backend cuda; method full;") for ln in out)
    # without Hydra's overrides.yaml (runs trained by hand) a job is named by its directory
    assert [ln.split()[0] for ln in out if ln[:2] in ("0_", "1_")] == ["0_optim=adamw", "1_optim=adamw_8bit"]
    assert all(len(ln) <= 120 for ln in out)
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [r["optim"] for r in rows] == ["adamw", "adamw_8bit"]
    assert all(int(r["params_trainable"]) == 107072 for r in rows)
    assert rows[0]["peak_rss_bytes"].isdigit() and rows[0]["peak_allocated_bytes"] == ""  # no allocator on CPU
    assert (sweep / "sweep_summary.md").is_file() and (sweep / "sweep_memory.png").is_file()


def test_report_on_a_dir_without_runs_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no summary.json under") and err.count("\n") == 1


def test_console_table_of_twelve_jobs_and_a_pruned_trial_fits_its_width():
    """A recorded 12-job sweep (tests/data/timelines/sweep12.json) and a trial pruned by plan: every
    line within the width, a pruned trial's planned peak (what its plan judged against the budget)
    in a column of its own, not under the step-1 plan check; a narrower width drops the lowest
    ranked columns and names them."""
    import json
    from pathlib import Path

    from finetune.report import table

    rs = json.loads((Path(__file__).parent / "data" / "timelines" / "sweep12.json").read_text())["rows"]
    rs.append({"job": "optim=adamw train.batch_size=64", "status": "pruned (plan)", "backend": "cuda",
               "method": "lora", "optim": "adamw", "precision": "auto", "micro_batch": 64,
               "planned_fit_bytes": 40 << 30, "budget_bytes": rs[0]["budget_bytes"], "peak_bytes": None})
    lines = table(rs).splitlines()
    assert all(len(ln) <= 120 for ln in lines), "\n".join(lines)
    assert "vs budget" in " ".join(lines[:6])
    pruned = next(ln for ln in lines if ln.startswith("optim=adamw train.batch_size=64 "))
    right = next(ln for ln in lines if "vs budget" in ln).index("vs budget") + len("vs budget")
    assert pruned[:right].split()[-1] == "40.000"  # in its column's one unit, GiB
    assert next(ln for ln in lines if ln.lstrip().startswith("(tok/s)"))[:right].endswith("(GiB)")
    narrow = table(rs, width=80).splitlines()
    assert all(len(ln) <= 80 for ln in narrow) and any(ln.startswith("not shown for width") for ln in narrow)
