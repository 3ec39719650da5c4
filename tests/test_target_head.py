"""The output head only at target positions (both backends), on the built-in tiny Qwen2 with a
vocabulary of 2,048 (so the head matters), tied and untied.

Asserted: the loss sum and every trained parameter's gradient with the head on target rows
only equal those with the head on every position (``target_head=False``), with masked prompts
and padding, packed or not, with and without the chunked loss; a model whose logits are not
its head applied to its hidden states, nor a transform of them finetune knows (tests/odd_heads.py),
falls back to every position and says why, its loss the full head's. Soft-capped and scaled
logits: tests/test_post_head.py.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import needs_mlx, needs_torch
from finetune.backends.base import Batch, pack
from test_chunked_loss import assert_grads_equal

from finetune.config import Config, ModelConfig
from finetune.resolver import resolve
from finetune.model.tiny import build_tiny, preset_config

V = 2048


def vocab(tie: bool) -> ModelConfig:
    m = ModelConfig()
    m.config = {**dict(preset_config("tiny") or ()), "vocab_size": V, "tie_word_embeddings": tie}
    return m


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model(request: Any) -> tuple[Path, bool]:
    return build_tiny(vocab(request.param)), request.param


def make_batch() -> Batch:
    """Rows of 65, 40, 22 real tokens, right-padded; the first 12 tokens of each a prompt."""
    rng = np.random.default_rng(5)
    lengths = np.array([65, 40, 22], np.int32)
    ids = rng.integers(1, V, (3, 65)).astype(np.int32)
    mask = np.zeros((3, 65), np.int8)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
        mask[i, 12:n] = 1
    return Batch(ids, mask, lengths)




def _cfg(m: ModelConfig) -> Any:
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.model = OmegaConf.structured(m)
    cfg.method.name = "full"
    return cfg


# ---- torch (backend=cuda, on the CPU here) ----------------------------------------------------
@needs_torch
def test_torch_target_head_equals_full_head(model: tuple[Path, bool]) -> None:
    import torch
    from finetune.backends.cuda import loss as loss_mod
    from finetune.backends.cuda.runtime import CudaBackend

    path, tie = model
    cfg = _cfg(vocab(tie))
    cfg.backend.name, cfg.backend.device, cfg.precision.name = "cuda", "cpu", "32-true"
    be = CudaBackend()
    be.setup(resolve(cfg), path)

    def step(b: Batch, chunk: int, target: bool) -> tuple[float, dict[str, np.ndarray]]:
        be.zero_grad()
        ids = torch.from_numpy(b.input_ids.astype(np.int64))
        pos = None if b.position_ids is None else torch.from_numpy(b.position_ids.astype(np.int64))
        loss = loss_mod.token_loss_sum(be.model, ids, None, torch.from_numpy(b.loss_mask.astype(np.float32)), chunk,
                                       be._autocast, position_ids=pos, target_head=target)
        loss.backward()
        grads = {n: p.grad.numpy().copy() for n, p in be.model.named_parameters() if p.grad is not None}
        be.zero_grad()
        return float(loss.detach()), grads

    for b in (make_batch(), pack(make_batch(), 1000)[0]):
        want_loss, want = step(b, 0, False)
        for chunk in (0, 17):
            loss, grads = step(b, chunk, True)
            assert loss == pytest.approx(want_loss, rel=1e-5), chunk
            assert_grads_equal(grads, want)
    assert loss_mod.head_fallback(be.model) is None


@needs_torch
def test_torch_model_with_an_unknown_transform_after_the_head_falls_back() -> None:
    import torch
    from finetune.backends.cuda.loss import head_fallback, token_loss_sum
    from odd_heads import ODD_VOCAB, torch_doubled

    model = torch_doubled()
    ids = torch.randint(0, ODD_VOCAB, (2, 9))
    mask = torch.ones(2, 9)
    mask[:, :4] = 0
    got = float(token_loss_sum(model, ids, None, mask, 0, nullcontext).detach())
    assert got == pytest.approx(float(token_loss_sum(model, ids, None, mask, 0, nullcontext, target_head=False).detach()))
    assert "finetune knows" in head_fallback(model)


# ---- mlx ----------------------------------------------------------------------------------------
@needs_mlx
def test_mlx_target_head_equals_full_head(model: tuple[Path, bool]) -> None:
    import mlx.core as mx
    from finetune.backends.mlx import loss as loss_mod
    from finetune.backends.mlx.runtime import MlxBackend
    from mlx import nn
    from mlx.utils import tree_flatten

    path, tie = model
    cfg = _cfg(vocab(tie))
    cfg.backend.name = "mlx"
    be = MlxBackend()
    be.setup(resolve(cfg), path)
    m = be.model

    def step(b: Batch, chunk: int, target: bool) -> tuple[float, dict[str, np.ndarray]]:
        ids, mask = mx.array(b.input_ids), mx.array(b.loss_mask.astype(np.float32))
        pos = None if b.position_ids is None else mx.array(b.position_ids)
        with loss_mod.packed(m, pos) as cache:
            loss, grads = nn.value_and_grad(m, lambda: loss_mod.token_loss_sum(m, ids, mask, chunk, cache=cache,
                                                                                target_head=target))()
            mx.eval(loss, grads)
        return float(loss), {k: np.array(v) for k, v in tree_flatten(grads)}

    for b in (make_batch(), pack(make_batch(), 1000)[0]):
        want_loss, want = step(b, 0, False)
        for chunk in (0, 17):
            loss, grads = step(b, chunk, True)
            assert loss == pytest.approx(want_loss, rel=1e-5), chunk
            assert_grads_equal(grads, want)
    assert loss_mod.head_fallback(m) is None


@needs_mlx
def test_mlx_model_with_an_unknown_transform_after_the_head_falls_back() -> None:
    import mlx.core as mx
    from finetune.backends.mlx.loss import head_fallback, token_loss_sum
    from odd_heads import ODD_VOCAB, mlx_doubled

    model = mlx_doubled()
    ids = mx.array(np.arange(18).reshape(2, 9) % ODD_VOCAB)
    mask = mx.array(np.r_[np.zeros(4), np.ones(5)][None].repeat(2, 0).astype(np.float32))
    got = float(token_loss_sum(model, ids, mask, 0))
    assert got == pytest.approx(float(token_loss_sum(model, ids, mask, 0, target_head=False)))
    assert "its __call__ transforms them" in head_fallback(model)
