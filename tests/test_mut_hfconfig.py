"""config.json in the words mlx-lm reads: gemma3's period of global layers taken from
layer_types (transformers keeps a stale one), and no period invented for other models."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.backends.mlx.hfconfig import model_config, normalise

# 6 layers, every third global: period 3, while transformers still says 6
GEMMA3 = {"model_type": "gemma3_text", "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}


def test_gemma3_takes_its_period_from_layer_types() -> None:
    assert normalise(GEMMA3)["sliding_window_pattern"] == 3


def test_other_models_with_layer_types_get_no_period() -> None:
    qwen3 = {"model_type": "qwen3", "rope_theta": 1_000_000.0, "layer_types": ["full_attention"] * 4}
    assert normalise(qwen3) == qwen3
    gemma2 = {"model_type": "gemma2", "rope_theta": 10_000.0,
              "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert "sliding_window_pattern" not in normalise(gemma2)


def test_model_config_hands_mlx_lm_the_corrected_period(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3))
    assert model_config(tmp_path) == {"sliding_window_pattern": 3}
