"""Chunked loss (train.loss_chunk) on both backends, on the tiny real Qwen2 with a large vocabulary.

The model is the built-in tiny (hidden 64, 2 layers) with vocab 8,192, so the logits dominate the
step: a batch of 4 x 129 tokens has 512 targets, and its fp32 logits are 512 x 8,192 x 4 B =
16 MiB, against kilobytes for the body's activations. The backends' own setup builds the models
(PEFT adapters on cuda, mlx-lm's LoRA layers on mlx). Asserted:
- loss and every trainable parameter's gradient equal the unchunked ones within float
  tolerance (LoRA and full, chunk sizes that do and do not divide the number of targets, a
  batch with masked prompts and padding, eval without gradients);
- memory, measured: torch on the CPU through the profiler's allocation records (every CPU
  allocation and free torch makes, in order, so the running sum's maximum is the step's peak)
  and the bytes autograd keeps for backward (saved-tensor hooks); MLX through mx.get_peak_memory.
  The chunked step's peak stays below one full logits tensor; the unchunked one's exceeds two.
  Memory figures are asserted as ratios to the logits' bytes, never times.
- a model that transforms its logits after the head (Gemma2's soft-capping) is refused.
"""

from __future__ import annotations

import gc
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import needs_mlx, needs_torch
from finetune.backends.base import Batch

from finetune.config import Config, ModelConfig
from finetune.resolver import resolve
from finetune.model.tiny import build_tiny, preset_config

V = 8192
B, T = 4, 129
TARGETS = B * (T - 1)  # every position a target in the "all" batch: 512
LOGITS_BYTES = TARGETS * V * 4  # 16 MiB of fp32 logits


def big_vocab(tie: bool = True) -> ModelConfig:
    m = ModelConfig()
    m.config = {**dict(preset_config("tiny") or ()), "vocab_size": V, "tie_word_embeddings": tie}
    return m


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny(big_vocab())


@pytest.fixture(scope="module")
def untied_dir() -> Path:
    return build_tiny(big_vocab(tie=False))


def make_batch(kind: str) -> Batch:
    """"all": every position a target (512 targets); "masked": a 9-token prompt out of the loss
    and rows of 129, 100, 61 and 30 real tokens, right-padded (the tokenizer is irrelevant here:
    ids are drawn over the whole vocabulary so every row of the head matters)."""
    rng = np.random.default_rng(7)
    ids = rng.integers(1, V, (B, T)).astype(np.int32)
    if kind == "all":
        return Batch(ids, np.ones((B, T), np.int8), np.full(B, T, np.int32))
    lengths = np.array([129, 100, 61, 30], np.int32)
    mask = np.zeros((B, T), np.int8)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
        mask[i, 9:n] = 1
    return Batch(ids, mask, lengths)


def assert_grads_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys() and want
    for name, w in want.items():
        scale = float(np.abs(w).max()) or 1.0
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


# ---- torch (backend=cuda, on the CPU here) ------------------------------------------------------
def torch_backend(model_dir: Path, method: str, precision: str = "32-true", keys: list[str] | None = None,
                  tie: bool = True, dropout: float = 0.0) -> Any:
    from finetune.backends.cuda.runtime import CudaBackend
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(Config(run_dir="unused"))  # as the CLI composes it
    cfg.model = OmegaConf.structured(big_vocab(tie))
    cfg.backend.name, cfg.backend.device = "cuda", "cpu"
    cfg.method.name, cfg.precision.name = method, precision
    cfg.method.lora.dropout = dropout
    if keys:
        cfg.method.lora.keys = keys
    be = CudaBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        be.setup(resolve(cfg), model_dir)
    return be


def torch_inputs(batch: Batch) -> tuple[Any, Any, Any]:
    import torch

    ids = torch.from_numpy(batch.input_ids.astype(np.int64))
    attn = (torch.arange(ids.shape[1])[None, :] < torch.from_numpy(batch.lengths.astype(np.int64))[:, None]).long()
    return ids, attn, torch.from_numpy(batch.loss_mask.astype(np.float32))


def torch_step(be: Any, batch: Batch, chunk: int) -> tuple[float, dict[str, np.ndarray]]:
    from finetune.backends.cuda.loss import token_loss_sum

    be.zero_grad()
    loss = token_loss_sum(be.model, *torch_inputs(batch), chunk, be._autocast)
    loss.backward()
    grads = {n: p.grad.detach().float().numpy().copy() for n, p in be.model.named_parameters() if p.requires_grad}
    be.zero_grad()
    return float(loss.detach()), grads


