"""The numbers a run writes are the right numbers, not just present: lr, loss, grad_norm and
val_loss against an independent computation on the same batches, plan_error against the
plan and the census it compares.

One short real run per backend (tiny model) is shared by the module. The cuda run is
replayed step by step outside the loop: the same backend build (same seed, same adapters),
the same effective batches taken whole (the loop splits them into micro-batches), a loss
written here from the logits, the hand-worked learning rates; its losses, gradient norms and
validation loss must equal what the loop logged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_cfg, needs_mlx, needs_torch
from omegaconf import OmegaConf

from finetune import data as data_mod
from finetune import planner
from finetune.run.loop import train
from finetune.resolver import resolve

STEPS, WARMUP, LR = 6, 2, 1e-2
R = math.sqrt(0.5)
# cosine after a 2-step warmup over 6 steps, worked by hand: frac = (step - 2) / 4
HAND_LR = [LR / 2, LR, LR * 0.5 * (1 + R), LR / 2, LR * 0.5 * (1 - R), 0.0]
MAX_GRAD_NORM = 0.1  # below the tiny model's first gradients (~0.4): the clip is engaged
RUN = ("train.progress=false", "data.num_samples=200", f"train.steps={STEPS}", f"train.warmup_steps={WARMUP}",
       "train.schedule=cosine", f"optim.lr={LR}", f"optim.max_grad_norm={MAX_GRAD_NORM}",
       "train.batch_size=2", "train.grad_accum=2", "train.eval_every=3", "train.eval_batches=4")
BYTE_CATEGORIES = ("weights", "trainable_weights", "grads", "optimizer_state", "optimizer_state_paged")


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


def _run(tmp_path_factory: Any, backend: str) -> dict[str, Any]:
    run = tmp_path_factory.mktemp(f"values_{backend}")
    cfg = make_cfg(run, f"backend={backend}", *RUN)
    summary = train(resolve(cfg))
    from transformers import AutoTokenizer

    from finetune.model.source import resolve_model_dir

    model_dir = resolve_model_dir(cfg.model)
    src, stats = data_mod.build(resolve(cfg), AutoTokenizer.from_pretrained(str(model_dir)))
    return {"cfg": cfg, "run": run, "summary": summary, "metrics": _records(run), "src": src, "model_dir": model_dir,
            "stats": stats}


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory):
    pytest.importorskip("torch")
    return _run(tmp_path_factory, "cuda")


@pytest.fixture(scope="module")
def mlx_run(tmp_path_factory):
    pytest.importorskip("mlx.core")
    return _run(tmp_path_factory, "mlx")


def _val_batches(r: dict[str, Any]) -> list:
    cfg = r["cfg"]
    assert r["summary"]["micro_batch"] == cfg.train.batch_size  # nothing adapted: the loop's eval split
    batches = r["src"].val_batches(cfg.train.batch_size, cfg.train.eval_batches)
    assert len(batches) == cfg.train.eval_batches  # more validation data than the cap: the cap matters
    return batches


def _check_lr(r: dict[str, Any]) -> None:
    assert [m["step"] for m in r["metrics"]] == list(range(1, STEPS + 1))
    assert [m["lr"] for m in r["metrics"]] == pytest.approx(HAND_LR, rel=1e-12, abs=1e-15)


def _check_plan_error(r: dict[str, Any]) -> None:
    """plan_error compares the plan for the run as it was at step 1 (micro-batch, the length
    step 1 really had) with the census and the sample of step 1, category by category."""
    cfg, summary, first = r["cfg"], r["summary"], r["metrics"][0]
    err = summary["plan_error"]
    assert err is not None and set(err) == {*BYTE_CATEGORIES, "steady_state_allocated", "peak_allocated",
                                            "step1_reserved", "step1_device_level", "step1_host"}
    length = int(r["src"].train_batch(0).lengths.max())
    as_run = OmegaConf.merge(cfg, {"train": {"batch_size": summary["micro_batch"]},
                                   "backend": {"name": summary["backend"]}})
    # the head priced on the data's target positions, as the loop's governor plans it
    p = planner.plan(resolve(as_run), seq_len=length, head_fraction=r["stats"]["head_fraction"])
    census = {k[len("census_"):-len("_bytes")]: v for k, v in first.items() if k.startswith("census_")}
    assert census == {k[:-len("_bytes")]: v for k, v in summary["memory"]["census_first_optimizer"].items()
                      if k != "step"}
    expected_measured = {
        "weights": census["frozen_weights"] + census["trainable_weights"] + census["quant_buffers"],
        "trainable_weights": census["trainable_weights"],
        "grads": None,  # released by the optimizer step: not measured (never a measured 0)
        "optimizer_state": census["optimizer_state"],
        "optimizer_state_paged": census["optimizer_state_paged"],
        "steady_state_allocated": first["allocated_bytes"],
        "peak_allocated": first["step_peak_allocated_bytes"],
        # step 1 in the metrics that run out (None where this device has no allocator or NVML)
        "step1_reserved": first["step_peak_reserved_bytes"],
        "step1_device_level": first["device_used_bytes"],
        "step1_host": first["peak_rss_bytes"],
    }
    expected_predicted = {**{k: p["bytes"][k] for k in BYTE_CATEGORIES},
                          "steady_state_allocated": p["steady_state_allocated_bytes"],
                          "peak_allocated": p["peak_allocated_bytes"],
                          **{f"step1_{k}": p["phases"]["step1"][f"{m}_bytes"]
                             for k, m in (("reserved", "reserved"), ("device_level", "device"), ("host", "host"))}}
    for k, e in err.items():
        assert (e["predicted"], e["measured"]) == (expected_predicted[k], expected_measured[k]), k
        if e["measured"] is None:
            assert e["error_bytes"] is None and e["relative_error"] is None, k
        else:
            assert e["error_bytes"] == e["predicted"] - e["measured"], k
            want = None if e["measured"] == 0 and e["predicted"] else \
                (0.0 if e["measured"] == 0 else (e["predicted"] - e["measured"]) / e["measured"])
            assert e["relative_error"] == pytest.approx(want), k
    # the tiny model's static bytes are priced exactly (planner docstring): zero error there
    for k in ("weights", "trainable_weights", "optimizer_state"):
        assert err[k]["error_bytes"] == 0, (k, err[k])


# ---- cuda (torch on the CPU) ------------------------------------------------------------------

def _torch_loss(model: Any, batch: Any) -> Any:
    """Mean token cross-entropy over the batch's targets, written here from the logits."""
    import torch
    import torch.nn.functional as F

    ids = torch.as_tensor(batch.input_ids, dtype=torch.long)
    attn = (torch.arange(ids.shape[1])[None, :] < torch.as_tensor(batch.lengths)[:, None]).long()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    mask = torch.as_tensor(batch.loss_mask[:, 1:], dtype=torch.float32)
    ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return (ce * mask).sum(), mask.sum()


