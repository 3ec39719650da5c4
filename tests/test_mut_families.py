"""What this session's changed-lines mutation pass (session changed25) showed no test checked:
the layer pattern of an MoE with sparse steps (decoder_sparse_step, mlp_only_layers), which no
tiny family has. (Its other deferred mutants were killed by the per-family checks of
tests/test_family_plans.py, run for the families whose lines they touch: `mut.py recheck`.)"""

from __future__ import annotations

import pytest
from conftest import HAS_TORCH

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="needs torch and transformers")


@pytest.mark.parametrize("model_type, extra", [
    ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    ("qwen3_moe", {"decoder_sparse_step": 3, "mlp_only_layers": [1]}),
])
def test_moe_layers_with_sparse_steps_are_transformers_own(model_type: str, extra: dict) -> None:
    """Which layers run experts (decoder_sparse_step, mlp_only_layers) and every weight's count,
    against the model transformers builds from the same config (on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model.describe import describe

    cfg = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32,
                               num_experts=4, num_experts_per_tok=2, vocab_size=512, head_dim=16,
                               shared_expert_intermediate_size=96, **extra)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    want = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    desc = describe(cfg.to_dict(), model_type)
    assert [b.moe for b in desc.blocks] == want and any(want) and not all(want)
    assert desc.weight_elements() == sum(p.numel() for p in model.parameters())
