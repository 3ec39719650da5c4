"""Packing on every family users train, not only the tiny Qwen2 (issue 23): on backend=cuda the
loss of a step packed into micro-batches (pads filling all but the last, positions restarting per
sample) equals the unpacked step's, for dense, MoE, fused-projection, soft-capped, sliding-window
and plain-MLP families (tests/families.py). The samples are longer than the families' 8-token
sliding windows, so a packed row's block mask must compose with the window."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from conftest import needs_mlx, needs_torch
from families import FAMILIES, VOCAB, build_family

from finetune import planner
from finetune.backends.base import Batch, pack
from finetune.config import compose
from finetune.errors import UserError
from finetune.resolver import resolve

pytestmark = needs_torch
# the families mlx-lm loads (it reads gpt-oss's experts only in the hub's MXFP4 layout)
MLX_FAMILIES = sorted(set(FAMILIES) - {"gpt_oss"})
LENGTHS = (30, 21, 14, 9)  # 74 tokens: packed at 32, three micro-batches, two of them with pads


def _batch() -> Batch:
    rng = np.random.default_rng(5)
    ids = np.zeros((len(LENGTHS), max(LENGTHS)), np.int32)
    mask = np.zeros_like(ids, dtype=np.int8)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = rng.integers(1, VOCAB, n)
        mask[i, 3:n] = 1  # a 3-token prompt out of the loss
    return Batch(ids, mask, np.array(LENGTHS, np.int32), np.arange(len(LENGTHS)))


def _losses(name: str, tmp_path: Any) -> tuple[float, float, str]:
    from finetune.backends.cuda.runtime import CudaBackend

    cfg = compose(tmp_path / "run", f"model.path={build_family(name)}", "backend=cuda", "backend.device=cpu",
                  "method=full", "precision=32-true", "train.packing=true")
    be = CudaBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        be.setup(resolve(cfg), build_family(name))
    batch = _batch()
    parts = pack(batch, 32)
    assert len(parts) == 3 and [p.input_ids.shape[1] for p in parts[:2]] == [32, 32]  # pads in two
    whole = be.forward_backward(batch, 1.0)
    be.zero_grad()
    packed = sum(be.forward_backward(p, 1.0) for p in parts)
    # the plan names the path the runtime took, word for word
    assert planner.plan(resolve(cfg), recommend=False)["packing"]["attention"] == be.packed_attention, name
    return whole, packed, be.packed_attention


# transformers 5.24's gpt-oss attention lets a packed row's samples see each other (a packed step's
# loss differs by 0.03-0.14%): the backend's own check refuses it before training
LEAKS = {"gpt_oss": "gpt_oss's attention in transformers does not keep a packed row's samples apart"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_packed_equals_unpacked_on_every_family(name: str, tmp_path: Any) -> None:
    if name in LEAKS:
        with pytest.raises(UserError, match=LEAKS[name] + r" \(two samples packed differ .*; set train.packing=false"):
            _losses(name, tmp_path)
        return
    whole, packed, path = _losses(name, tmp_path)
    assert packed == pytest.approx(whole, rel=1e-5), (name, whole, packed)
    # every sdpa family runs its packed rows a sample at a time (backends/cuda/varlen.py), windows
    # and all; gemma2's soft-capping runs eager, with transformers' block mask
    assert path.startswith("eager with transformers'" if name == "gemma2" else "sdpa per sample"), (name, path)


# ---- mlx: the same step through mlx-lm's models, attention one sample at a time --------------------
def _mlx_losses(name: str, tmp_path: Any) -> tuple[float, float, str]:
    from finetune.backends.mlx.runtime import MlxBackend

    cfg = compose(tmp_path / "run", f"model.path={build_family(name)}", "backend=mlx", "method=full",
                  "precision=32-true", "train.packing=true")
    be = MlxBackend()
    be.setup(resolve(cfg), build_family(name))
    batch = _batch()
    whole = be.forward_backward(batch, 1.0)
    be.zero_grad()
    packed = sum(be.forward_backward(p, 1.0) for p in pack(batch, 32))
    assert planner.plan(resolve(cfg), recommend=False)["packing"]["attention"] == be.packed_attention, name
    return whole, packed, be.packed_attention


@needs_mlx
@pytest.mark.parametrize("name", sorted(MLX_FAMILIES))
def test_mlx_packed_equals_unpacked_on_every_family(name: str, tmp_path: Any) -> None:
    """mlx-lm's models run a packed row one sample at a time (backends/mlx/loss.py _per_sample),
    gemma3's 8-token sliding window and all; gemma2, whose soft-capped attention computes its own
    scores, gets the row's block mask. The step's loss equals the unpacked one."""
    whole, packed, path = _mlx_losses(name, tmp_path)
    assert packed == pytest.approx(whole, rel=1e-5), (name, whole, packed)
    want = "the model's attention with a block-diagonal" if name == "gemma2" else "mx.fast.scaled_dot_product_attention per sample"
    assert path.startswith(want), (name, path)


def test_cuda_packed_attention_per_sample_equals_the_block_mask() -> None:
    """backends/cuda/varlen.py on its own: two rows of three samples (one past a 5-token sliding
    window, grouped-query heads) equal sdpa over transformers-style block-diagonal (windowed)
    causal masks, output and gradients; a model that hands it no positions is told so."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from finetune.backends.cuda import varlen

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal, sliding_window = 2, True, 5

    g = torch.Generator().manual_seed(0)
    lens = [[7, 3, 4], [2, 9, 3]]
    pos = torch.tensor([[i for n in row for i in range(n)] for row in lens])
    q = torch.randn(2, 4, 14, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 14, 8, generator=g, requires_grad=True) for _ in range(2))
    seg = torch.tensor([[s for s, n in enumerate(row) for _ in range(n)] for row in lens])
    i = torch.arange(14)
    mask = ((seg[:, :, None] == seg[:, None, :]) & (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 5))[:, None]
    got, _ = varlen.attention(Attn(), q, k, v, None, scaling=0.3, position_ids=pos)
    want, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.3)
    assert torch.allclose(got, want, atol=1e-6)
    g_got = torch.autograd.grad(got.square().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_got, g_want))
    with pytest.raises(varlen.NoPositions, match="does not pass position_ids"):
        varlen.attention(Attn(), q, k, v, None)


def test_cuda_a_model_whose_attention_gets_no_positions_keeps_the_block_mask() -> None:
    """Where a model's attention is handed no position_ids (the samples of a packed row cannot
    be told apart there), the runtime's check falls back from attention per sample to
    transformers' block mask, which the model builds from the positions itself, checks that,
    and says so: the tiny Llama with its attention's position_ids dropped on the way in."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.backends.cuda.load import packed_attention

    hf = AutoModelForCausalLM.from_pretrained(build_family("llama"), dtype=torch.float32, attn_implementation="sdpa")
    for layer in hf.model.layers:
        def forward(*a: Any, _orig: Any = layer.self_attn.forward, **k: Any) -> Any:
            k.pop("position_ids", None)
            return _orig(*a, **k)

        layer.self_attn.forward = forward
    path = packed_attention(hf, torch.device("cpu"))
    assert path == "sdpa with transformers' [1, 1, T, T] block-diagonal causal mask built from position_ids"
    assert hf.config._attn_implementation == "sdpa"  # the model's own sdpa again, not the per-sample one

