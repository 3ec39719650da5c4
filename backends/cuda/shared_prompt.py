"""A pair micro-batch's log-probabilities with each pair's prompt run once (the cuda preference step).

The cuda counterpart of backends/mlx/shared_prompt.py, on the same layout
(finetune/data/pair_layout.py ``Layout``): per pair, the chosen row up to its last target, then
the rejected row's tokens after the shared prompt, as one [1, N] row. transformers takes a
custom 4D attention mask as it is (masking_utils ``_preprocess_mask_arguments``: a 4D mask is
returned as-is) and each token's own ``position_ids`` for RoPE, so each pair is one row
with a [1, L, L] mask: a chosen segment causal over itself, a rejected segment over its
pair's prompt and causally over itself (never the chosen completion); one such row per pair
(``PairRows``), padded to the longest. The head runs on the
target positions only. The same log-probabilities as the padded rows in exact arithmetic (the
prefix-sharing of Wang et al. 2024, arXiv:2410.20305).

Under sdpa the mask is there for correctness only: ``applies`` points the model at ``attention``
(registered with transformers' ``AttentionInterface`` as ``NAME``, with sdpa's own mask function),
for good (a checkpointed layer runs again in the backward, outside any step's code). Given the step's mask, it runs
each pair's attention as two causal pieces: the chosen segment through sdpa with ``is_causal``
(the kernel skips the masked half, GQA without repeating k and v), and the rejected segment's
queries over the prompt's keys and its own (a lower-right causal [m, p + m] mask). A masked sdpa
computes every (query, key) of its [L, L] row, ~2.3x the work of the pieces on the benchmark's
GSM8K pairs (prompt ~46% of the tokens). Any other mask (or none) goes to transformers'
``sdpa_attention_forward`` unchanged, so the model runs as under sdpa; under eager the
[P, 1, L, L] mask itself keeps the pairs apart (additive, eager computes every score anyway).

Checked once per model on a short random pair in eval mode against the padded rows; a model
with a sliding window or soft-capping (whose 4D mask transformers would reuse on every layer),
an attention implementation other than sdpa or eager, or whose check differs keeps the padded
rows, and the log says why once.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from finetune.data.pair_layout import Layout

log = logging.getLogger("finetune")

_CHECKED: dict[int, tuple[weakref.ref, str | None]] = {}  # id(model): (model, why not, or None: it applies)
NAME = "finetune_pair_sdpa"
# [weakref to the step's [P, 1, L, L] mask, each row's (chosen end, prompt end, row end)]: set by
# ``mark`` before a forward, read by ``attention`` in every layer (a recomputing backward too)
_SLOT: list[Any] = [None, None]


class PairRows:
    """A ``Layout``'s row cut into one row per pair, padded to the longest: [P, L] tokens, their
    positions, the [P, 1, L, L] attention (bool, True attends; a pad attends to itself only) and
    where the layout's gather positions fall in the flattened [P * L] hidden states. A row per
    pair rather than one row: masked attention computes every (query, key) pair of its row, and
    one row of every pair would be P times the attention of its pairs."""

    def __init__(self, lay: Layout):
        pairs = [(lay.spans[i][0], lay.spans[i + 1][1] if i + 1 < len(lay.spans) and lay.spans[i + 1][2] is not None
                  else lay.spans[i][1]) for i in range(len(lay.spans)) if lay.spans[i][2] is None]
        width = max(e - s for s, e in pairs)
        self.ids = np.zeros((len(pairs), width), np.int64)
        self.positions = np.zeros((len(pairs), width), np.int64)
        allowed = np.zeros((len(pairs), 1, width, width), bool)
        row_of = np.zeros(lay.ids.shape[1], np.int64)
        for r, (s, e) in enumerate(pairs):
            n = e - s
            self.ids[r, :n] = lay.ids[0, s:e]
            self.positions[r, :n] = lay.positions[s:e]
            row_of[s:e] = r * width - s
            idx = np.arange(n, width)
            allowed[r, 0, idx, idx] = True  # pads: themselves only (no all-masked row)
        for s, e, prompt in lay.spans:
            r = int((row_of[s] + s) // width)
            a, b = s + row_of[s] - r * width, e + row_of[s] - r * width
            allowed[r, 0, a:b, a:b] = np.tril(np.ones((b - a, b - a), bool))
            if prompt is not None:
                pa = prompt[0] + row_of[prompt[0]] - r * width
                allowed[r, 0, a:b, pa:pa + prompt[1] - prompt[0]] = True
        self.allowed = allowed
        self.gather = lay.gather.astype(np.int64) + row_of[lay.gather]
        # per row: (chosen end, prompt end, row end), relative to the row, whose prompt is its
        # start; a row of one segment (a rejected with no prompt in common) is (end, 0, end)
        starts = {sp[0]: sp for sp in lay.spans}
        self.segments: list[tuple[int, int, int]] = []
        for s, e in pairs:
            c = starts[s][1] - s
            rest = starts.get(starts[s][1])
            p = rest[2][1] - rest[2][0] if rest is not None and rest[2] is not None and rest[2][0] == s else 0
            self.segments.append((c, p, e - s))

    def mask(self, impl: str, dtype: torch.dtype) -> torch.Tensor:
        """The attention as the model's implementation takes it: bool for sdpa, additive for eager."""
        mask = torch.from_numpy(self.allowed)
        if impl != "eager":  # sdpa, or ``attention`` (which hands sdpa any mask but the step's)
            return mask
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)


