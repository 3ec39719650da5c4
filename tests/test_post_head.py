"""Logits transformed after the head, position by position: Gemma-2's final soft-capping
(tanh(x / 30) x 30), Granite's ``logits_scaling`` (x / 4) and Cohere's ``logit_scale`` (x x 0.25),
on tiny real checkpoints of each (tests/families.py), both backends.

The head on target rows only, and the chunked loss, apply the model's own transform to their
rows: loss and every trained gradient equal the full head's (every position's logits, the
model's own forward), no fallback is taken, the governor's chunk lever accepts the model, and
the plan prices the head's target rows for them as for any model. A transform finetune does not
know still falls back (tests/test_target_head.py, tests/test_chunked_loss.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HAS_MLX, HAS_TORCH, make_cfg
from families import VOCAB, build_family
from test_chunked_loss import assert_grads_equal

from finetune import planner
from finetune.resolver import resolve

pytestmark = pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both torch+peft and mlx-lm")

# family -> the config field whose transform the head's rows must apply
CASES = {"gemma2": "final_logit_softcapping", "granite": "logits_scaling", "cohere": "logit_scale"}
CHUNK = 5


def _cfg(run: Path, name: str, backend: str) -> Any:
    return make_cfg(run, f"model.path={build_family(name)}", f"backend={backend}", "precision=32-true",
                    "train.seq_len=64", "train.batch_size=2", "method.lora.keys=all-linear")


def _rows() -> tuple[np.ndarray, np.ndarray]:
    """Two rows of 24 tokens, the first 8 of each a prompt (out of the loss), and a pad tail."""
    ids = np.random.default_rng(3).integers(1, VOCAB, (2, 24)).astype(np.int64)
    mask = np.ones((2, 24), np.float32)
    mask[:, :8] = 0
    mask[1, 20:] = 0
    return ids, mask


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_head_rows_and_chunks_apply_the_models_transform(name: str, tmp_path: Path) -> None:
    import torch
    from finetune.backends.cuda import loss as loss_mod
    from finetune.backends.cuda.runtime import CudaBackend

    be = CudaBackend()
    be.setup(resolve(_cfg(tmp_path, name, "cuda")), build_family(name))
    assert loss_mod.post_head(be.model)[0] == CASES[name]
    ids, mask = (torch.from_numpy(x) for x in _rows())

    def step(chunk: int, target: bool) -> tuple[float, dict[str, np.ndarray]]:
        be.zero_grad()
        loss = loss_mod.token_loss_sum(be.model, ids, None, mask, chunk, be._autocast, target_head=target)
        loss.backward()
        grads = {n: p.grad.numpy().copy() for n, p in be.model.named_parameters() if p.grad is not None}
        be.zero_grad()
        return float(loss.detach()), grads

    want_loss, want = step(0, False)  # the model's own forward: every position's logits
    assert want
    for chunk in (0, CHUNK):
        loss, grads = step(chunk, True)
        assert loss == pytest.approx(want_loss, rel=1e-5), chunk
        assert_grads_equal(grads, want)
    assert loss_mod.head_fallback(be.model) is None
    assert be.set_loss_chunk(CHUNK) is None and be._loss_chunk == CHUNK  # the governor's lever takes it


@pytest.mark.parametrize("name", sorted(CASES))
def test_mlx_head_rows_and_chunks_apply_the_models_transform(name: str, tmp_path: Path) -> None:
    import mlx.core as mx
    from finetune.backends.mlx import loss as loss_mod
    from finetune.backends.mlx.runtime import MlxBackend
    from mlx import nn
    from mlx.utils import tree_flatten

    be = MlxBackend()
    be.setup(resolve(_cfg(tmp_path, name, "mlx")), build_family(name))
    m = be.model
    assert loss_mod.post_head(m)[0] == CASES[name]
    ids, mask = _rows()
    m_ids, m_mask = mx.array(ids.astype(np.int32)), mx.array(mask)

    def step(chunk: int, target: bool) -> tuple[float, dict[str, np.ndarray]]:
        loss, grads = nn.value_and_grad(m, lambda: loss_mod.token_loss_sum(m, m_ids, m_mask, chunk,
                                                                            target_head=target))()
        mx.eval(loss, grads)
        return float(loss), {k: np.array(v) for k, v in tree_flatten(grads)}

    want_loss, want = step(0, False)
    for chunk in (0, CHUNK):
        loss, grads = step(chunk, True)
        assert loss == pytest.approx(want_loss, rel=1e-5), chunk
        assert_grads_equal(grads, want)
    assert loss_mod.head_fallback(m) is None
    assert be.set_loss_chunk(CHUNK) is None and be._loss_chunk == CHUNK


@pytest.mark.parametrize("backend", ["cuda", "mlx"])
def test_plan_prices_the_target_rows_of_a_soft_capped_head(backend: str, tmp_path: Path) -> None:
    """Gemma-2's logits (and their soft-cap's tanh) are priced on the target rows, as for a model
    without a soft-cap: half the rows targets, so less than with every row."""
    spec = resolve(_cfg(tmp_path, "gemma2", backend))
    arch, s = planner.resolve(spec, seq_len=64)
    assert arch.final_softcap
    s.target_fraction = 0.5
    _, half, _ = planner.activations(arch, s)
    s.target_fraction = 1.0
    _, every, _ = planner.activations(arch, s)
    assert s.head_rows(100) == 100 and half < every
