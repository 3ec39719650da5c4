"""Packed runs planned from their data (train.packing), on GSM8K with the tiny model on MLX,
through the real CLI (``python -m finetune``, the checkout's code), 8 samples a step at
``train.tokens_per_micro=2048``.

Asserted:
- the plan (``mode=plan``'s plan.json and the run's own, ``summary.json`` ``plan_error``) is
  within 5% of the peak the run measured (``summary.json``), filled or not;
- it prices the rows the data really makes: the widest (the steps' own tokens where a step
  never fills a row), with ``train.pack_fill=true`` ``tokens_per_micro``;
- ``train.pack_fill=true`` makes every step's measured peak the same (within 5%: MLX's own
  peak for rows of one width and one attention moved 1-5% from step to step in our runs),
  where unfilled a step of fewer tokens peaks far lower;
- filling keeps the loss and the gradients of the step, on both backends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import GSM8K, REPO, make_spec, needs_mlx, needs_torch
import warm_cli
from finetune.backends.base import pack, pack_layout
from test_packing import (  # noqa: F401
    assert_grads_equal,
    make_batch,
    mlx_backend,
    mlx_step,
    model_dir,
    torch_backend,
    torch_step,
)

from finetune import data as data_mod
from finetune.model.source import resolve_model_dir
from finetune.planner import plan

TOKENS = 2048
RUN = ("backend=mlx", "data=jsonl", f"data.path={GSM8K}", "train.packing=true", f"train.tokens_per_micro={TOKENS}",
       "train.batch_size=8", "train.steps=4", "train.progress=false", "train.eval_every=0")


def finetune(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, on this checkout's code whichever copy is installed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = warm_cli.run([sys.executable, "-m", "finetune", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env,
                       check=False,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> dict[bool, dict[str, Any]]:
    """For pack_fill off and on: plan.json of ``mode=plan``, then a 4-step run's summary and
    per-step records."""
    if not GSM8K.is_file():
        pytest.skip(f"{GSM8K} absent")
    out = {}
    for fill in (False, True):
        root = tmp_path_factory.mktemp(f"fill-{fill}")
        overrides = (*RUN, f"train.pack_fill={str(fill).lower()}")
        finetune(root / "plan", "mode=plan", *overrides)
        finetune(root / "run", *overrides)
        out[fill] = {"plan": json.loads((root / "plan" / "plan.json").read_text()),
                     "summary": json.loads((root / "run" / "summary.json").read_text()),
                     "steps": step_records(root / "run")}
    return out


@needs_mlx
@pytest.mark.parametrize("fill", [False, True])
def test_the_plan_is_within_5_percent_of_the_measured_mlx_peak(runs: dict, fill: bool) -> None:
    r = runs[fill]
    planned, measured = r["plan"]["peak_allocated_bytes"], r["summary"]["memory"]["peaks"]["allocated_bytes"]
    assert abs(planned / measured - 1) <= 0.05, (planned, measured)
    # the run's own plan, at step 1's rows, against step 1's peak
    err = r["summary"]["plan_error"]["peak_allocated"]
    assert abs(err["relative_error"]) <= 0.05, err


@needs_mlx
def test_the_plan_prices_the_rows_the_data_makes(runs: dict) -> None:
    """8 samples of at most train.seq_len=256 tokens make one row a step: the widest is the
    step of the most tokens (the run's own records); filled, every row is tokens_per_micro.
    The head is priced on the most targets a row holds, below the per-sample share bound."""
    for fill in (False, True):
        p, steps = runs[fill]["plan"], runs[fill]["steps"]
        assert p["seq_len"] == p["data"]["planned_tokens"] == p["packing"]["tokens_priced"]
        assert p["seq_len"] == (TOKENS if fill else max(s["tokens"] for s in steps))
        spec = make_spec(REPO / "unused", *RUN, f"train.pack_fill={str(fill).lower()}")
        bound = plan(spec, seq_len=p["seq_len"], recommend=False, head_fraction=p["data"]["head_fraction"],
                     pair_span=p["data"]["pair_span"], longest=p["data"]["max"])
        assert p["data"]["row_targets"] < p["data"]["head_fraction"] * (p["seq_len"] - 1)
        assert p["bytes"]["logits"] < bound["bytes"]["logits"]


@needs_mlx
def test_pack_fill_makes_every_step_peak_the_same(runs: dict) -> None:
    peaks = {fill: [s["step_peak_allocated_bytes"] for s in runs[fill]["steps"]] for fill in (False, True)}
    spread = {fill: (max(p) - min(p)) / max(p) for fill, p in peaks.items()}
    tokens = [s["tokens"] for s in runs[False]["steps"]]
    assert min(tokens) < max(tokens)  # a step that fills less of its row than another: the case at hand
    assert spread[True] <= 0.05, peaks
    assert spread[False] > 4 * spread[True], peaks  # unfilled, the step of fewer tokens peaks lower
    assert [s["tokens"] for s in runs[True]["steps"]] == tokens  # the same samples, trained alike


def test_a_row_the_data_never_fills_is_priced_at_the_data(tmp_path: Path, gsm8k: Path) -> None:
    """train.seq_len=200: 8 samples never reach 2048 tokens. The plan prices the widest step
    the data gives over the configured steps (below tokens_per_micro), pack_fill the full row."""
    overrides = (*RUN, "train.seq_len=200")
    spec = make_spec(tmp_path / "x", *overrides)
    from transformers import AutoTokenizer

    src, _ = data_mod.build(spec, AutoTokenizer.from_pretrained(str(resolve_model_dir(spec.model))))
    widest = max(int(src.step_lengths(i).sum()) for i in range(spec.train.steps))
    assert widest < TOKENS
    finetune(tmp_path / "plain", "mode=plan", *overrides)
    finetune(tmp_path / "filled", "mode=plan", *overrides, "train.pack_fill=true")
    plain = json.loads((tmp_path / "plain" / "plan.json").read_text())
    filled = json.loads((tmp_path / "filled" / "plan.json").read_text())
    assert plain["seq_len"] == widest and filled["seq_len"] == TOKENS
    assert plain["peak_allocated_bytes"] < filled["peak_allocated_bytes"]


# ---- filling keeps the math -----------------------------------------------------------------
def _check_filled(parts: list[Any], plain: list[Any], tokens: int) -> None:
    """Every filled row is ``tokens`` wide (a lone longer sample its own width), holds the same
    samples and label tokens as the plain one, and no segment outgrows the longest sample."""
    assert [list(p.indices) for p in parts] == [list(p.indices) for p in plain]
    assert [p.label_tokens for p in parts] == [p.label_tokens for p in plain]
    longest = max(int(n) for n in make_batch().lengths)
    for p in parts:
        assert p.input_ids.shape[1] == max(tokens, p.tokens)
        starts = np.flatnonzero(p.position_ids[0] == 0)
        assert max(np.diff(np.r_[starts, p.input_ids.shape[1]])) <= longest


@pytest.mark.parametrize("backend", [pytest.param("mlx", marks=needs_mlx), pytest.param("cuda", marks=needs_torch)])
def test_pack_fill_keeps_the_loss_and_gradients(model_dir: Path, backend: str) -> None:  # noqa: F811
    be = mlx_backend(model_dir) if backend == "mlx" else torch_backend(model_dir)
    step = mlx_step if backend == "mlx" else torch_step
    batch = make_batch()
    for tokens in (200, 100, 60):  # one row; two; a sample alone, padded after it and in a segment of its own
        plain, filled = pack(batch, tokens), pack(batch, tokens, fill=True)
        _check_filled(filled, plain, tokens)
        assert [r.width for r in pack_layout(batch.lengths, tokens, fill=True)] == [p.input_ids.shape[1] for p in filled]
        want_loss, want = step(be, plain)
        loss, grads = step(be, filled)
        assert loss == pytest.approx(want_loss, rel=1e-5), tokens
        assert_grads_equal(grads, want)