def _torch_val_loss(model: Any, batches: list) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        sums = [_torch_loss(model, b) for b in batches]
    model.train()
    return float(sum(s for s, _ in sums) / sum(n for _, n in sums))


@needs_torch
def test_cuda_lr_logged_is_the_schedule(cuda_run):
    _check_lr(cuda_run)


@needs_torch
def test_cuda_loss_grad_norm_and_lr_replayed_outside_the_loop(cuda_run):
    """Three steps replayed with the hand-worked rates: the loop's logged loss and pre-clip
    gradient norm of each equal the replay's, and so does the step-3 validation loss; a wrong
    rate handed to the optimizer would move steps 2 and 3."""
    import torch
    from finetune.backends.cuda.runtime import CudaBackend

    r = cuda_run
    be = CudaBackend()
    be.setup(resolve(r["cfg"]), r["model_dir"])
    trainable = [p for p in be.model.parameters() if p.requires_grad]
    for step in (1, 2, 3):
        batch = r["src"].train_batch(step - 1)  # whole: the loop took it in micro-batches of 2
        loss_sum, label_tokens = _torch_loss(be.model, batch)
        assert int(label_tokens) == batch.label_tokens
        (loss_sum / label_tokens).backward()
        norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in trainable])))
        be.optimizer_step(HAND_LR[step - 1])
        logged = r["metrics"][step - 1]
        assert logged["loss"] == pytest.approx(float(loss_sum.detach() / label_tokens), rel=1e-6), step
        assert logged["grad_norm"] == pytest.approx(norm, rel=1e-5), step
        assert logged["grad_norm"] > MAX_GRAD_NORM  # pre-clip: the clip did not shape what is logged
        assert logged["tokens"] == batch.tokens and logged["samples"] == len(batch.lengths)
    batches = _val_batches(r)
    assert r["metrics"][2]["val_loss"] == pytest.approx(_torch_val_loss(be.model, batches), rel=1e-5)


