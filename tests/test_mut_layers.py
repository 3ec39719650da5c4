"""What the changed-lines mutation pass over this session's family work (session changed24) let
through: the layer names each backend reads off a loaded model, exactly, and the one-line error
for a multimodal checkpoint whose language model is not all there."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import HAS_MLX, HAS_TORCH, make_cfg
from families import build_family, build_multimodal

from finetune.errors import UserError
from finetune.resolver import resolve

LLAMA = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_cuda_reads_the_blocks_linear_layers_and_nothing_else() -> None:
    """What PEFT could target in the blocks: the linear leaves (GPT-2's Conv1D too), never the
    head, never a container or a norm."""
    import torch
    from finetune.backends.cuda.load import linear_names
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(str(build_family("llama")), dtype=torch.float32)
    assert linear_names(llama) == LLAMA
    gpt2 = AutoModelForCausalLM.from_pretrained(str(build_family("gpt2")), dtype=torch.float32)
    assert linear_names(gpt2) == {"c_attn", "c_proj", "c_fc"}


@pytest.mark.skipif(not HAS_MLX, reason="needs mlx")
def test_mlx_reads_the_blocks_linear_layers_and_nothing_else(tmp_path: Path) -> None:
    from finetune.backends.mlx.runtime import MlxBackend

    be = MlxBackend()
    be.setup(resolve(make_cfg(tmp_path, f"model.path={build_family('llama')}", "backend=mlx", "method=full")),
             build_family("llama"))  # full: no LoRA layer wraps a projection
    assert be._block_linears() == {f"self_attn.{k}": False for k in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
        f"mlp.{k}": False for k in ("gate_proj", "up_proj", "down_proj")}
    moe = MlxBackend()
    moe.setup(resolve(make_cfg(tmp_path, f"model.path={build_family('mixtral')}", "backend=mlx", "method=full")),
              build_family("mixtral"))
    got = moe._block_linears()
    assert {k for k, stacked in got.items() if stacked} == {f"block_sparse_moe.switch_mlp.{k}"
                                                            for k in ("gate_proj", "up_proj", "down_proj")}, got


@pytest.mark.skipif(not (HAS_TORCH and HAS_MLX), reason="needs torch")
def test_a_multimodal_checkpoint_missing_a_language_weight_is_refused_naming_it(tmp_path: Path) -> None:
    """Two text weights gone from the file: not random weights silently, one line naming how
    many and the first (sorted) of them."""
    from finetune.model.safetensors_io import read_safetensors, write_safetensors
    from finetune.model.source import load_causal_lm

    src = build_multimodal("gemma3")
    dst = tmp_path / "mm"
    shutil.copytree(src, dst)
    tensors, meta = read_safetensors(dst / "model.safetensors")
    del tensors["language_model.model.norm.weight"], tensors["language_model.model.layers.1.mlp.up_proj.weight"]
    write_safetensors(dst / "model.safetensors", tensors, meta)
    with pytest.raises(UserError) as e:
        load_causal_lm(dst)
    msg = str(e.value)
    assert "\n" not in msg and "2 of its weights are missing, model.layers.1.mlp.up_proj.weight first" in msg, msg
