"""The governor's handling of memory.cache_limit as a user writes it: "auto" waits for the
first measured step, a size is set at once, anything else is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from finetune.config import compose
from finetune.errors import UserError
from finetune.run.governor import Governor
from finetune.resolver import resolve


class _MlxLimits:  # what the governor asks of an MLX backend
    def __init__(self) -> None:
        self.cache_limits: list[int] = []

    def set_memory_limits(self, budget: int) -> dict[str, int]:
        return {}

    def set_cache_limit(self, limit: int) -> int:
        self.cache_limits.append(limit)
        return 32 << 20


def test_a_cache_limit_that_is_no_size_is_refused(tmp_path: Path) -> None:
    # the message names memory.budget (parse_budget's wording), though the key is memory.cache_limit
    cfg = compose(tmp_path / "run", "backend=mlx", "memory.budget=8GiB", "memory.cache_limit=unlimited")
    gov = Governor(resolve(cfg), "mlx", lambda ev: None)
    with pytest.raises(UserError, match=r"^memory.cache_limit=unlimited is not a size; use "):
        gov.attach(_MlxLimits())


def test_auto_sets_the_cache_limit_after_the_first_measured_step(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    cfg = compose(tmp_path / "run", "backend=mlx", "memory.budget=8GiB", "memory.cache_limit=auto")
    gov = Governor(resolve(cfg), "mlx", events.append)
    be = _MlxLimits()
    gov.attach(be)
    assert be.cache_limits == [] and events == []
    gov.after_step(1, {"step_peak_allocated": 3 << 30, "allocated": 2 << 30})
    assert be.cache_limits == [1 << 30]
    assert events[-1]["action"] == "set_mlx_cache_limit" and events[-1]["after"] == {"cache_limit": 1 << 30}


def test_before_loading_a_budget_too_small_for_any_micro_batch_stops_the_run(tmp_path: Path) -> None:
    cfg = compose(tmp_path / "run", "backend=cuda", "memory.budget=1MiB", "train.batch_size=4")
    gov = Governor(resolve(cfg), "cuda", lambda ev: None)
    with pytest.raises(UserError, match=r"^the plan does not fit memory.budget=1MiB even at micro-batch 1 with "
                                        r"gradient checkpointing"):
        gov.before_load()


class _Chunks:  # what apply_loss_chunk asks of a backend
    def __init__(self) -> None:
        self.asked: list[int] = []

    def set_loss_chunk(self, tokens: int) -> str | None:
        self.asked.append(tokens)
        return None


def test_a_chunked_loss_chosen_before_loading_reaches_the_backend(tmp_path: Path) -> None:
    gov = Governor(resolve(compose(tmp_path / "run", "backend=cuda")), "cuda", lambda ev: None)
    gov.backend = be = _Chunks()
    gov.state.loss_chunk = 1024  # what before_load chose to fit the budget
    gov.apply_loss_chunk()
    assert be.asked == [1024]
    mine = Governor(resolve(compose(tmp_path / "own", "backend=cuda", "train.loss_chunk=512")), "cuda", lambda ev: None)
    mine.backend = be2 = _Chunks()
    mine.apply_loss_chunk()  # the user's own setting: the backend applied it at setup
    assert be2.asked == []


class _Frees:  # what the governor's reactions ask of a backend
    def __init__(self) -> None:
        self.released, self.checkpointing = 0, []

    def release_cache(self) -> None:
        self.released += 1

    def set_grad_checkpointing(self, on: bool) -> None:
        self.checkpointing.append(on)

    def set_loss_chunk(self, tokens: int) -> str | None:
        return "this model's loss cannot be chunked"


def test_fragmentation_above_a_quarter_of_reserved_releases_the_cache(tmp_path: Path) -> None:
    MiB = 1 << 20
    events: list[dict[str, Any]] = []
    gov = Governor(resolve(compose(tmp_path / "run", "backend=cuda")), "cuda", events.append)
    gov.backend = be = _Frees()
    gov.after_step(3, {"inactive_split": 600 * MiB, "reserved": 2048 * MiB})  # 29 %: fragmented
    assert be.released == 1 and [e["action"] for e in events] == ["release_cache"]
    gov.after_step(4, {"inactive_split": 600 * MiB, "reserved": 4096 * MiB})  # 15 %: not
    assert be.released == 1 and len(events) == 1


def test_out_of_memory_at_micro_batch_1_turns_on_checkpointing_once(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    gov = Governor(resolve(compose(tmp_path / "run", "backend=cuda", "train.batch_size=1", "train.grad_accum=4")),
                   "cuda", events.append)
    gov.backend = be = _Frees()
    gov.on_oom(2, MemoryError("out of memory"))
    assert be.checkpointing == [True] and gov.grad_checkpointing
    assert [(e["action"], e["after"]) for e in events] == [("enable_grad_checkpointing", {"grad_checkpointing": True})]
    with pytest.raises(UserError, match=r"^out of memory at step 3 even at micro-batch 1 with gradient checkpointing"):
        gov.on_oom(3, MemoryError("out of memory"))


def test_the_data_pair_span_is_kept_for_every_later_plan(tmp_path: Path) -> None:
    """Packed, the governor plans with the data's attention pairs per position (data.build's
    pair_span) once told it, and keeps it for the plans after: a budget between the plan at the
    data's pair span and the plan at the row's bound fits as it is, while without the data's
    span the same budget needs an adaptation (checkpointing, on this model)."""
    from finetune import planner

    base = ("backend=mlx", "train.packing=true", "train.batch_size=8", "train.seq_len=512")
    spec = resolve(compose(tmp_path / "a", *base))
    narrow = planner.plan(spec, seq_len=512, recommend=False, pair_span=24.0)["peak_bytes"]
    wide = planner.plan(spec, seq_len=512, recommend=False)["peak_bytes"]
    assert narrow < wide
    budget = (narrow + wide) // 2
    events: list[dict[str, Any]] = []
    gov = Governor(resolve(compose(tmp_path / "b", *base, f"memory.budget={budget}")), "mlx", events.append)
    tokens = gov.state.tokens_per_micro
    gov.before_load(seq_len=512, pair_span=24.0)
    gov.before_load(seq_len=512)  # a later plan, told nothing new
    assert events == [] and gov.state.tokens_per_micro == tokens

    bound = Governor(resolve(compose(tmp_path / "c", *base, f"memory.budget={budget}")), "mlx", events.append)
    bound.before_load(seq_len=512)
    assert [e["action"] for e in events] == ["enable_grad_checkpointing"] and bound.grad_checkpointing
