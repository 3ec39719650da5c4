"""A pair micro-batch's log-probabilities with each pair's prompt run once (the mlx preference step).

A pair's chosen and rejected rows begin with the same prompt tokens, and under causal attention
those positions' hidden states are the same in both rows. ``pair_logps`` lays a micro-batch of P
pairs out as one packed row: per pair, the chosen row up to its last target, then the rejected
row's tokens after the shared prompt (its positions continuing the prompt's, p, p + 1, ...).
Each layer's attention runs segment by segment (``_tree_sdpa``): the chosen segment causal over
itself, the rejected segment causal over the pair's prompt keys followed by its own (MLX's
"causal" mask with fewer queries than keys is aligned at the end: query i sees every prompt key
and the rejected keys up to its own). RoPE takes each token's own position (loss.py
``_PackedRoPE``, as packing does). So the prompt goes through every layer once instead of twice,
no pad position goes through any, and the head runs on the target positions only (each row's
target t is predicted from position t - 1: for the rejected row's first target, the prompt's
last position, shared): the same log-probabilities as ``row_logps`` over the padded 2P rows, in
exact arithmetic (the prefix-sharing of Wang et al. 2024, "Accelerating Direct Preference
Optimization with Prefix Sharing", arXiv:2410.20305).

What is shared is the prompt only: positions before either row's first target, where the two
rows' tokens agree. A completion's tokens are never shared, even where chosen and rejected begin
alike, so the saving is what real preference data gives (its prompts), not an artefact of a
data set whose rejected answer repeats the chosen one.

Checked once per model (``_check``) on a short random pair in eval mode against ``row_logps``;
a model whose attention does not go through mlx-lm's ``scaled_dot_product_attention`` with the
cache's mask, that has no ``rope`` module, or whose head is not its body's output transformed as
loss.py knows (``_head_applies``) keeps the padded rows, and the log says why once.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from finetune.data.pair_layout import Layout
from finetune.backends.mlx.loss import (_head_applies, _model_modules, _PackedRoPE, _SampleMask, output_head,
                                        segment_sdpa)

log = logging.getLogger("finetune")

_CHECKED: dict[int, tuple[weakref.ref, str | None]] = {}  # id(model): (model, why not, or None: it applies)


class _TreeCache:
    """What each layer gets as its ``cache`` for a shared-prompt row: ``make_mask`` hands back
    the "causal" marker (with the layer's window), ``update_and_fetch`` passes keys and values
    through, and ``spans`` lists each segment's [start, end) and its prompt's [start, end) (None
    for a chosen segment, whose prompt is its own beginning)."""

    offset = 0  # rope(offset=cache.offset): _PackedRoPE reads the positions instead

    def __init__(self, spans: list[tuple[int, int, tuple[int, int] | None]], positions: np.ndarray):
        self.spans = spans
        self.positions = positions
        self.calls = 0  # attentions run segment by segment (0: the model computed its own)

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        if return_array:
            raise ValueError("a shared-prompt row has no one array mask")
        return _SampleMask(window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values


def _tree_segments(cache: Any, queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> Iterator[Any]:
    """A shared-prompt row's segments: each segment's queries over its keys (the rejected
    segment's: its prompt's keys, then its own), causal, a window applied from the positions
    where the layer has one."""
    cache.calls += 1
    for s, e, prompt in cache.spans:
        k, v = keys[:, :, s:e], values[:, :, s:e]
        kpos = cache.positions[s:e]
        if prompt is not None:
            ps, pe = prompt
            k = mx.concatenate([keys[:, :, ps:pe], k], axis=2)
            v = mx.concatenate([values[:, :, ps:pe], v], axis=2)
            kpos = np.concatenate([cache.positions[ps:pe], kpos])
        m: Any = "causal"
        if mask.window and kpos[-1] - kpos[0] >= mask.window:
            q = cache.positions[s:e]
            m = mx.array((q[:, None] >= kpos[None]) & (q[:, None] < kpos[None] + mask.window))
        yield queries[:, :, s:e], k, v, m


def _tree_sdpa(original: Any) -> Any:
    """mlx-lm's ``scaled_dot_product_attention`` for a shared-prompt row (``_tree_segments``);
    anything else goes to ``original``."""
    return segment_sdpa(original, _TreeCache, _tree_segments)


@contextmanager
def _tree(model: nn.Module, positions: np.ndarray,
          spans: list[tuple[int, int, tuple[int, int] | None]]) -> Iterator[list[_TreeCache]]:
    """Within it, ``model``'s body runs a shared-prompt row: each attention's ``rope`` shadowed
    by per-token positions, the model modules' ``scaled_dot_product_attention`` by
    ``_tree_sdpa``; yields the per-layer caches to pass to ``model.model``. Restored on exit."""
    wrapped = []
    pos = mx.array(positions.astype(np.int32))
    for _, m in model.named_modules():
        if isinstance(m, nn.Module) and "rope" in m and callable(m["rope"]):
            object.__setattr__(m, "rope", _PackedRoPE(m["rope"], pos))
            wrapped.append(m)
    patched = [(mod, mod.scaled_dot_product_attention) for mod in _model_modules(model)]
    for mod, original in patched:
        mod.scaled_dot_product_attention = _tree_sdpa(original)
    try:
        yield [_TreeCache(spans, positions)] * len(model.layers)
    finally:
        for m in wrapped:
            object.__delattr__(m, "rope")
        for mod, original in patched:
            mod.scaled_dot_product_attention = original


def _logps(model: nn.Module, lay: Layout, caches: list[_TreeCache]) -> mx.array:
    """[rows] each row's summed target log-probabilities, fp32, from ``lay``'s row (inside
    ``_tree`` with ``caches``)."""
    hidden = model.model(mx.array(lay.ids), cache=caches)
    flat = hidden.reshape(-1, hidden.shape[-1])[mx.array(lay.gather)]
    logits = output_head(model)[1](flat).astype(mx.float32)
    picked = mx.take_along_axis(logits, mx.array(lay.targets)[:, None], axis=-1).squeeze(-1)
    return mx.array(lay.weights) @ (picked - mx.logsumexp(logits, axis=-1))


def applies(model: nn.Module) -> str | None:
    """None where ``pair_logps`` may run ``model``, else why not (checked once per model, in
    eval mode, on a short random pair against the padded rows' log-probs)."""
    got = _CHECKED.get(id(model))
    if got is not None and got[0]() is model:
        return got[1]
    why = _check(model)
    _CHECKED[id(model)] = (weakref.ref(model), why)
    if why:
        log.info("the pair step runs chosen and rejected as padded rows, each with its prompt: %s", why)
    return why


def _check(model: nn.Module) -> str | None:
    key = mx.random.key(0)
    vocab = int(output_head(model)[0].weight.shape[0])
    ids = np.array(mx.random.randint(1, vocab, (2, 14), key=key))
    ids[1, :6] = ids[0, :6]  # a 6-token prompt, then 8 and 6 completion tokens (the rejected padded)
    mask = np.zeros((2, 14), np.float32)
    mask[0, 6:] = 1
    mask[1, 6:12] = 1
    if not _head_applies(model, mx.array(ids)):
        return "the head is not the body's output as loss.py applies it"
    was = model.training
    model.eval()
    try:
        logits = model(mx.array(ids[:, :-1])).astype(mx.float32)  # the padded rows (preference.py row_logps)
        picked = mx.take_along_axis(logits, mx.array(ids[:, 1:, None]), axis=-1).squeeze(-1)
        want = ((picked - mx.logsumexp(logits, axis=-1)) * mx.array(mask[:, 1:])).sum(axis=1)
        lay = Layout(ids, mask)
        with _tree(model, lay.positions, lay.spans) as caches:
            got = _logps(model, lay, caches)
            mx.eval(got)
        diff = float(mx.abs(got - want).max())
    except (ValueError, TypeError, AttributeError, IndexError) as e:
        return f"{type(model).__name__}'s attention cannot run a shared-prompt row ({e})"
    finally:
        model.train(was)
    tol = 1e-4 * max(1.0, float(mx.abs(want).max()))
    if diff > tol:
        return f"{type(model).__name__}'s shared-prompt row differs from its padded rows by {diff:.3g} in the log-probs"
    return None


@contextmanager
def shared_rows(model: nn.Module, ids: np.ndarray, mask: np.ndarray) -> Iterator[Callable[[], mx.array] | None]:
    """Within it, a function giving [rows] each row's summed target log-probabilities (fp32) of a
    micro-batch of interleaved pairs, each pair's prompt run once: the numbers of
    ``preference.row_logps`` on the padded batch, up to rounding. None where the model keeps the
    padded rows (``applies``) or a row has no target. The block must hold the gradient's
    computation too: a checkpointed layer (train.grad_checkpointing) runs its forward again in
    the backward, and must find the row's positions and attention then."""
    lay = None
    if applies(model) is None:
        try:
            lay = Layout(ids, mask)
        except ValueError:
            lay = None
    if lay is None:
        yield None
        return
    with _tree(model, lay.positions, lay.spans) as caches:
        yield lambda: _logps(model, lay, caches)
