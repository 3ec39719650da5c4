"""The token loss of the ``mlx`` backend, whole or a chunk of tokens at a time (``train.loss_chunk``).

``token_loss_sum`` is what ``MlxBackend._loss`` differentiates with ``nn.value_and_grad``. With
``chunk = 0`` it is today's loss: ``model(ids[:, :-1])`` gives [B, T-1, V] logits, upcast to fp32
for cross-entropy (4 x 2048 x 152,064 x 4 B = 4.6 GiB with Qwen2's vocabulary, and on MLX's CPU
backend about four tensors of that size at the step's peak, measured). With ``chunk > 0`` the
model runs its body (``model.model``) and the head + fp32 cross-entropy run ``chunk`` tokens at
a time inside an ``mx.custom_function`` that takes each chunk's gradient (with respect to the
hidden states and the head's trainable weights) right there in the forward graph, as Liger does
on CUDA; its vjp only scales those by the incoming cotangent. So the head's matmul runs three
times per token as in the unchunked loss, none recomputed. ``mx.depends`` orders the chunks
(chunk k + 1's logits only after chunk k's loss and gradients): without it MLX's scheduler
works on many chunks at once and the peak grows with their number.

What that bounds, measured with ``mx.get_peak_memory`` on the CPU backend (tests and
``benchmarks/chunked_loss.py``): the head's share of the step's peak is about 9-12 x chunk x V
x 4 bytes whatever B x T is (a chunk alone peaks at 4 x: logits, softmax, the one-hot term and
their sum; two or three chunks overlap in MLX's scheduler), plus, when the head is trained, its
[V, H] gradient summed in fp32. MLX has no way to free a chunk sooner from inside a traced
function (an ``mx.eval`` there keeps the whole graph instead).

Target rows only, chunked or not (``target_head``): where the loss mask can be read (an
``nn.value_and_grad`` step; not under ``mx.compile``, which forbids reading arrays), the body's
hidden states at the rows that count are gathered and only they go through the head; a masked
row adds 0 to the sum and nothing to any gradient, so no number changes, and neither the
head's matmul nor the logits exist for prompt or pad tokens. What an mlx-lm model does to its
logits after the head, position by position (gemma2's final soft-capping, granite's
``logits_scaling``, cohere's ``logit_scale``), the head's chunks do too (``_POST_HEAD``). A model
whose logits are not its head (so transformed) applied to its body's output computes every
position's logits, and ``head_fallback`` says why.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_map

from finetune.backends.mlx.memory import PACKED_BLOCK_MASK, PACKED_PER_SAMPLE

_HEAD_CHECKED: dict[int, weakref.ref] = {}  # id(model): models whose logits are head(body)
_HEAD_REFUSED: dict[int, tuple[weakref.ref, str]] = {}  # id(model): (model, why its head runs everywhere)
# ModelArgs fields of mlx-lm models whose __call__ transforms the head's output position by
# position, and the transform, as their __call__ writes it (models/gemma2.py: tanh(out / cap) *
# cap; cohere.py, cohere2.py: out * logit_scale; granite.py: out / logits_scaling): the head's
# chunks apply it too
_POST_HEAD: dict[str, Any] = {
    "final_logit_softcapping": lambda x, cap: mx.tanh(x / cap) * cap,
    "logit_scale": lambda x, v: x * v,
    "logits_scaling": lambda x, v: x / v,
}
# fields of other mlx-lm models that transform the head's output some other way: refused by
# name where the numeric check cannot run (under mx.compile)
_POST_HEAD_ARGS = ("output_multiplier", "logit_softcap")



class UnsupportedModel(ValueError):
    """``chunk > 0`` on a model the chunked loss cannot reproduce exactly (its logits are not its
    head applied to the hidden states it feeds the head). The message names the fix."""

def token_loss_sum(model: nn.Module, ids: mx.array, mask: mx.array, chunk: int,
                   grad: bool | None = None, cache: list | None = None, target_head: bool = True) -> mx.array:
    """Sum of fp32 token cross-entropy over targets ``ids[:, 1:]`` weighted by ``mask[:, 1:]``.

    Args:
        model: an mlx-lm causal LM (``model.model`` the body, ``model.lm_head`` or a tied
            ``model.model.embed_tokens`` the head), LoRA layers and all.
        ids: [B, T] int32 token ids.
        mask: [B, T] float32 loss mask (the batch's own; column 0 is never a target).
        chunk: tokens per chunk of the head + cross-entropy; 0 computes the full logits.
        grad: whether the caller differentiates the result (MLX cannot tell from inside); None
            takes ``model.training`` (MlxBackend trains in train mode, evaluates in eval mode).
            False sums the chunks' losses without their gradients; differentiating that result
            still gives correct gradients, through MLX's own autodiff, but without the bound
            on the backward's memory.
        cache: for a packed row, what ``packed(model, positions)`` yields (entered around
            the whole ``value_and_grad``, so a recomputing backward sees it too); None for an
            unpacked batch.
        target_head: with ``chunk = 0``, the head on target rows only where the model allows
            it (``head_fallback``); False computes every position's logits.

    Returns:
        A 0-dim float32 array, differentiable with ``nn.value_and_grad(model, ...)``.

    Raises:
        UnsupportedModel: (a ValueError) ``chunk > 0`` on a model whose logits are not its head
            applied to its body's output (soft-capping, a logit scale), which the chunked path
            cannot reproduce.
    """
    if chunk <= 0 and not (target_head and _head_applies(model, ids)):
        logits = model(ids[:, :-1], cache=cache).astype(mx.float32)
        return (nn.losses.cross_entropy(logits, ids[:, 1:]) * mask[:, 1:]).sum()
    module, call = output_head(model)
    _check_head(model, call, ids)
    hidden = model.model(ids[:, :-1], cache=cache)
    return _head_sum(model, module, call, hidden, ids, mask, chunk, grad)


def _head_sum(model: nn.Module, module: nn.Module, call: Any, hidden: mx.array, ids: mx.array, mask: mx.array,
              chunk: int, grad: bool | None) -> mx.array:
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = ids[:, 1:].reshape(-1)
    weights = mask[:, 1:].reshape(-1).astype(mx.float32)
    rows = _target_rows(weights)
    if rows is not None:
        if rows.size == 0:
            return flat[:0].astype(mx.float32).sum()  # 0, still a function of the model
        index = mx.array(rows.astype(np.int32))
        flat, targets, weights = flat[index], targets[index], weights[index]
    if chunk <= 0:  # the target rows' logits at once (all rows under mx.compile, weighted by the mask)
        return _chunk_loss(module, call, {}, flat, targets, weights)
    if not (model.training if grad is None else grad):
        total, done = mx.array(0.0, mx.float32), None
        for s in range(0, flat.shape[0], chunk):
            h = flat[s:s + chunk] if done is None else mx.depends(flat[s:s + chunk], done)
            done = _chunk_loss(module, call, {}, h, targets[s:s + chunk], weights[s:s + chunk])
            total = total + done
        return total
    params = module.trainable_parameters()
    trainable = bool(tree_flatten(params))
    loss = _head_loss(module, call, chunk, trainable)
    return loss(params if trainable else {}, flat, targets, weights)[0]


class _PackedRoPE:
    """A model's RoPE at per-token positions: mx.fast.rope takes one offset per batch row, so
    the packed row [1, H, N, D] is turned into N rows of one token each, offset by that
    token's position (the same kernel and frequencies, each token rotated by its own position)."""

    def __init__(self, rope: Any, positions: mx.array):
        self.rope, self.positions, self.calls = rope, positions, 0

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        self.calls += 1
        return self.rope(x.swapaxes(0, 2), offset=self.positions).swapaxes(0, 2)


class _SampleMask(str):
    """What a packed row's cache hands its model as the attention mask: the string "causal",
    which every mlx-lm model passes through to ``scaled_dot_product_attention`` as it passes its
    own, carrying the layer's sliding window; ``_per_sample`` reads it with the cache's spans."""

    window: int | None

    def __new__(cls, window: int | None) -> _SampleMask:
        mask = super().__new__(cls, "causal")
        mask.window = window
        return mask


class _PackedCache:
    """What a packed forward hands each layer as its ``cache``: mlx-lm's models build their
    attention mask with ``cache.make_mask`` and pass keys and values through
    ``update_and_fetch`` (unchanged here). Per sample (``per_sample``): the mask is a
    ``_SampleMask`` and attention runs one sample at a time over ``spans``; else the mask is the
    row's block-diagonal causal [N, N] (a token sees the earlier tokens of its own sample only)."""

    offset = 0  # the model's rope(offset=cache.offset): _PackedRoPE uses the positions instead

    def __init__(self, positions: mx.array, per_sample: bool = True):
        pos = positions.reshape(-1)
        self.segment = mx.cumsum((pos == 0).astype(mx.int32))  # sample number of each token
        self.index = mx.arange(pos.shape[0])
        starts = [int(i) for i in np.flatnonzero(np.asarray(pos) == 0)]
        if not starts or starts[0] != 0:
            starts = [0] + starts
        self.spans = list(zip(starts, starts[1:] + [int(pos.shape[0])]))  # [start, end) of each sample
        self.per_sample = per_sample
        self.sample_calls = 0  # attentions run per sample (a model computing its own uses the block mask)

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        if self.per_sample and not return_array:
            return _SampleMask(window_size)
        q, k = self.index[:, None], self.index[None, :]
        mask = (self.segment[:, None] == self.segment[None, :]) & (q >= k)
        if window_size is not None:
            mask = mask & (q < k + window_size)
        return mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values


def segment_sdpa(original: Any, cache_type: type, segments: Any) -> Any:
    """mlx-lm's ``scaled_dot_product_attention`` (models/base.py) run segment by segment where
    the layer's cache is a ``cache_type`` and its mask a ``_SampleMask``: ``segments(cache,
    queries, keys, values, mask)`` yields each segment's (queries, keys, values, mask), each
    through ``mx.fast.scaled_dot_product_attention`` alone, concatenated along the positions;
    anything else goes to ``original``."""

    def sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any = None, scale: float = 1.0,
             mask: Any = None, **kw: Any) -> mx.array:
        if not (isinstance(cache, cache_type) and isinstance(mask, _SampleMask)):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)
        sinks = kw.get("sinks")
        extra = {} if sinks is None else {"sinks": sinks}
        outs = [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m, **extra)
                for q, k, v, m in segments(cache, queries, keys, values, mask)]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    return sdpa


