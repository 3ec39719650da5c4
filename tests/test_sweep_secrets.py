"""Secrets, everywhere a run or a sweep writes (issue 20): tokens planted in the environment, a
key-named config value (``+extra.api_key``), a secret-named logger tag, and for a sweep a swept
secret itself, appear in no file's bytes and no file or directory name under the output
(multirun.yaml, job directory names, the report's ``dir`` column, the loggers' run names, tags
and the command line W&B keeps), nor in what the command prints."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

from conftest import finetune_cmd, needs_torch
import warm_cli

from finetune.redact import redact_overrides, redact_yaml_file

ENV = {"HF_TOKEN": "hf_plantedSWEEP0001", "WANDB_API_KEY": "wandbPLANTEDsweep0002",
       "MLFLOW_TRACKING_TOKEN": "mlflowPLANTEDsweep0003"}
KEY = "sk-plantedSWEEPkey0004"
TAG = "sk-plantedTAGkey0005"
COMMON = ("backend=cuda", "train.steps=2", "train.eval_every=0", "train.progress=false", "data.num_samples=40",
          "logger=[csv,tensorboard,mlflow,wandb]", "logger.wandb.mode=offline", f"+logger.mlflow.tags.api_key={TAG}")


def _finetune(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return warm_cli.run([*finetune_cmd(), *args, *COMMON], cwd=tmp, env={**os.environ, **ENV, "WANDB_SILENT": "true"},
                          capture_output=True, text=True, timeout=300)


def _leaks(root: Path, r: subprocess.CompletedProcess, secrets: list[str]) -> list[str]:
    found = []
    for p in [root, *root.rglob("*")]:
        found += [f"{s} in the name {p}" for s in secrets if s in p.name]
        if p.is_file():
            data = p.read_bytes()
            found += [f"{s} in {p}" for s in secrets if s.encode() in data]
    return found + [f"{s} printed" for s in secrets if s in r.stdout or s in r.stderr]


@needs_torch
def test_a_sweep_writes_no_planted_secret_in_any_file_or_name(tmp_path: Path) -> None:
    """Each job is a single run of its own process (``finetune OVERRIDES hydra.run.dir=JOB``, as
    a user types one), so the checks of one run hold for each job dir as well."""
    out, other = tmp_path / "sweep", KEY + "B"
    r = _finetune(tmp_path, "-m", f"+extra.api_key={KEY},{other}", f"hydra.sweep.dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(p.name for p in out.iterdir() if p.is_dir())
    plain = ("backend=cuda,data.num_samples=40,logger.wandb.mode=offline,logger=[csv,tensorboard,mlflow,wandb],"
             "train.eval_every=0,train.progress=False,train.steps=2")  # the secret-named key left out
    assert jobs == [f"0_{plain}", f"1_{plain}"]
    rows = list(csv.DictReader((out / "sweep_summary.csv").open()))
    assert [x["status"] for x in rows] == ["ran", "ran"] and all(Path(x["dir"]).name in jobs for x in rows)
    for job in jobs:  # a run's summary, and the secret-named tag reached MLflow (masked)
        assert (out / job / "summary.json").is_file() and list((out / job).glob("mlruns/*/*/tags/api_key")), job
    assert "+extra.api_key=***" in (out / "multirun.yaml").read_text()
    assert _leaks(out, r, [*ENV.values(), KEY, other, TAG]) == []


def test_short_secret_overrides_are_masked_in_hydra_files(tmp_path: Path) -> None:
    """A value shorter than MIN_SECRET_LEN is not searched for in free text, but an override
    that sets a secret-named key is masked whatever its length."""
    f = tmp_path / "hydra.yaml"
    f.write_text("hydra:\n  overrides:\n    task:\n    - +extra.api_key=abc\n    - optim=sgd\n  job:\n"
                 "    override_dirname: +extra.api_key=abc,optim=sgd\n")
    redact_yaml_file(f, [])
    assert "abc" not in f.read_text() and "- optim=sgd" in f.read_text()
    assert redact_overrides(["+extra.api_key=a,b", "model.pad_token=<pad>"]) == ["+extra.api_key=***",
                                                                                   "model.pad_token=<pad>"]