@needs_torch
@pytest.mark.parametrize("method", ["lora", "full", "qlora"])
def test_torch_chunked_equals_unchunked(model_dir: Path, method: str) -> None:
    """32 divides the 512 targets, 48 does not; the masked batch has 120 + 91 + 52 + 21 = 284
    targets, in chunks of 7. Full trains the tied embedding, so the head's weight gets its gradient
    from both the chunks and the embedding lookup."""
    be = torch_backend(model_dir, method)
    for kind, chunks in (("all", (32, 48)), ("masked", (7,))):
        batch = make_batch(kind)
        want_loss, want = torch_step(be, batch, 0)
        for chunk in chunks:
            loss, grads = torch_step(be, batch, chunk)
            assert loss == pytest.approx(want_loss, rel=1e-5), (kind, chunk)
            assert_grads_equal(grads, want)


@needs_torch
@pytest.mark.parametrize("method,keys", [("full", None), ("lora", ["q_proj", "v_proj", "lm_head"])])
def test_torch_untied_head_trainable(untied_dir: Path, method: str, keys: list[str] | None) -> None:
    """An untied lm_head, trained whole (full) or through a LoRA adapter on it: the adapter is
    part of the head module the chunks call."""
    be = torch_backend(untied_dir, method, keys=keys, tie=False)
    batch = make_batch("masked")
    want_loss, want = torch_step(be, batch, 0)
    if keys:
        assert any("lm_head" in n for n in want)
    loss, grads = torch_step(be, batch, 50)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert_grads_equal(grads, want)


@needs_torch
def test_torch_bf16_mixed_within_bf16_tolerance(model_dir: Path) -> None:
    """Under bf16 autocast each chunk's head runs in bf16 as the unchunked head does; the
    gradients differ by bf16 rounding of differently split matmuls (2^-8 relative)."""
    be = torch_backend(model_dir, "full", precision="bf16-mixed")
    batch = make_batch("all")
    want_loss, want = torch_step(be, batch, 0)
    loss, grads = torch_step(be, batch, 48)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    for name, w in want.items():
        np.testing.assert_allclose(grads[name], w, rtol=2e-2, atol=2e-2 * float(np.abs(w).max()), err_msg=name)


@needs_torch
def test_torch_dropout_draws_the_same_masks(model_dir: Path) -> None:
    """LoRA dropout 0.1: from the same seed the chunked step draws the same dropout masks as the
    unchunked one (the one-time head check runs in eval mode and draws nothing), so the numbers
    still agree."""
    import torch

    be = torch_backend(model_dir, "lora", dropout=0.1)
    batch = make_batch("masked")
    torch.manual_seed(1)
    want_loss, want = torch_step(be, batch, 0)
    torch.manual_seed(1)
    loss, grads = torch_step(be, batch, 40)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert_grads_equal(grads, want)
    torch.manual_seed(2)  # dropout is on: another seed, other gradients (LoRA B starts at 0, the loss not)
    other = torch_step(be, batch, 40)[1]
    assert any(not np.allclose(other[k], want[k], rtol=1e-3) for k in want)


@needs_torch
def test_torch_eval_and_no_targets(model_dir: Path) -> None:
    import torch
    from finetune.backends.cuda.loss import token_loss_sum

    be = torch_backend(model_dir, "lora")
    batch = make_batch("masked")
    ids, attn, mask = torch_inputs(batch)
    with torch.no_grad():
        want = float(token_loss_sum(be.model, ids, attn, mask, 0, be._autocast))
        assert float(token_loss_sum(be.model, ids, attn, mask, 33, be._autocast)) == pytest.approx(want, rel=1e-5)
    empty = token_loss_sum(be.model, ids, attn, torch.zeros_like(mask), 33, be._autocast)
    empty.backward()  # a 0 loss that still backpropagates, as the unchunked one does
    assert float(empty.detach()) == 0.0


def torch_peak_and_saved(be: Any, batch: Batch, chunk: int) -> tuple[int, int]:
    """(peak bytes torch allocated on the CPU during forward + backward above what was live
    before, bytes of non-parameter storages autograd kept for backward at the end of forward)."""
    from finetune.backends.cuda.loss import token_loss_sum
    from finetune.backends.cuda.measure import SavedBytes, profiled_peak
    from torch.profiler import ProfilerActivity, profile

    kept = SavedBytes(be.model)
    ids, attn, mask = torch_inputs(batch)
    be.zero_grad()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with kept.hooks():
            loss = token_loss_sum(be.model, ids, attn, mask, chunk, be._autocast)
        gc.collect()
        saved = kept.bytes
        loss.backward()
    be.zero_grad()
    return profiled_peak(prof), saved