def _sample_segments(cache: Any, queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> Iterator[Any]:
    """A packed row's samples: each sample's queries over its own keys, causal (a window's mask
    where the sample is longer than the layer's window), so no [N, N] mask or score exists for
    pairs of different samples."""
    cache.sample_calls += 1
    for s, e in cache.spans:
        m: Any = "causal"
        if mask.window and e - s > mask.window:
            i = mx.arange(e - s)
            m = (i[:, None] >= i[None, :]) & (i[:, None] < i[None, :] + mask.window)
        yield queries[:, :, s:e], keys[:, :, s:e], values[:, :, s:e], m


def _per_sample(original: Any) -> Any:
    """``scaled_dot_product_attention`` for a packed row: sample by sample (``_sample_segments``)."""
    return segment_sdpa(original, _PackedCache, _sample_segments)


def _model_modules(model: nn.Module) -> list[Any]:
    """The Python modules of ``model``'s layers that call mlx-lm's ``scaled_dot_product_attention``."""
    out: dict[str, Any] = {}
    for _, m in model.named_modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is not None and callable(getattr(mod, "scaled_dot_product_attention", None)):
            out[mod.__name__] = mod
    return list(out.values())


_PER_SAMPLE_REFUSED: dict[int, weakref.ref] = {}  # id(model): models whose attention ignores the per-sample path


@contextmanager
def packed(model: nn.Module, positions: mx.array | None) -> Iterator[list | None]:
    """Within it, ``model`` runs a packed row: yields the per-layer caches to pass to
    ``token_loss_sum`` (None when ``positions`` is None: an unpacked batch, nothing changed).
    ``positions`` is the row's [1, N] (``Batch.position_ids``); the model sees its first N - 1.
    Each attention's ``rope`` is shadowed by ``_PackedRoPE`` (an instance attribute, so the
    module tree and its parameters stay as they are), and the model's modules' mlx-lm
    ``scaled_dot_product_attention`` by ``_per_sample``; both restored on exit.

    Raises:
        UnsupportedModel: a model with no ``rope`` module on its attention, or whose RoPE cannot
            take per-token offsets (its positions could not restart per sample).
    """
    if positions is None:
        yield None
        return
    positions = positions[:, :-1]  # the model's input is ids[:, :-1]
    wrapped = []
    for _, m in model.named_modules():
        if isinstance(m, nn.Module) and "rope" in m and callable(m["rope"]):
            w = _PackedRoPE(m["rope"], positions.reshape(-1))
            object.__setattr__(m, "rope", w)
            wrapped.append((m, w))
    ref = _PER_SAMPLE_REFUSED.get(id(model))
    per_sample = not (ref is not None and ref() is model)
    patched = []
    if per_sample:
        for mod in _model_modules(model):
            patched.append((mod, mod.scaled_dot_product_attention))
            mod.scaled_dot_product_attention = _per_sample(mod.scaled_dot_product_attention)
    try:
        if not wrapped:
            raise UnsupportedModel(f"train.packing: {type(model).__name__} has no rope module on its attention, "
                                   "so positions cannot restart per sample; set train.packing=false")
        cache = _PackedCache(positions, per_sample)
        try:
            yield [cache] * len(model.layers)
        except (ValueError, TypeError) as e:
            if any(w.calls for _, w in wrapped):
                raise
            raise UnsupportedModel(f"train.packing: {type(model).__name__}'s attention cannot run a packed row "
                                   f"({e}); set train.packing=false") from None
    finally:
        for m, _ in wrapped:
            object.__delattr__(m, "rope")
        for mod, original in patched:
            mod.scaled_dot_product_attention = original


def check_packed(model: nn.Module) -> str:
    """Once before training packed: two short samples side by side in one row, positions
    restarting at the second, must give each sample's own logits (12 and 10 tokens: past an
    8-token sliding window, so a window composes with the samples). Tried per sample first;
    a model whose attention does not take that path (it calls MLX's kernel itself with the
    mask) goes back to the row's block mask, checked the same way. Returns the path in words.

    Raises:
        UnsupportedModel: neither keeps the samples apart.
    """
    key = mx.random.key(0)
    vocab = int(output_head(model)[0].weight.shape[0]) if _has_head(model) else 32
    a = mx.random.randint(1, vocab, (1, 12), key=key)
    b = mx.random.randint(1, vocab, (1, 10), key=mx.random.split(key)[0])
    was = model.training
    model.eval()
    try:
        alone = mx.concatenate([model(a), model(b)], axis=1).astype(mx.float32)
        pos = mx.concatenate([mx.arange(12), mx.arange(10), mx.zeros(1, mx.int32)])[None].astype(mx.int32)
        row = mx.concatenate([a, b], axis=1)
        scale = max(1.0, float(mx.abs(alone).max()))
        tol = 1e-4 if _weights_fp32(model) else 3e-2
        for per_sample in (True, False):
            if not per_sample:
                _PER_SAMPLE_REFUSED[id(model)] = weakref.ref(model)
            try:
                with packed(model, pos) as caches:
                    got = model(row, cache=caches).astype(mx.float32)
                diff = float(mx.abs(got - alone).max())
                # else the model asked for the array mask (its own attention)
                per_sample = per_sample and caches is not None and caches[0].sample_calls > 0
            except (ValueError, TypeError, AttributeError, IndexError, UnsupportedModel):
                if not per_sample:
                    raise
                continue  # its attention does something else with the mask: the block mask instead
            if diff <= tol * scale:
                return PACKED_PER_SAMPLE if per_sample else PACKED_BLOCK_MASK
    finally:
        model.train(was)
    raise UnsupportedModel(f"train.packing: {type(model).__name__}'s attention does not keep a packed row's samples "
                           f"apart (two samples packed differ from each alone by {diff:.3g} in the logits); set "
                           "train.packing=false")


def _has_head(model: nn.Module) -> bool:
    try:
        output_head(model)
    except UnsupportedModel:
        return False
    return True


def _weights_fp32(model: nn.Module) -> bool:
    return all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))


