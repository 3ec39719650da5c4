"""The chunked loss as a governor lever (train.loss_chunk), in real runs of the cuda backend on
the CPU: chosen before loading when the plan says it alone brings the step under
memory.budget, and turned on after an out-of-memory at micro-batch 1 when the failing tensor is
the logits. Either way the losses equal the unadapted run's within float rounding.

The chunk is LOSS_CHUNK_LEVER tokens (1,024 for users); here it is patched to 16 so the tiny
model's short samples hold several chunks, the same code path at a size a CPU test can run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import cuda_backend_with_oom, needs_mlx, needs_torch

import finetune.run.loop as loop_mod
import finetune.planner.fit as fit_mod
from finetune import planner
from finetune.run.loop import Trainer, train
from finetune.resolver import resolve

CHUNK = 16
COMMON = ("backend=cuda", "train.progress=false", "data.num_samples=64", "train.eval_every=0", "train.steps=3",
          "train.warmup_steps=1", "train.seq_len=64")


def _losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


def _logits_oom(from_step: int) -> Any:
    """Out of memory from optimizer step ``from_step`` on whenever the output head produces
    logits for more than CHUNK positions at once: the target rows' [N, V] logits that the
    unchunked loss builds and the chunked one never does (its chunks are [N, V] with N <= CHUNK;
    the model's own call on the last position of each row is [B, 1, V])."""
    return cuda_backend_with_oom(lambda be, out: be.steps_done >= from_step - 1
                                 and out.numel() // out.shape[-1] > CHUNK, on="head")


@needs_torch
def test_oom_on_the_logits_turns_on_the_chunked_loss_at_micro_batch_one(cfg_factory, tmp_path, monkeypatch):
    monkeypatch.setattr(fit_mod, "LOSS_CHUNK_LEVER", CHUNK)
    monkeypatch.setattr(loop_mod, "get_backend", lambda name: _logits_oom(2))
    adapted = train(resolve(cfg_factory(*COMMON, "train.batch_size=2", "train.grad_accum=2", run_dir=tmp_path / "oom")))
    monkeypatch.undo()
    moves = [(e["step"], e["trigger"], e["action"], e["after"]) for e in adapted["adaptations"]]
    assert moves == [(2, "oom", "lower_micro_batch", {"batch_size": 1, "grad_accum": 4}),
                     (2, "oom", "enable_loss_chunk", {"loss_chunk": CHUNK})]
    plain = train(resolve(cfg_factory(*COMMON, "train.batch_size=2", "train.grad_accum=2", run_dir=tmp_path / "plain")))
    assert adapted["tokens"] == plain["tokens"] and adapted["samples"] == plain["samples"]
    assert _losses(tmp_path / "oom") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-5)


@needs_torch
def test_a_budget_only_the_chunked_loss_meets_keeps_the_micro_batch(cfg_factory, tmp_path, monkeypatch):
    """memory.budget between the plan with the whole logits and the plan with them chunked, at
    the run's own micro-batch: the governor turns on the chunked loss before loading (event at
    step 0), the backend computes the loss in chunks, the micro-batch stays 4, and a checkpoint
    records it."""
    monkeypatch.setattr(fit_mod, "LOSS_CHUNK_LEVER", CHUNK)
    over = (*COMMON, "train.batch_size=4", "train.save_every=3")
    probe = Trainer(resolve(cfg_factory(*over, run_dir=tmp_path / "probe")))
    probe.connect()
    from transformers import AutoTokenizer

    from finetune.data import build
    from finetune.model.source import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(probe.spec.model, seed=0)))
    stats = build(probe.spec, tok)[1]
    # the length and the share of target positions the governor plans for
    L, hf = stats["max_padded_tokens"], stats["head_fraction"]
    whole = planner.plan(resolve(cfg_factory(*over)), seq_len=L, recommend=False,
                         head_fraction=hf)["max_device_peak_bytes"]
    chunked = planner.plan(resolve(cfg_factory(*over, f"train.loss_chunk={CHUNK}")), seq_len=L,
                           recommend=False, head_fraction=hf)["max_device_peak_bytes"]
    assert chunked < whole  # 4 rows of L tokens are several chunks
    budget = (whole + chunked) // 2
    trainer = Trainer(resolve(cfg_factory(*over, f"memory.budget={budget}", run_dir=tmp_path / "fit")))
    trainer.connect()
    with trainer.runlog:
        trainer.setup()
        summary = trainer.train()
    (ev,) = summary["adaptations"]
    assert (ev["step"], ev["trigger"], ev["action"]) == (0, "plan_over_budget", "enable_loss_chunk")
    assert ev["before"]["peak_bytes"] == whole and ev["after"] == {"loss_chunk": CHUNK, "peak_bytes": chunked}
    assert trainer.backend._loss_chunk == CHUNK and summary["micro_batch"] == 4
    state = json.loads((tmp_path / "fit" / "checkpoints" / "step_0000003" / "trainer_state.json").read_text())
    assert state["loss_chunk"] == CHUNK
    # the event in words: memory.png's marker, the swap sentence's account, the sweep report's count
    from finetune.accounting.render import _event_label
    from finetune.accounting.rules import _governor_said
    from finetune.report import rows

    assert _event_label(ev) == f"loss in chunks of {CHUNK}"
    assert _governor_said({"adaptations": [ev]}, 0) == \
        f"the governor computed the loss in chunks of {CHUNK} tokens at step 0 (plan_over_budget)"
    assert [r["adaptations"] for r in rows(tmp_path / "fit")] == [1]
    plain = train(resolve(cfg_factory(*over, run_dir=tmp_path / "plain")))
    assert plain["adaptations"] == []
    assert _losses(tmp_path / "fit") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-5)