@needs_torch
@pytest.mark.parametrize("method", ["lora", "full"])
def test_torch_chunked_step_never_holds_the_logits(model_dir: Path, method: str) -> None:
    """Measured on this CPU: unchunked, the step peaks at about 3.2 x the 16 MiB logits (logits,
    their contiguous copy, log-softmax, its gradient) and keeps 2.4 x for backward; in chunks
    of 32 tokens the peak is 0.4 x (LoRA) to 0.6 x (full: the head's fp32 gradient [V, H]
    lives from forward to backward) and backward keeps the hidden states' gradient, no logits."""
    be = torch_backend(model_dir, method)
    batch = make_batch("all")
    peak_full, saved_full = torch_peak_and_saved(be, batch, 0)
    peak_chunked, saved_chunked = torch_peak_and_saved(be, batch, 32)
    assert peak_full > 2 * LOGITS_BYTES, peak_full  # the measurement sees the logits
    assert saved_full > LOGITS_BYTES, saved_full
    assert peak_chunked < LOGITS_BYTES, (peak_chunked, peak_full)
    assert peak_full - peak_chunked > 2 * LOGITS_BYTES
    assert saved_chunked < LOGITS_BYTES / 2, (saved_chunked, saved_full)


@needs_torch
def test_torch_refuses_logits_transformed_after_the_head_unknown_way() -> None:
    """A model that does something to its logits after lm_head that finetune does not know
    (tests/odd_heads.py: doubles them): the chunked path would train a different loss, so it
    refuses, naming the fix; unchunked it runs. (Gemma-2's soft-cap, Granite's and Cohere's
    logit scales are known: tests/test_post_head.py.)"""
    import torch
    from finetune.backends.cuda.loss import UnsupportedModel, token_loss_sum
    from odd_heads import ODD_VOCAB, torch_doubled

    model = torch_doubled()
    ids = torch.randint(0, ODD_VOCAB, (2, 9))
    attn, mask = torch.ones_like(ids), torch.ones(2, 9)
    assert float(token_loss_sum(model, ids, attn, mask, 0, nullcontext).detach()) > 0
    with pytest.raises(UnsupportedModel, match="train.loss_chunk=0"):
        token_loss_sum(model, ids, attn, mask, 4, nullcontext)


# ---- mlx -----------------------------------------------------------------------------------
def mlx_backend(model_dir: Path, method: str, dropout: float = 0.0, precision: str | None = None) -> Any:
    from finetune.backends.mlx.runtime import MlxBackend
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.model = OmegaConf.structured(big_vocab())
    cfg.backend.name, cfg.method.name = "mlx", method
    cfg.method.lora.dropout = dropout
    if precision:
        cfg.precision.name = precision
    be = MlxBackend()
    be.setup(resolve(cfg), model_dir)
    return be


def mlx_step(model: Any, batch: Batch, chunk: int) -> tuple[float, dict[str, np.ndarray], int]:
    """(loss, gradients, peak bytes above the resting ones) of one value_and_grad evaluation."""
    import mlx.core as mx
    from finetune.backends.mlx.loss import token_loss_sum
    from mlx import nn
    from mlx.utils import tree_flatten

    ids, mask = mx.array(batch.input_ids), mx.array(batch.loss_mask.astype(np.float32))
    vg = nn.value_and_grad(model, lambda: token_loss_sum(model, ids, mask, chunk))
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    resting = mx.get_active_memory()
    loss, grads = vg()
    mx.eval(loss, grads)
    peak = mx.get_peak_memory() - resting
    return float(loss), {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(grads)}, peak


@needs_mlx
@pytest.mark.parametrize("method", ["lora", "full", "qlora"])
def test_mlx_chunked_equals_unchunked(model_dir: Path, method: str) -> None:
    """As on torch: 32 divides the 512 targets, 48 does not, the masked batch in chunks of 7.
    qlora: the tied head is mlx's quantized embedding (as_linear), frozen."""
    be = mlx_backend(model_dir, method)
    for kind, chunks in (("all", (32, 48)), ("masked", (7,))):
        batch = make_batch(kind)
        want_loss, want, _ = mlx_step(be.model, batch, 0)
        for chunk in chunks:
            loss, grads, _ = mlx_step(be.model, batch, chunk)
            assert loss == pytest.approx(want_loss, rel=1e-5), (kind, chunk)
            assert_grads_equal(grads, want)