def head_fallback(model: nn.Module) -> str | None:
    """Why ``model``'s head runs on every position although ``target_head`` asked for targets
    only (its logits are not its head applied to its body's output), once checked; else None."""
    got = _HEAD_REFUSED.get(id(model))
    return got[1] if got is not None and got[0]() is model else None


def _head_applies(model: nn.Module, ids: mx.array) -> bool:
    """Whether the head may run on target rows only: the chunked loss's check, once per model;
    a refusal is kept (``head_fallback``) and not retried."""
    ref = _HEAD_CHECKED.get(id(model))
    if ref is not None and ref() is model:
        return True
    if head_fallback(model) is not None:
        return False
    try:
        _check_head(model, output_head(model)[1], ids)
    except UnsupportedModel as e:
        _HEAD_REFUSED[id(model)] = (weakref.ref(model), str(e).replace("train.loss_chunk: ", "").split("; set ")[0])
        return False
    return True


def check_chunkable(model: nn.Module) -> None:
    """Raise UnsupportedModel unless the chunked loss reproduces ``model``'s loss (its head
    found, its logits that head applied to its body's output, checked once on 8 tokens). For
    a caller turning the chunked loss on mid-run, as cuda's ``check_chunkable``."""
    _, call = output_head(model)
    _check_head(model, call, mx.arange(8)[None, :])