@needs_torch
def test_a_compiled_loss_is_never_chunked_by_the_governor(cfg_factory, tmp_path):
    """train.compile on cuda traced the whole-logits loss: the backend refuses the lever (and
    the planner never chooses it), in words."""
    from finetune.backends.cuda.runtime import CudaBackend

    from finetune.model.source import resolve_model_dir

    cfg = cfg_factory(*COMMON, "train.compile=true")
    be = CudaBackend()
    be.setup(resolve(cfg), resolve_model_dir(cfg.model, seed=0))
    why = be.set_loss_chunk(CHUNK)
    assert why and "train.compile" in why and be._loss_chunk == 0
    arch, s = planner.resolve(resolve(cfg))
    assert not fit_mod.chunk_lever_ok(cfg, s)


@needs_mlx
def test_mlx_lever_chunks_the_next_steps_loss_and_refuses_an_unknown_transform(cfg_factory, tmp_path):
    """MlxBackend.set_loss_chunk: the next forward_backward's loss is the same number, now in
    chunks; a model whose logits are transformed after the head in a way finetune does not know
    is refused in words."""
    import numpy as np
    from finetune.backends.mlx.runtime import MlxBackend
    from odd_heads import mlx_doubled
    from transformers import AutoTokenizer

    from finetune.data import build
    from finetune.model.source import resolve_model_dir

    spec = resolve(cfg_factory("backend=mlx", *COMMON[1:]))
    model_dir = resolve_model_dir(spec.model, seed=0)
    be = MlxBackend()
    be.setup(spec, model_dir)
    batch = build(spec, AutoTokenizer.from_pretrained(str(model_dir)))[0].train_batch(0)
    targets = int(batch.loss_mask[:, 1:].sum())
    assert targets > 2 * CHUNK  # several chunks
    whole = be.forward_backward(batch, 1.0)
    be.zero_grad()
    assert be.set_loss_chunk(CHUNK) is None and be._loss_chunk == CHUNK
    chunked = be.forward_backward(batch, 1.0)
    assert chunked == pytest.approx(whole, rel=1e-5) and whole > 0

    capped = MlxBackend()  # logits transformed after the head in a way finetune does not know
    capped.model = mlx_doubled()
    why = capped.set_loss_chunk(CHUNK)
    assert why and "its __call__ transforms them" in why and capped._loss_chunk == 0
    assert np.isfinite(whole)


@needs_torch
def test_torch_lever_refuses_a_model_with_an_unknown_transform_after_the_head() -> None:
    from finetune.backends.cuda.runtime import CudaBackend
    from odd_heads import torch_doubled

    be = CudaBackend()
    be.model = torch_doubled()
    why = be.set_loss_chunk(CHUNK)
    assert why and "finetune knows" in why and be._loss_chunk == 0