@needs_mlx
def test_mlx_bf16_true_within_bf16_tolerance(model_dir: Path) -> None:
    """bf16 weights, trained whole: the chunks' head gradients are summed in fp32, the rest is
    bf16 rounding of differently split matmuls."""
    be = mlx_backend(model_dir, "full", precision="bf16-true")
    batch = make_batch("all")
    want_loss, want, _ = mlx_step(be.model, batch, 0)
    loss, grads, _ = mlx_step(be.model, batch, 48)
    assert loss == pytest.approx(want_loss, rel=1e-3)
    for name, w in want.items():
        np.testing.assert_allclose(grads[name], w, rtol=2e-2, atol=2e-2 * float(np.abs(w).max()), err_msg=name)


@needs_mlx
def test_mlx_dropout_draws_the_same_masks(model_dir: Path) -> None:
    """As on torch: LoRA dropout 0.1, the same seed, the same numbers chunked or not."""
    import mlx.core as mx

    be = mlx_backend(model_dir, "lora", dropout=0.1)
    batch = make_batch("masked")
    mx.random.seed(1)
    want_loss, want, _ = mlx_step(be.model, batch, 0)
    mx.random.seed(1)
    loss, grads, _ = mlx_step(be.model, batch, 40)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert_grads_equal(grads, want)
    mx.random.seed(2)  # dropout is on: another seed, other gradients (LoRA B starts at 0, the loss not)
    other = mlx_step(be.model, batch, 40)[1]
    assert any(not np.allclose(other[k], want[k], rtol=1e-3) for k in want)


@needs_mlx
def test_mlx_eval_mode_and_no_targets(model_dir: Path) -> None:
    """In eval mode (MlxBackend.eval_loss) the chunks' gradients are not built; the sum is the
    same. A batch without targets gives 0 and still differentiates."""
    import mlx.core as mx
    from finetune.backends.mlx.loss import token_loss_sum

    be = mlx_backend(model_dir, "lora")
    batch = make_batch("masked")
    ids, mask = mx.array(batch.input_ids), mx.array(batch.loss_mask.astype(np.float32))
    want = float(token_loss_sum(be.model, ids, mask, 0))
    be.model.eval()
    assert float(token_loss_sum(be.model, ids, mask, 33)) == pytest.approx(want, rel=1e-5)
    be.model.train()
    empty = np.zeros_like(batch.loss_mask)
    loss, grads, _ = mlx_step(be.model, Batch(batch.input_ids, empty, batch.lengths), 33)
    assert loss == 0.0 and all(np.all(g == 0) for g in grads.values())


@needs_mlx
@pytest.mark.parametrize("method", ["lora", "full"])
def test_mlx_chunked_peak_below_the_logits(model_dir: Path, method: str) -> None:
    """mx.get_peak_memory over one value_and_grad evaluation, above the resting bytes, on 32 rows
    of 33 tokens (1,024 targets: 32 MiB of fp32 logits). Measured on the CPU backend: unchunked
    about 4.5 x the logits; in chunks of 16 tokens 0.43 x (LoRA) and 0.75 x (full). The head's
    share is about 11 x one chunk's [16, V] fp32 logits (MLX's scheduler overlaps two or three
    chunks) whatever the number of chunks; the rest is the body's activations, which grow with
    the tokens as they do unchunked, and for full the gradients, [V, H] for the head among them."""
    be = mlx_backend(model_dir, method)
    rows, cols = 32, 33
    ids = np.random.default_rng(7).integers(1, V, (rows, cols)).astype(np.int32)
    batch = Batch(ids, np.ones_like(ids, np.int8), np.full(rows, cols, np.int32))
    logits_bytes = rows * (cols - 1) * V * 4
    _, _, peak_full = mlx_step(be.model, batch, 0)
    _, _, peak_chunked = mlx_step(be.model, batch, 16)
    assert peak_full > 2 * logits_bytes, peak_full  # the measurement sees the logits
    assert peak_chunked < logits_bytes, (peak_chunked, peak_full)


@needs_mlx
def test_mlx_refuses_logits_transformed_after_the_head_unknown_way() -> None:
    import mlx.core as mx
    from finetune.backends.mlx.loss import UnsupportedModel, token_loss_sum
    from odd_heads import ODD_VOCAB, mlx_doubled

    model = mlx_doubled()
    ids, mask = mx.array(np.arange(18).reshape(2, 9) % ODD_VOCAB), mx.ones((2, 9))
    assert float(token_loss_sum(model, ids, mask, 0)) > 0
    with pytest.raises(UnsupportedModel, match="its __call__ transforms them"):
        token_loss_sum(model, ids, mask, 4)