def output_head(model: nn.Module) -> tuple[nn.Module, Any]:
    """(the module holding the head's weights, the callable mapping hidden states to logits):
    ``model.lm_head`` twice, or the embedding and its ``as_linear`` when tied."""
    head = getattr(model, "lm_head", None)
    if head is not None:
        return head, _with_post(model, head)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is None or not hasattr(embed, "as_linear"):
        raise UnsupportedModel(f"train.loss_chunk: {type(model).__name__} has neither lm_head nor a tied "
                         "model.embed_tokens.as_linear; set train.loss_chunk=0")
    return embed, _with_post(model, embed.as_linear)


def post_head(model: nn.Module) -> tuple[str, float] | None:
    """(ModelArgs field, value) of the transform ``model``'s __call__ applies to its head's output
    (``_POST_HEAD``), or None. mlx-lm's cohere reads its args from ``model.model``."""
    for args in (getattr(model, "args", None), getattr(getattr(model, "model", None), "args", None)):
        for field in _POST_HEAD:
            v = getattr(args, field, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and float(v) != 1.0:
                return field, float(v)
    return None


def _with_post(model: nn.Module, call: Any) -> Any:
    post = post_head(model)
    if post is None:
        return call
    field, value = post
    return lambda h: _POST_HEAD[field](call(h), value)


def _chunk_loss(module: nn.Module, call: Any, params: dict, h: mx.array, targets: mx.array,
                weights: mx.array) -> mx.array:
    if params:
        module.update(params)  # so the gradient reaches the weights through these arrays
    logits = call(h).astype(mx.float32)
    return (nn.losses.cross_entropy(logits, targets) * weights).sum()


def _head_loss(module: nn.Module, call: Any, chunk: int, trainable: bool) -> Any:
    """A custom function (params, flat, targets, weights) -> (loss, d loss/d params,
    d loss/d flat), the gradients summed chunk by chunk in its forward; its vjp scales them.
    One function for all chunks, so the head's gradient is one running fp32 sum ([V, H] once,
    not once per chunk)."""

    def chunk_grads(params: dict, h: mx.array, t: mx.array, w: mx.array) -> tuple:
        if trainable:
            return mx.value_and_grad(lambda p, x: _chunk_loss(module, call, p, x, t, w), argnums=(0, 1))(params, h)
        loss, g_h = mx.value_and_grad(lambda x: _chunk_loss(module, call, {}, x, t, w))(h)
        return loss, ({}, g_h)

    @mx.custom_function
    def head_loss(params: dict, flat: mx.array, targets: mx.array, weights: mx.array) -> tuple:
        total, g_params, g_rows, done = mx.array(0.0, mx.float32), None, [], None
        for s in range(0, flat.shape[0], chunk):
            h = flat[s:s + chunk]
            if done is not None:
                h = mx.depends(h, done)  # this chunk's logits only after the previous chunk's results
            loss, (g_p, g_h) = chunk_grads(params, h, targets[s:s + chunk], weights[s:s + chunk])
            total = total + loss
            g_p = tree_map(lambda g: g.astype(mx.float32), g_p)  # a bf16 sum over chunks would round
            g_params = g_p if g_params is None else tree_map(mx.add, g_params, g_p)
            g_rows.append(g_h)
            # all of it, not just the loss: else MLX computes a chunk's gradients late and
            # keeps every chunk's softmax until then (measured: the peak grew with the chunks)
            done = [loss, g_h, *(v for _, v in tree_flatten(g_params))]
        return total, g_params, mx.concatenate(g_rows)

    @head_loss.vjp
    def head_loss_vjp(primals: tuple, cotangents: tuple, outputs: tuple) -> tuple:
        params, flat, targets, weights = primals
        c = cotangents[0]
        g_params = tree_map(lambda g, p: (g * c).astype(p.dtype), outputs[1], params)
        return g_params, (outputs[2] * c).astype(flat.dtype), mx.zeros_like(targets), mx.zeros_like(weights)

    return head_loss


def _target_rows(weights: mx.array) -> np.ndarray | None:
    """Indices of the rows that count, or None where the mask cannot be read (mx.compile)."""
    try:
        return np.flatnonzero(np.asarray(weights))
    except ValueError:  # "[eval] Attempting to eval an array during function transformations"
        return None


def _check_head(model: nn.Module, call: Any, ids: mx.array) -> None:
    """Once per model: its logits must be ``call(model.model(x))``; a model whose __call__ does
    more (soft-capping, scaling) is refused. By ModelArgs field names, then numerically on the
    first row's first 8 tokens in eval mode (no dropout) where arrays can be read (not under
    mx.compile, where the field names are all that is checked)."""
    ref = _HEAD_CHECKED.get(id(model))
    if ref is not None and ref() is model:
        return
    args = getattr(model, "args", None)
    named = [k for k in _POST_HEAD_ARGS if getattr(args, k, None) not in (None, 1, 1.0)]  # transforms not applied
    same = not named
    if same:
        x = ids[:1, :8]
        was_training = model.training
        model.eval()
        try:
            whole, split = model(x), call(model.model(x, cache=None))  # mlx-lm's phi has no default cache
            same = bool(mx.allclose(whole.astype(mx.float32), split.astype(mx.float32), rtol=1e-5, atol=1e-6))
        except ValueError:  # "[eval] Attempting to eval an array during function transformations"
            same = True
        finally:
            model.train(was_training)
    if not same:
        raise UnsupportedModel("train.loss_chunk: this model's logits are not its head applied to its body's "
                         f"output ({', '.join(named) or 'its __call__ transforms them'}), which the "
                         "chunked loss would not reproduce; set train.loss_chunk=0")
    _HEAD_CHECKED[id(model)] = weakref.ref(model)
