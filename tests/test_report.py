"""finetune-report: runs side by side, in an order that does not depend on finishing order."""

from __future__ import annotations

import csv

from conftest import needs_torch

from finetune.loop import train
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
    assert out[0].split()[:5] == ["job", "status", "backend", "method", "optim"]
    # without Hydra's overrides.yaml (runs trained by hand) a job is named by its directory
    assert [ln.split()[0] for ln in out[1:3]] == ["0_optim=adamw", "1_optim=adamw_8bit"]
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [r["optim"] for r in rows] == ["adamw", "adamw_8bit"]
    assert all(int(r["params_trainable"]) == 107072 for r in rows)
    assert rows[0]["peak_rss_bytes"].isdigit() and rows[0]["peak_allocated_bytes"] == ""  # no allocator on CPU
    assert (sweep / "sweep_summary.md").is_file() and (sweep / "sweep_memory.png").is_file()


def test_report_on_a_dir_without_runs_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no summary.json under") and err.count("\n") == 1