def register() -> str:
    """Register ``attention`` with transformers under ``NAME``, with sdpa's mask function for
    any call that builds its own mask (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def mark(mask: torch.Tensor, rows: PairRows) -> None:
    """``mask`` is the step's [P, 1, L, L] mask of ``rows``: ``attention`` runs its pairs in pieces."""
    _SLOT[:] = [weakref.ref(mask), rows.segments]


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (query [B, H, L, D], key and value [B, Hkv, L, D];
    returns [B, L, H, D]). The marked mask: per row, the chosen segment causal over itself, the
    rejected's queries over the prompt's keys and causally over their own, pads 0; anything
    else: transformers' ``sdpa_attention_forward``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ref, segments = _SLOT
    if attention_mask is None or ref is None or ref() is not attention_mask:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kwargs.pop("is_causal", None)
    width = query.shape[2]
    rows = []
    for r, (c, p, e) in enumerate(segments):
        q, k, v = query[r:r + 1], key[r:r + 1], value[r:r + 1]
        parts = [sdpa_attention_forward(module, q[:, :, :c], k[:, :, :c], v[:, :, :c], None, dropout=dropout,
                                        scaling=scaling, is_causal=True, **kwargs)[0]]
        if e > c:  # the rejected's m queries: the prompt's p keys, then their own, causally
            m = e - c
            i = torch.arange(m, device=query.device)
            allowed = (torch.arange(p + m, device=query.device)[None, :] <= i[:, None] + p)[None, None]
            keys = torch.cat([k[:, :, :p], k[:, :, c:e]], dim=2)
            values = torch.cat([v[:, :, :p], v[:, :, c:e]], dim=2)
            parts.append(sdpa_attention_forward(module, q[:, :, c:e], keys, values, allowed, dropout=dropout,
                                                scaling=scaling, **kwargs)[0])
        if e < width:  # pads: never read (no target, no query attends them)
            parts.append(query.new_zeros((1, width - e, query.shape[1], query.shape[3])))
        rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    return (torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]), None


def _config(model: Any) -> Any:
    return getattr(model, "config", None) or getattr(getattr(model, "base_model", None), "config", None)


def _refusal(model: Any) -> str | None:
    cfg = _config(model)
    if cfg is None:
        return "the model has no config"
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("sdpa", "eager", NAME):
        return f"attention implementation {impl} takes no 4D mask"
    for part in (cfg, getattr(cfg, "text_config", None)):
        if part is None:
            continue
        types = getattr(part, "layer_types", None)
        if types and any(t != "full_attention" for t in types):
            return "the model has sliding-window layers"
        if not types and getattr(part, "sliding_window", None) and getattr(part, "use_sliding_window", True):
            return "the model has a sliding window"
        if getattr(part, "attn_logit_softcapping", None):
            return "the model soft-caps its attention"
    return None


def applies(model: Any, padded: Callable[[np.ndarray, np.ndarray], torch.Tensor],
            shared: Callable[[np.ndarray, np.ndarray], torch.Tensor | None]) -> str | None:
    """None where the shared-prompt row may run ``model``, else why not: checked once per model,
    in eval mode without gradients, ``shared`` against ``padded`` (both: (ids, mask) -> [rows]
    summed log-probs) on a short random pair."""
    got = _CHECKED.get(id(model))
    if got is not None and got[0]() is model:
        return got[1]
    why = _refusal(model)
    cfg = _config(model)
    if why is None and cfg._attn_implementation == "sdpa":
        cfg._attn_implementation = register()  # checked as it will run: each pair in causal pieces
    why = why or _check(model, padded, shared)
    if why and cfg is not None and cfg._attn_implementation == NAME:
        cfg._attn_implementation = "sdpa"
    _CHECKED[id(model)] = (weakref.ref(model), why)
    if why:
        log.info("the pair step runs chosen and rejected as padded rows, each with its prompt: %s", why)
    return why


def _check(model: Any, padded: Callable[[np.ndarray, np.ndarray], torch.Tensor],
           shared: Callable[[np.ndarray, np.ndarray], torch.Tensor | None]) -> str | None:
    g = torch.Generator().manual_seed(0)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(1, vocab, (2, 14), generator=g).numpy()
    ids[1, :6] = ids[0, :6]  # a 6-token prompt, then 8 and 6 completion tokens (the rejected padded)
    mask = np.zeros((2, 14), np.float32)
    mask[0, 6:] = 1
    mask[1, 6:12] = 1
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = padded(ids, mask).float().cpu()
            out = shared(ids, mask)
            if out is None:
                return "the pair has no shared-prompt row"
            got = out.float().cpu()
    except (ValueError, TypeError, RuntimeError, AttributeError, IndexError) as e:
        return f"{type(model).__name__}'s attention cannot run a shared-prompt row ({e})"
    finally:
        model.train(was)
    diff = float((got - want).abs().max())
    fp32 = next(model.parameters()).dtype == torch.float32
    tol = (1e-4 if fp32 else 3e-2) * max(1.0, float(want.abs().max()))
    if not diff <= tol:
        return f"{type(model).__name__}'s shared-prompt row differs from its padded rows by {diff:.3g} in the log-probs"
    return None
