"""The `finetune` console script end to end: `mode=plan` and a two-job `-m` sweep, as a user
types them (the installed script, which imports the package first on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from finetune.resolver import resolve
from finetune import planner
from finetune.config import compose

from conftest import finetune_cmd, needs_torch
import warm_cli

FRAMEWORKS = {"torch", "mlx", "transformers", "mlx_lm", "bitsandbytes", "peft"}


def _finetune(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return warm_cli.run([*finetune_cmd(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def test_plan_mode_writes_the_plan_and_loads_nothing(tmp_path):
    over = ("mode=plan", "model=qwen2-7b", "backend=cuda", "backend.device=cuda", "method=qlora",
            "memory.budget=24GiB", "train.batch_size=4")
    r = _finetune(*over, f"hydra.run.dir={tmp_path}/plan", PYTHONPROFILEIMPORTTIME="1")
    assert r.returncode == 0, r.stderr[-3000:]
    written = json.loads((tmp_path / "plan" / "plan.json").read_text())
    # the same plan as the planner gives the composed config in-process, to the byte
    expected = planner.plan(resolve(compose(tmp_path / "plan", *over)))
    # with a note: the preset was never downloaded here, so its tokenizer (and the data's
    # lengths) cannot be read and the plan stays at train.seq_len (tests/test_plan_data.py)
    expected["notes"].append("planned at train.seq_len: the data's lengths were not read (Qwen/Qwen2-7B is not in "
                             "the local hub cache (the run downloads it))")
    assert written == json.loads(json.dumps(expected))
    assert written["budget_bytes"] == 24 * 2**30 and written["batch_size"] == 4 and written["method"] == "qlora"
    out = r.stdout.splitlines()
    assert out[0].startswith("plan: qwen2-7b qlora") and f"{written['params_total']:,} total" in r.stdout
    assert f"{written['peak_bytes']:16,d}" in r.stdout  # the table prints exact bytes beside GiB
    imported = {ln.split("|")[-1].strip().split(".")[0] for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert imported and not imported & FRAMEWORKS, imported & FRAMEWORKS
    assert not (tmp_path / "plan" / "metrics.jsonl").exists() and not (tmp_path / "plan" / "adapter").exists()


@needs_torch
def test_two_job_sweep_runs_each_job_from_its_own_start(tmp_path):
    """`finetune -m optim.lr=A,B`: two jobs in one process, each in its own folder with its own
    lr; both start from the same weights (equal first losses) and then part (the lr acts)."""
    lrs = (1e-3, 3e-2)
    r = _finetune("-m", f"optim.lr={lrs[0]},{lrs[1]}", "backend=cuda", "train.steps=3", "train.warmup_steps=1",
                  "train.progress=false", "data.num_samples=100", "train.eval_every=0",
                  f"hydra.sweep.dir={tmp_path}/sweep")
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(p.parent for p in (tmp_path / "sweep").glob("*/summary.json"))
    assert [p.name.split("_", 1)[0] for p in jobs] == ["0", "1"], jobs
    summaries = [json.loads((j / "summary.json").read_text()) for j in jobs]
    metrics = [[json.loads(ln) for ln in (j / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]
               for j in jobs]
    for lr, job, s, m in zip(lrs, jobs, summaries, metrics):
        assert s["steps"] == 3 and [x["step"] for x in m] == [1, 2, 3]
        assert m[0]["lr"] == pytest.approx(lr, rel=1e-12)  # warmup 1: step 1 runs at the job's lr
        assert (job / "adapter").is_dir() and (job / ".hydra" / "config.yaml").is_file()
    assert metrics[0][0]["loss"] == pytest.approx(metrics[1][0]["loss"], abs=1e-7)
    assert abs(metrics[0][2]["loss"] - metrics[1][2]["loss"]) > 1e-3
    assert summaries[0]["tokens"] == summaries[1]["tokens"]
