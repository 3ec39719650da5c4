"""The governor's handling of memory.cache_limit as a user writes it: "auto" waits for the
first measured step, a size is set at once, anything else is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from finetune.config import compose
from finetune.errors import UserError
from finetune.governor import Governor
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
    with pytest.raises(UserError, match=r"=unlimited is not a size; use "):
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
