"""Tokens and keys never reach a file: a run through the CLI with HF / W&B / MLflow secrets
planted in the environment and a key-named config value leaves none of them in the saved
config (.hydra/), metrics, the csv logger's files or the summary."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from finetune.redact import redact_text, redact_tree

from conftest import finetune_cmd, needs_torch

PLANTED = {"HF_TOKEN": "hf_plantedSECRET0001", "WANDB_API_KEY": "wandbPLANTEDsecret0002",
           "MLFLOW_TRACKING_TOKEN": "mlflowPLANTED0003", "MLFLOW_TRACKING_PASSWORD": "mlflowPASS0004"}
CONFIG_SECRET = "sk-plantedCONFIGkey0005"


def test_redaction_rules():
    tree = {"api_key": "abcdef123", "max_new_tokens": 64, "objective": "tokens_per_sec", "hf_token": None,
            "uri": "http://user:hunter22@host:5000", "nested": [{"password": "p4ssw0rd"}]}
    out = redact_tree(tree, secrets=["planted-env-value"])
    assert out == {"api_key": "***", "max_new_tokens": 64, "objective": "tokens_per_sec", "hf_token": None,
                   "uri": "http://user:***@host:5000", "nested": [{"password": "***"}]}
    assert redact_text("x planted-env-value y", ["planted-env-value"]) == "x *** y"


@needs_torch
def test_planted_tokens_appear_in_no_file(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, **PLANTED}
    r = subprocess.run([*finetune_cmd(), "backend=cuda", "train.steps=2", "train.eval_every=0", "train.progress=false",
                        "data.num_samples=40", "logger=csv", f"+extra.api_key={CONFIG_SECRET}",
                        f"hydra.run.dir={run}"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "summary.json").is_file() and (run / ".hydra" / "config.yaml").is_file()
    secrets = [*PLANTED.values(), CONFIG_SECRET]
    for f in [p for p in run.rglob("*") if p.is_file()]:
        data = f.read_bytes()
        for s in secrets:
            assert s.encode() not in data, f"{s} in {f}"
    for s in secrets:
        assert s not in r.stderr and s not in r.stdout
    assert "api_key: '***'" in (run / ".hydra" / "config.yaml").read_text() or \
        "api_key: ***" in (run / ".hydra" / "config.yaml").read_text()
