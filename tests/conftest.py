"""Shared test helpers: compose real configs the way the CLI does, into a temporary run dir."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from finetune.config import compose

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"

HAS_MLX = importlib.util.find_spec("mlx") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None


def make_cfg(run_dir: Path | str, *overrides: str) -> Any:
    """Compose conf/ with overrides, exactly as `finetune` would, with run_dir set."""
    return compose(run_dir, *overrides)


@pytest.fixture
def cfg_factory(tmp_path: Path):
    def _make(*overrides: str, run_dir: Path | None = None) -> Any:
        return make_cfg(run_dir or tmp_path / "run", *overrides)

    return _make


needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx not installed (pip install '.[mlx]')")
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed (bash scripts/setup.sh)")
needs_gsm8k = pytest.mark.skipif(not GSM8K.is_file(), reason=f"{GSM8K} absent (it ships beside the project checkout)")
