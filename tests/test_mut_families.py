"""What this session's changed-lines mutation pass (session changed25) showed the quick tests let
through: each check here is one of the per-family checks (tests/test_family_plans.py,
tests/test_families.py) run for the families whose lines it exercises, so a mutant of those
lines meets it within seconds, and the layer pattern of an MoE with sparse steps, which no tiny
family has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAS_MLX, HAS_TORCH, REPO

pytestmark = pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both torch+peft and mlx-lm")


@pytest.mark.parametrize("name", ["qwen2_moe", "gemma3", "phi3", "gpt_oss"])
def test_cuda_kept_activations_of_the_families_with_their_own_terms(name: str, tmp_path: Path) -> None:
    """The shared expert (qwen2_moe), a masked sliding layer (gemma3), a fused qkv (phi3), the
    clamped SwiGLU experts (gpt_oss): the plan against torch's saved tensors, within 3%."""
    from test_family_plans import test_cuda_saved_tensors_match_activation_model_for_every_family as saved

    saved(name, tmp_path)


def test_mlx_peak_of_the_shared_expert(tmp_path: Path) -> None:
    """Qwen2-MoE's shared expert is 6% of this step's MLX peak: planned within 10% of the measured."""
    from test_family_plans import MLX_PEAK_SCRIPT

    cases = [("qwen2_moe", 4, 64, "null"), ("qwen2_moe", 4, 96, "all-linear")]
    script = MLX_PEAK_SCRIPT.format(tests=str(REPO / "tests"), cases=cases, run=str(tmp_path / "run"))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    for f, B, T, k, planned, peak in json.loads(r.stdout.strip().splitlines()[-1]):
        assert abs(planned / peak - 1) <= 0.10, (f, B, T, k, planned, peak)


@pytest.mark.parametrize("model_type, extra", [
    ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    ("qwen3_moe", {"decoder_sparse_step": 3, "mlp_only_layers": [1]}),
])
def test_moe_layers_with_sparse_steps_are_transformers_own(model_type: str, extra: dict) -> None:
    """Which layers run experts (decoder_sparse_step, mlp_only_layers) and every weight's count,
    against the model transformers builds from the same config (on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.planner.describe import describe

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


def test_every_family_planned_to_transformers_count() -> None:
    """The plan's inventory of every family of tests/families.py equals transformers' count:
    q/k/v biases, o_proj without (qwen2, qwen2_moe, glm4, gpt_oss), norms, shared experts."""
    from test_family_plans import test_auto_attention_is_transformers_own_choice as counts

    counts()
