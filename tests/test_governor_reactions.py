"""Every governor reaction, driven by the trigger it is named for, with the trigger asserted.

Measured peak above the budget and out-of-memory (down to checkpointing at micro-batch 1, then
giving up) run through the real loop; swap growth, memory pressure and fragmentation (which no
CPU test machine can be made to show) are fed to the real Governor as recorded samples, at
their thresholds: the constants are imported, never restated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import cuda_backend_with_oom, needs_mlx, needs_torch

import finetune.run.loop as loop_mod
from finetune.errors import UserError
from finetune.run.governor import (
    FRAGMENTED_FRACTION,
    FRAGMENTED_MIN_BYTES,
    PSI_SOME_AVG10,
    SWAP_GROWTH_BYTES,
    Governor,
    smaller_divisor,
)
from finetune.run.loop import Trainer, train
from finetune.resolver import resolve

COMMON = ("train.progress=false", "data.num_samples=200", "train.eval_every=0", "train.steps=5", "train.warmup_steps=1")
BUDGET = 1 << 30  # memory.budget=1GiB: far above the tiny model's plan, so nothing is decided before loading


def _losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


def _step_records(run: Path) -> dict[int, dict[str, Any]]:
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]
    return {r["step"]: r for r in recs}


def _moves(events: list[dict[str, Any]]) -> list[tuple]:
    return [(e["step"], e["trigger"], e["action"], e["before"], e["after"]) for e in events]


def _micro(b: int, a: int) -> dict[str, int]:
    return {"batch_size": b, "grad_accum": a}


# ---- measured peak, in a real run ---------------------------------------------------------------

@needs_mlx
def test_measured_peak_above_budget_lowers_micro_batch_after_the_step(cfg_factory, tmp_path):
    """The plan fits (no event at step 0); the budget then sits below every measured step peak,
    so after_step halves the micro-batch after steps 1, 2 and 3, each time because the step's
    measured peak was above it, and the run still equals the unadapted one."""
    cfg = cfg_factory("backend=mlx", *COMMON, "train.batch_size=8", "memory.budget=1GiB", run_dir=tmp_path / "peak")
    trainer = Trainer(resolve(cfg))
    trainer.setup()
    assert trainer.governor.budget_bytes == BUDGET and trainer.governor.micro == 8  # the plan changed nothing
    # the bytes held at load (the weights): every step's peak adds activations on top of them
    budget = trainer.acct.samples[0]["allocated"]
    assert 0 < budget < BUDGET
    trainer.governor.budget_bytes = budget
    adapted = trainer.train()
    moves = [m for m in _moves(adapted["adaptations"]) if m[2] not in ("set_mlx_limits", "set_mlx_cache_limit")]
    assert moves == [(1, "peak_above_budget", "lower_micro_batch", _micro(8, 1), _micro(4, 2)),
                     (2, "peak_above_budget", "lower_micro_batch", _micro(4, 2), _micro(2, 4)),
                     (3, "peak_above_budget", "lower_micro_batch", _micro(2, 4), _micro(1, 8))]
    recs = _step_records(tmp_path / "peak")
    for step in (1, 2, 3, 4, 5):  # the trigger: what the step measured (at micro 1 there is nothing left to lower)
        assert recs[step]["step_peak_allocated_bytes"] > budget, step
    assert adapted["micro_batch"] == 1 and adapted["effective_batch"] == 8
    plain = train(resolve(cfg_factory("backend=mlx", *COMMON, "train.batch_size=8", run_dir=tmp_path / "plain")))
    assert not [e for e in plain["adaptations"] if e["action"] not in ("set_mlx_limits", "set_mlx_cache_limit")]
    assert adapted["tokens"] == plain["tokens"]
    # measured spread between micro-batch splits on mlx CPU: < 4e-6 per token
    assert _losses(tmp_path / "peak") == pytest.approx(_losses(tmp_path / "plain"), abs=1e-5)


# ---- out of memory, in a real run: lower, then checkpoint at micro-batch 1, then give up --------

def _oom_backend(from_step: int, while_checkpointing: bool) -> Any:
    """The real cuda backend whose forward raises torch's OutOfMemoryError from optimizer step
    ``from_step`` on for micro-batches above 1 row, and at 1 row unless gradient checkpointing
    is on (or always, with ``while_checkpointing``)."""
    def fails(be: Any, ids: Any) -> bool:
        relief = be.grad_checkpointing and not while_checkpointing
        return be.steps_done >= from_step - 1 and (ids.shape[0] > 1 or not relief)

    return cuda_backend_with_oom(fails)


@needs_torch
def test_oom_at_micro_batch_one_turns_on_checkpointing(cfg_factory, tmp_path, monkeypatch):
    monkeypatch.setattr(loop_mod, "get_backend", lambda name: _oom_backend(2, while_checkpointing=False))
    adapted = train(resolve(cfg_factory("backend=cuda", *COMMON, "train.batch_size=2", "train.grad_accum=2",
                                run_dir=tmp_path / "oom")))
    monkeypatch.undo()
    assert _moves(adapted["adaptations"]) == [
        (2, "oom", "lower_micro_batch", _micro(2, 2), _micro(1, 4)),
        (2, "oom", "enable_grad_checkpointing", {"grad_checkpointing": False}, {"grad_checkpointing": True})]
    assert adapted["micro_batch"] == 1
    plain = train(resolve(cfg_factory("backend=cuda", *COMMON, "train.batch_size=2", "train.grad_accum=2",
                              run_dir=tmp_path / "plain")))
    assert adapted["tokens"] == plain["tokens"] and adapted["samples"] == plain["samples"]
    assert _losses(tmp_path / "oom") == pytest.approx(_losses(tmp_path / "plain"), abs=1e-5)


@needs_torch
def test_oom_with_checkpointing_at_micro_batch_one_gives_up_clearly(cfg_factory, tmp_path, monkeypatch):
    monkeypatch.setattr(loop_mod, "get_backend", lambda name: _oom_backend(2, while_checkpointing=True))
    cfg = cfg_factory("backend=cuda", *COMMON, "train.batch_size=2", run_dir=tmp_path / "x")
    with pytest.raises(UserError, match="out of memory at step 2 even at micro-batch 1 with gradient checkpointing"):
        train(resolve(cfg))
    events = [json.loads(ln)["event"] for ln in (tmp_path / "x" / "metrics.jsonl").read_text().splitlines()
              if ln.startswith('{"event"')]
    assert [(e["step"], e["trigger"], e["action"]) for e in events] == [
        (2, "oom", "lower_micro_batch"), (2, "oom", "enable_grad_checkpointing")]


# ---- the same reactions as pure functions of the trigger (recorded samples) --------------------

class _Backend:
    """What the governor asks of a backend while training, counted."""

    def __init__(self, chunk_refusal: str | None = None) -> None:
        self.released = 0
        self.checkpointing: list[bool] = []
        self.chunks: list[int] = []
        self.chunk_refusal = chunk_refusal  # what set_loss_chunk answers (None: applied)

    def release_cache(self) -> None:
        self.released += 1

    def set_grad_checkpointing(self, on: bool) -> None:
        self.checkpointing.append(on)

    def set_loss_chunk(self, tokens: int) -> str | None:
        self.chunks.append(tokens)
        return self.chunk_refusal


def _governor(cfg_factory, *over: str, micro: int = 8) -> tuple[Governor, list[dict[str, Any]], _Backend]:
    events: list[dict[str, Any]] = []
    cfg = cfg_factory("backend=cuda", f"train.batch_size={micro}", "train.grad_accum=1", *over)
    gov = Governor(resolve(cfg), "cuda", events.append)
    gov.backend = be = _Backend()
    return gov, events, be


def test_peak_reaction_at_its_threshold(cfg_factory):
    gov, events, _ = _governor(cfg_factory, "memory.budget=1GiB")
    gov.after_step(1, {"step_peak_reserved": BUDGET})  # at the budget: fits
    gov.after_step(2, {"step_peak_reserved": None, "step_peak_allocated": BUDGET})
    assert events == []
    gov.after_step(3, {"step_peak_reserved": None, "step_peak_allocated": BUDGET + 1})
    assert _moves(events) == [(3, "peak_above_budget", "lower_micro_batch", _micro(8, 1), _micro(4, 2))]
    # the step's own peak is what counts, not a whole-run peak that an earlier step set
    gov.after_step(4, {"step_peak_reserved": BUDGET // 2, "peak_reserved": 2 * BUDGET})
    assert len(events) == 1
    # a run-wide peak is the fallback only where no step peak is measured
    gov.after_step(5, {"peak_allocated": BUDGET + 1})
    assert events[-1]["step"] == 5 and events[-1]["after"] == _micro(2, 4)


def test_peak_reaction_needs_an_asked_budget_and_adapt(cfg_factory):
    """Without memory.budget the device's own total is no target to shrink to; with
    memory.adapt=false a peak above it is a warning, never a change."""
    gov, events, _ = _governor(cfg_factory)
    gov.after_step(1, {"step_peak_reserved": gov.budget_bytes + 1})
    gov2, events2, _ = _governor(cfg_factory, "memory.budget=1GiB", "memory.adapt=false")
    gov2.after_step(1, {"step_peak_reserved": 2 * BUDGET})
    assert events == events2 == [] and gov.micro == gov2.micro == 8


def test_swap_reaction_at_its_threshold_and_cooldown(cfg_factory):
    gov, events, be = _governor(cfg_factory)
    base = 100 << 20
    gov.after_step(1, {"swap_used": base})
    gov.after_step(2, {"swap_used": base + SWAP_GROWTH_BYTES})  # grown exactly the threshold: not yet
    assert events == [] and be.released == 0
    gov.after_step(3, {"swap_used": base + SWAP_GROWTH_BYTES + 1})
    assert _moves(events) == [(3, "swap_growth", "lower_micro_batch", _micro(8, 1), _micro(4, 2))]
    assert be.released == 1
    top = base + SWAP_GROWTH_BYTES + 1  # the new baseline; grow again past the threshold
    gov.after_step(8, {"swap_used": top + 2 * SWAP_GROWTH_BYTES})  # 5 steps later: still cooling down
    assert len(events) == 1
    gov.after_step(9, {"swap_used": top + 2 * SWAP_GROWTH_BYTES})  # 6 steps later: acted on
    assert events[-1]["trigger"] == "swap_growth" and events[-1]["after"] == _micro(2, 4) and be.released == 2


def test_swap_with_adapt_off_changes_nothing(cfg_factory):
    gov, events, be = _governor(cfg_factory, "memory.adapt=false")
    gov.after_step(1, {"swap_used": 0})
    gov.after_step(2, {"swap_used": 4 * SWAP_GROWTH_BYTES})
    assert events == [] and be.released == 0 and gov.micro == 8


def test_pressure_reaction_at_its_threshold(cfg_factory):
    gov, events, _ = _governor(cfg_factory)
    gov.after_step(1, {"psi_some_avg10": PSI_SOME_AVG10})
    assert events == []
    gov.after_step(2, {"psi_some_avg10": PSI_SOME_AVG10 + 0.1})
    assert _moves(events) == [(2, "memory_pressure", "lower_micro_batch", _micro(8, 1), _micro(4, 2))]
    gov.after_step(7, {"psi_some_avg10": 90.0})  # within 5 steps of the last action
    assert len(events) == 1
    gov.after_step(8, {"psi_some_avg10": 90.0})
    assert events[-1]["trigger"] == "memory_pressure" and len(events) == 2
    off, off_events, _ = _governor(cfg_factory, "memory.adapt=false")
    off.after_step(1, {"psi_some_avg10": 90.0})
    assert off_events == []


def test_fragmentation_reaction_needs_both_thresholds(cfg_factory):
    gov, events, be = _governor(cfg_factory)
    reserved = 8 * FRAGMENTED_MIN_BYTES  # the fraction's bar: FRAGMENTED_FRACTION * reserved
    bar = int(FRAGMENTED_FRACTION * reserved)
    assert bar > FRAGMENTED_MIN_BYTES
    gov.after_step(1, {"inactive_split": bar, "reserved": reserved})  # at the fraction: no
    big = 100 * FRAGMENTED_MIN_BYTES
    gov.after_step(2, {"inactive_split": FRAGMENTED_MIN_BYTES, "reserved": FRAGMENTED_MIN_BYTES + 1})  # at the bytes: no
    assert events == [] and be.released == 0
    gov.after_step(3, {"inactive_split": bar + 1, "reserved": reserved})
    assert _moves(events) == [(3, "fragmentation", "release_cache", {"inactive_split": bar + 1, "reserved": reserved},
                               {"reserved": None})]
    assert be.released == 1 and gov.micro == 8  # releasing cached blocks changes no number
    gov.after_step(4, {"inactive_split": FRAGMENTED_MIN_BYTES + 1, "reserved": big})  # bytes over, fraction under
    assert len(events) == 1
    off, off_events, off_be = _governor(cfg_factory, "memory.adapt=false")
    off.after_step(1, {"inactive_split": bar + 1, "reserved": reserved})
    assert off_events == [] and off_be.released == 0


def test_oom_reactions_in_order(cfg_factory):
    """Halve to the next divisor of the effective batch, then at 1 the chunked loss, then
    checkpoint, then stop."""
    from finetune.planner.fit import LOSS_CHUNK_LEVER

    gov, events, be = _governor(cfg_factory, micro=6)
    for step in (4, 4, 4, 4):
        gov.on_oom(step, RuntimeError("oom"), row_tokens=LOSS_CHUNK_LEVER + 2)  # 1 row: one chunk and a bit
    assert _moves(events) == [
        (4, "oom", "lower_micro_batch", _micro(6, 1), _micro(3, 2)),
        (4, "oom", "lower_micro_batch", _micro(3, 2), _micro(1, 6)),
        (4, "oom", "enable_loss_chunk", {"loss_chunk": 0}, {"loss_chunk": LOSS_CHUNK_LEVER}),
        (4, "oom", "enable_grad_checkpointing", {"grad_checkpointing": False}, {"grad_checkpointing": True})]
    assert be.chunks == [LOSS_CHUNK_LEVER] and gov.loss_chunk == LOSS_CHUNK_LEVER
    assert be.checkpointing == [True] and gov.grad_checkpointing
    with pytest.raises(UserError, match="out of memory at step 5 even at micro-batch 1 with gradient checkpointing"):
        gov.on_oom(5, RuntimeError("oom"))
    assert len(events) == 4 and be.chunks == [LOSS_CHUNK_LEVER]  # on once, never again


@pytest.mark.parametrize("case", ["one_chunk", "refused"])
def test_oom_skips_the_chunked_loss_where_it_would_change_nothing(cfg_factory, case):
    """Rows of at most one chunk of targets (the chunked loss would compute the same logits),
    or a backend that cannot chunk this model's loss: straight to checkpointing, and a refusal
    is asked once."""
    from finetune.planner.fit import LOSS_CHUNK_LEVER

    gov, events, be = _governor(cfg_factory, micro=1)
    if case == "refused":
        be.chunk_refusal = "its logits are soft-capped"
    gov.on_oom(3, RuntimeError("oom"), row_tokens=LOSS_CHUNK_LEVER + 1 if case == "one_chunk" else 4096)
    assert [e["action"] for e in events] == ["enable_grad_checkpointing"] and gov.loss_chunk == 0
    assert be.chunks == ([] if case == "one_chunk" else [LOSS_CHUNK_LEVER])
    off, off_events, _ = _governor(cfg_factory, "memory.adapt=false")
    with pytest.raises(UserError, match="memory.adapt=false"):
        off.on_oom(1, RuntimeError("oom"))
    assert off_events == [] and off.micro == 8


def test_smaller_divisor_is_the_largest_divisor_at_or_below_half():
    """Where half is no divisor the next one down is taken, not one further."""
    assert [smaller_divisor(12, b) for b in (12, 10, 8, 6, 4, 2, 1)] == [6, 4, 4, 3, 2, 1, None]
    assert smaller_divisor(10, 10) == 5 and smaller_divisor(9, 9) == 3 and smaller_divisor(9, 8) == 3
    assert smaller_divisor(7, 7) == 1 and smaller_divisor(7, 1) is None


def test_swap_with_nothing_left_to_lower_says_so(cfg_factory, caplog):
    """At micro-batch 1 (and with memory.adapt=false) swap growth cannot be acted on: no event,
    but a warning that steps will be slow."""
    for over, micro in ((("train.grad_accum=1",), 1), (("memory.adapt=false",), 8)):
        gov, events, _ = _governor(cfg_factory, *over, micro=micro)
        caplog.clear()
        with caplog.at_level("WARNING", logger="finetune"):
            gov.after_step(1, {"swap_used": 0})
            gov.after_step(2, {"swap_used": 2 * SWAP_GROWTH_BYTES})
        assert events == [] and gov.micro == micro
        assert [r.getMessage() for r in caplog.records] == [
            f"step 2: system swap grew {2 * SWAP_GROWTH_BYTES} B since the run started; steps will be slow"]
    gov, events, _ = _governor(cfg_factory)
    caplog.clear()
    with caplog.at_level("WARNING", logger="finetune"):
        gov.after_step(1, {"swap_used": 0})
        gov.after_step(2, {"swap_used": 2 * SWAP_GROWTH_BYTES})
    assert len(events) == 1 and not caplog.records  # acted on: nothing to warn about
