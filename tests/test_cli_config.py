"""The CLI surface: every group option composes, bad input is one line, --help is light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from finetune.cli import group_options
from finetune.config import GROUPS
from finetune.resolver import validate
from finetune.errors import UserError

from conftest import make_cfg
import warm_cli


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return warm_cli.run([sys.executable, "-m", "finetune.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes_and_validates(group, tmp_path):
    options = group_options(group)
    assert options, f"conf/{group} has no options"
    for opt in options:
        cfg = make_cfg(tmp_path, f"{group}={opt}")
        validate(cfg) if group not in ("data",) or opt == "synthetic" else None
        if group == "search":  # `# @package _global_`: it sets top-level keys and the sweeper, no node
            from finetune.sweep import OBJECTIVES

            assert cfg.search_objective in OBJECTIVES, opt
            continue
        name = getattr(cfg, group).get("name", opt)
        if group in ("backend", "method", "optim", "precision", "data", "model"):
            assert name == opt, f"{group}={opt} composed name {name}"


def test_data_groups_need_their_source(tmp_path):
    with pytest.raises(UserError, match="data.path="):
        validate(make_cfg(tmp_path, "data=jsonl"))
    with pytest.raises(UserError, match="data.hf_name="):
        validate(make_cfg(tmp_path, "data=hf"))


def test_model_presets_carry_architecture(tmp_path):
    """Every preset, tiny included, states its architecture as config.json facts (model.config)."""
    for name in group_options("model"):
        m = make_cfg(tmp_path, f"model={name}").model
        c = m.config
        assert c.hidden_size % c.num_attention_heads == 0 and c.num_attention_heads % c.num_key_value_heads == 0
        assert (m.path is None) == (name == "tiny")


@pytest.mark.parametrize("args, needle", [
    (["model=nope"], "model=nope is not an option; choose one of: gemma3-12b, gpt-oss-20b, llama2-70b, llama2-7b"),
    (["optim=adam8"], "optim=adam8 is not an option; choose one of: adafactor, adam, adamw"),
    (["-m", "optim=adamw,bogus"], "optim=bogus is not an option"),
    (["train.steps=0"], "train.steps=0 must be >= 1"),
    (["data=jsonl", "data.path=/nonexistent.jsonl"], "data.path=/nonexistent.jsonl does not exist"),
    (["model.path=/no/such/dir"], "model.path=/no/such/dir does not exist"),
])
def test_bad_input_is_one_line_nonzero_no_traceback(args, needle, tmp_path):
    r = _run(*args, f"hydra.run.dir={tmp_path}/r", "train.progress=false")
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    err_lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err_lines) == 1, r.stderr


def test_help_imports_no_framework():
    """--help answers without importing torch, mlx or transformers: what keeps it fast (the
    wall time itself is printed by benchmarks/cli_latency.py, not asserted here)."""
    r = warm_cli.run([sys.executable, "-X", "importtime", "-m", "finetune.cli", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for g in GROUPS:
        assert f"{g}:" in r.stdout
    imported = {ln.split("|")[-1].strip().split(".")[0] for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert not imported & {"torch", "mlx", "transformers", "mlx_lm"}, imported & {"torch", "mlx", "transformers"}
