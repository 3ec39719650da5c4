"""``mode=plan`` reads the data (issue 23): it tokenizes the data as the run does (through the
token cache), plans the widest micro-batch the run will see, prints the length distribution,
and keeps the ``train.seq_len`` plan as the upper bound.

The Mac seed's case: ``model=qwen2-72b train.seq_len=2048`` on data whose samples are far
shorter. Its snapshot sits in a local hub cache laid out as huggingface_hub lays it (the
preset's config.json, the tiny model's tokenizer files), offline.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import GSM8K, finetune_cmd, make_spec
import warm_cli

from finetune import data as data_mod
from finetune.backends.base import padded_length
from finetune.config import ModelConfig
from finetune.planner import plan
from finetune.model.tiny import build_tiny


def _run_plan(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    r = warm_cli.run([*finetune_cmd(), "mode=plan", *overrides, f"hydra.run.dir={tmp_path / 'plan'}"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / "plan" / "plan.json").read_text()), r.stdout


def test_plan_reads_the_data_and_plans_its_longest_sample(tmp_path: Path) -> None:
    over = ("backend=cuda", "model=tiny", "train.seq_len=256", "train.pad_multiple=8")
    p, out = _run_plan(tmp_path, *over)
    d = p["data"]
    # the lengths, computed here from the same data and tokenizer
    spec = make_spec(tmp_path / "x", "mode=plan", *over)  # mode=plan plans for a GPU (the target machine)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tiny(ModelConfig())))
    src, _ = data_mod.build(spec, tok)
    lens = np.asarray(src.lengths)[src.train_idx]
    assert d["samples"] == len(lens) and d["source"] == "synthetic" and d["packed"] is False
    assert "pair_span" not in d  # a packed plan's figure only: plan.json's data keys unpacked are as before
    assert (d["min"], d["max"], d["median"]) == (lens.min(), lens.max(), int(np.percentile(lens, 50)))
    # planned: the longest sample of all the data as the run pads it (what the run's governor plans)
    longest = padded_length(int(np.asarray(src.lengths).max()), 8, 256)
    assert d["planned_tokens"] == longest == p["seq_len"] < 256
    bound = plan(spec, recommend=False)
    assert d["seq_len_bound"]["seq_len"] == 256
    assert d["seq_len_bound"]["max_device_peak_bytes"] == bound["max_device_peak_bytes"] > p["max_device_peak_bytes"]
    # the head priced on target rows: the synthetic data masks its prompts, so at most the largest
    # share of a sample's tokens that are targets (a row holds one sample: its targets over the width)
    targets = src.tok.targets()
    assert d["head_fraction"] == round(min(1.0, int(targets.max()) / longest), 4) < 1
    at = plan(spec, seq_len=longest, recommend=False, head_fraction=d["head_fraction"])
    assert p["max_device_peak_bytes"] == at["max_device_peak_bytes"]
    assert p["bytes"]["logits"] == at["bytes"]["logits"] < plan(spec, seq_len=longest, recommend=False)["bytes"]["logits"]
    assert f"at most {d['head_fraction']:.0%} of a micro-batch's positions" in out
    assert (f"data: {len(lens):,} training samples (synthetic), tokens per sample: min {lens.min()}, "
            f"median {int(np.percentile(lens, 50))}") in out
    assert f"planned at the widest micro-batch the run will see: {longest} tokens" in out
    assert "the bound at train.seq_len=256: peak" in out


def test_plan_under_packing_plans_tokens_per_micro(tmp_path: Path) -> None:
    p, out = _run_plan(tmp_path, "backend=mlx", "model=tiny", "train.packing=true", "train.tokens_per_micro=512",
                       "train.batch_size=8")
    assert p["data"]["packed"] is True
    # steps of 8 samples of 40-151 tokens fill more than one micro-batch: each but the last is 512 wide
    assert p["data"]["planned_tokens"] == p["seq_len"] == 512
    # attention runs per sample: the most (query, key) pairs per position of a micro-batch is
    # between a row of the shortest samples and one sample of the longest
    assert p["data"]["min"] <= p["data"]["pair_span"] <= p["data"]["max"]
    assert "the longest packed micro-batch of the run's steps" in out


def test_a_preset_not_downloaded_plans_seq_len_and_says_why(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty-hub"), "HF_HUB_OFFLINE": "1"}
    p, out = _run_plan(tmp_path, "backend=mlx", "model=qwen2-72b", "memory.budget=192GiB", env=env)
    assert "data" not in p and p["seq_len"] == make_spec(tmp_path / "x", "model=qwen2-72b").train.seq_len
    assert ("planned at train.seq_len: the data's lengths were not read (Qwen/Qwen2-72B is not in the local hub "
            "cache (the run downloads it))") in out


def _hub_snapshot(cache: Path, repo_id: str, config: dict, tokenizer_dir: Path) -> Path:
    """``repo_id`` in ``cache`` as huggingface_hub lays it out: refs/main, snapshots/<sha>/ with
    its config.json and tokenizer files."""
    sha = "b968826d9c46dd6066d109eabc6255188de91218"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    return snap


def test_the_mac_seed_plans_its_data_not_seq_len(tmp_path: Path, gsm8k: Path) -> None:
    """model=qwen2-72b at train.seq_len=2048 on GSM8K: the plan prices the data's longest sample
    and keeps the 2048 plan as the bound, which is the larger."""
    spec = make_spec(tmp_path / "x", "backend=mlx", "model=qwen2-72b")
    cache = tmp_path / "hub"
    released = {**(spec.model.config or {}), "torch_dtype": "bfloat16"}  # as the hub stores it
    _hub_snapshot(cache, "Qwen/Qwen2-72B", released, build_tiny(ModelConfig()))
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "FINETUNE_CACHE": str(tmp_path / "ft-cache")}
    p, out = _run_plan(tmp_path, "backend=mlx", "model=qwen2-72b", "train.seq_len=2048", "memory.budget=192GiB",
                       "data=jsonl", f"data.path={gsm8k}", "data.max_samples=2000", env=env)
    d = p["data"]
    assert d["source"] == GSM8K.name and d["samples"] > 1500 and d["max"] < 2048
    assert p["seq_len"] == d["planned_tokens"] < 2048
    assert d["seq_len_bound"]["seq_len"] == 2048
    assert d["seq_len_bound"]["max_device_peak_bytes"] > p["max_device_peak_bytes"]
    assert p["params_total"] > 70e9  # the preset's model, from the cached config.json
    assert "the bound at train.seq_len=2048" in out
    assert list((tmp_path / "ft-cache" / "tokens").iterdir())  # the token cache a run will reuse