@needs_torch
def test_cuda_final_val_loss_is_the_token_mean_of_the_saved_adapter(cuda_run):
    """final_val_loss equals the token-weighted mean loss of the written adapter on the same
    validation batches: sum of per-token losses / their count, not a mean of batch means."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    r = cuda_run
    base = AutoModelForCausalLM.from_pretrained(str(r["model_dir"]), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(r["run"] / "adapter"))
    batches = _val_batches(r)
    want = _torch_val_loss(model, batches)
    assert r["summary"]["final_val_loss"] == pytest.approx(want, rel=1e-6)
    assert r["metrics"][-1]["val_loss"] == r["summary"]["final_val_loss"]
    # the batches hold different numbers of targets, so the other means really differ
    model.eval()
    with torch.no_grad():
        parts = [_torch_loss(model, b) for b in batches]
    per_batch = float(np.mean([float(s / n) for s, n in parts]))
    assert abs(per_batch - want) > 1e-4, (per_batch, want)
    assert "val_loss" not in r["metrics"][0] and "val_loss" in r["metrics"][2]  # eval_every=3, and the last


@needs_torch
def test_cuda_plan_error_is_plan_minus_census(cuda_run):
    _check_plan_error(cuda_run)
    err = cuda_run["summary"]["plan_error"]
    # torch on the CPU has no allocator counters: unknown, so no error is claimed
    assert err["steady_state_allocated"]["measured"] is None and err["peak_allocated"]["measured"] is None


# ---- mlx -----------------------------------------------------------------------------------

@needs_mlx
def test_mlx_lr_logged_is_the_schedule(mlx_run):
    _check_lr(mlx_run)


@needs_mlx
def test_mlx_plan_error_is_plan_minus_census_and_sample(mlx_run):
    _check_plan_error(mlx_run)
    err = mlx_run["summary"]["plan_error"]
    assert err["steady_state_allocated"]["measured"] > 0 and err["peak_allocated"]["measured"] > 0


@needs_mlx
def test_mlx_final_val_loss_is_the_token_mean_of_the_saved_adapter(mlx_run):
    import mlx.core as mx
    from mlx import nn
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    r = mlx_run
    model, _ = load(str(r["model_dir"]))
    load_adapters(model, str(r["run"] / "adapter"))
    model.eval()
    total = count = 0.0
    for b in _val_batches(r):
        ids = mx.array(b.input_ids.astype(np.int32))
        logits = model(ids[:, :-1]).astype(mx.float32)
        mask = mx.array(b.loss_mask[:, 1:].astype(np.float32))
        total += float((nn.losses.cross_entropy(logits, ids[:, 1:]) * mask).sum())
        count += float(mask.sum())
    assert r["summary"]["final_val_loss"] == pytest.approx(total / count, rel=1e-5)


@needs_torch
def test_eval_every_step_evaluates_every_step(tmp_path):
    """train.eval_every=1: a val_loss on every step (0 is the value that turns evaluation off)."""
    cfg = make_cfg(tmp_path / "run", "backend=cuda", "train.progress=false", "data.num_samples=100",
                   "train.steps=2", "train.eval_every=1", "train.eval_batches=1")
    summary = train(resolve(cfg))
    vals = [m.get("val_loss") for m in _records(tmp_path / "run")]
    assert len(vals) == 2 and all(isinstance(v, float) and v > 0 for v in vals), vals
    assert summary["final_val_loss"] == vals[-1]
