"""The chunked loss on a micro-batch with no target token (every completion cut away, a
packed row of prompts only): a loss of 0 whose gradients are 0, as the unchunked loss gives,
so the step goes on. The tiny model, real mlx. Written for survivors of the mutation run
(benchmarks/mutation/)."""

from __future__ import annotations

import numpy as np
import pytest


def _mlx_backend(method: str):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from finetune.backends.mlx.runtime import MlxBackend
    from finetune.config import Config, ModelConfig
    from finetune.resolver import resolve
    from finetune.model.tiny import build_tiny
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.backend.name, cfg.method.name = "mlx", method
    b = MlxBackend()
    b.setup(resolve(cfg), build_tiny(ModelConfig()))
    return b


@pytest.fixture(scope="module")
def mlx_lora():
    return _mlx_backend("lora")


def test_mlx_chunked_loss_of_a_batch_without_targets_is_zero_with_zero_gradients(mlx_lora):
    import mlx.core as mx
    from finetune.backends.mlx.loss import token_loss_sum
    from mlx import nn
    from mlx.utils import tree_flatten

    b = mlx_lora
    ids = mx.array(np.arange(3, 3 + 2 * 12, dtype=np.int32).reshape(2, 12))
    none = mx.zeros((2, 12), mx.float32)
    for chunk in (0, 4):  # the full logits, and chunks of 4 target tokens
        loss, grads = nn.value_and_grad(b.model, lambda m: token_loss_sum(m, ids, none, chunk, grad=True))(b.model)
        assert float(loss) == 0.0
        assert {k: float(mx.abs(g).max()) for k, g in tree_flatten(grads)} == {
            k: 0.0 for k, _ in tree_flatten(b.model.trainable_parameters())}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_mlx_chunked_loss_and_gradients_equal_the_full_logits(mlx_lora, method):
    """11 targets in chunks of 4 (4 + 4 + 3): the same loss with and without gradients, and
    the same gradients (LoRA's; with method=full the tied head's too, through the chunked
    loss's own backward), as the full [B, T, V] logits give."""
    import mlx.core as mx
    from finetune.backends.mlx.loss import token_loss_sum
    from mlx import nn
    from mlx.utils import tree_flatten

    b = mlx_lora if method == "lora" else _mlx_backend("full")
    ids = mx.array(np.arange(3, 3 + 2 * 12, dtype=np.int32).reshape(2, 12))
    mask = np.zeros((2, 12), np.float32)
    mask[0, 6:] = 1.0  # 6 targets, then 5 in the second row
    mask[1, 7:] = 1.0
    mask = mx.array(mask)

    def step(chunk: int):
        return nn.value_and_grad(b.model, lambda m: token_loss_sum(m, ids, mask, chunk, grad=True))(b.model)

    (full, g_full), (chunked, g_chunked) = step(0), step(4)
    assert float(chunked) == pytest.approx(float(full), rel=1e-5) and float(full) > 10  # ~ln(512) a target
    assert float(token_loss_sum(b.model, ids, mask, 4, grad=False)) == pytest.approx(float(full), rel=1e-5)
    want, got = dict(tree_flatten(g_full)), dict(tree_flatten(g_chunked))
    assert sorted(got) == sorted(want)
    for k in want:
        assert float(mx.abs(want[k]).max()) > 0 or "lora_a" in k  # lora_b starts at 0: only B gets a gradient
        np.testing.assert_allclose(np.array(got[k]), np.array(want[k]), rtol=1e-4, atol=1e-7)
