"""Samples -> batches: the train/validation split and the deterministic step -> samples
schedule (``DataSource``), right-padded batches (``collate``), each rank's share of a step
(``rank_slice``), and packing's view of the data: samples cut once to the micro-batch
(``fit_to_micro``) and what the packed micro-batches of a run's steps hold at most
(``packed_steps``, by backends/base.py ``pack_layout``, the one packing rule).

The order of samples is a pure function of (seed, effective batch size, step), never of the
micro-batch, so the governor can split an optimizer step differently without changing which
samples it trains on or in what order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from finetune.backends import capabilities, run_device
from finetune.backends.base import Batch, PackedFigures, pack_figures, pack_layout, padded_length
from finetune.data.tokens import Tokenized
from finetune.errors import UserError
from finetune.spec import RunSpec

GROUP_STEPS = 16  # effective batches sorted together by length: less padding, still shuffled


def collate(ids: list[np.ndarray], masks: list[np.ndarray], indices: np.ndarray, pad_id: int,
            pad_multiple: int = 1, max_len: int | None = None) -> Batch:
    """Right-pad samples into one batch as wide as ``padded_length`` of its longest sample."""
    lengths = np.array([len(x) for x in ids], np.int32)
    t = padded_length(int(lengths.max()), pad_multiple, max_len)
    arr = np.full((len(ids), t), pad_id, np.int32)
    m = np.zeros((len(ids), t), np.int8)
    for i, (x, y) in enumerate(zip(ids, masks)):
        arr[i, : len(x)] = x
        m[i, : len(y)] = y
    return Batch(arr, m, lengths, np.asarray(indices, np.int64), pad_multiple, max_len)


class DataSource:
    """Train/validation split and the deterministic step -> samples schedule."""

    def __init__(self, tok: Tokenized, pad_id: int, effective_batch: int, seed: int,
                 val_fraction: float, max_val: int, pad_multiple: int = 1, max_len: int | None = None):
        n = len(tok.ids)
        perm = np.random.default_rng(seed).permutation(n)
        n_val = min(max_val, int(round(val_fraction * n))) if val_fraction > 0 else 0
        if val_fraction > 0 and n_val == 0 and n > 1:
            n_val = 1
        self.val_idx = np.sort(perm[:n_val])
        self.train_idx = np.sort(perm[n_val:])
        if len(self.train_idx) < effective_batch:
            raise UserError(
                f"only {len(self.train_idx)} training samples for an effective batch of {effective_batch} "
                "(train.batch_size * train.grad_accum); add data or lower the batch")
        self.tok, self.pad_id, self.E, self.seed = tok, pad_id, effective_batch, seed
        self.lengths = tok.lengths  # tokens per sample, read once (the samples may be memory-mapped)
        # the longest sample: the segment train.pack_fill pads each sample's up to (base.pack_layout)
        self.longest = int(self.lengths.max())
        self.pad: dict[str, Any] = {"pad_multiple": pad_multiple, "max_len": max_len}  # collate's keywords
        self.steps_per_epoch = len(self.train_idx) // effective_batch
        self._epoch_cache: dict[int, list[np.ndarray]] = {}

    def _epoch(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._epoch_cache:
            rng = np.random.default_rng([self.seed, epoch])
            order = self.train_idx[rng.permutation(len(self.train_idx))]
            order = order[: self.steps_per_epoch * self.E]  # drop the ragged tail of an epoch
            lens = self.lengths[order]
            batches = []
            chunk = self.E * GROUP_STEPS
            for c in range(0, len(order), chunk):
                o, ln = order[c : c + chunk], lens[c : c + chunk]
                o = o[np.argsort(-ln, kind="stable")]  # longest first within the chunk
                group = [o[i : i + self.E] for i in range(0, len(o), self.E)]
                batches += [group[j] for j in rng.permutation(len(group))]
            self._epoch_cache = {epoch: batches}  # keep one epoch: memory stays flat
        return self._epoch_cache[epoch]

    def step_indices(self, step_index: int) -> np.ndarray:
        """The samples of 0-based optimizer step ``step_index``, in the step's order."""
        return self._epoch(step_index // self.steps_per_epoch)[step_index % self.steps_per_epoch]

    def step_lengths(self, step_index: int) -> np.ndarray:
        """Tokens of each sample of 0-based optimizer step ``step_index``, in the step's order."""
        return self.lengths[self.step_indices(step_index)]

    def train_batch(self, step_index: int) -> Batch:
        """Effective batch for 0-based optimizer step ``step_index`` (the same for any micro-batch)."""
        idx = self._epoch(step_index // self.steps_per_epoch)[step_index % self.steps_per_epoch]
        return collate([self.tok.ids[i] for i in idx], [self.tok.masks[i] for i in idx], idx, self.pad_id, **self.pad)

    def val_batches(self, batch_size: int, max_batches: int) -> list[Batch]:
        idx = self.val_idx[np.argsort(-self.lengths[self.val_idx], kind="stable")]  # longest first
        out = []
        for i in range(0, len(idx), batch_size):
            sel = idx[i : i + batch_size]
            out.append(collate([self.tok.ids[j] for j in sel], [self.tok.masks[j] for j in sel], np.array(sel),
                               self.pad_id, **self.pad))
        return out[:max_batches] if max_batches > 0 else out


def rank_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank ``rank``'s share of an optimizer step's batch: rows rank, rank + W, ... . The
    batch is sorted longest first, so strided rows give every rank a like mix of lengths
    (contiguous slices would give rank 0 all the longest). Each slice is cut to its own
    longest sample; the loss scale stays the whole step's (the loop's), so the sum over ranks
    is the one-process step."""
    if world_size <= 1:
        return batch
    rows = np.arange(rank, len(batch.lengths), world_size)
    lens = batch.lengths[rows]
    t = min(padded_length(int(lens.max()), batch.pad_multiple, batch.max_len), batch.input_ids.shape[1])
    return Batch(batch.input_ids[rows, :t], batch.loss_mask[rows, :t], lens,
                 batch.indices[rows] if len(batch.indices) else batch.indices, batch.pad_multiple, batch.max_len)


def pad_multiple(spec: RunSpec) -> int:
    """``train.pad_multiple``, with 0 (auto) resolved: 32 on an Apple GPU, where MLX reuses a
    freed Metal buffer only for a request within two pages of its size (so repeated shapes
    matter) and mlx-lm pads the same way; 1 elsewhere (measured on CPU: padding cost speed
    and saved nothing once the cache is bounded)."""
    m = spec.train.pad_multiple
    if m:
        return m

    caps = capabilities(spec.backend.resolved)  # auto: mlx on Apple Silicon
    if not caps.default_pad_multiple:
        return 1  # no device of this backend pads by default: nothing to probe

    return caps.default_pad_multiple.get(run_device(caps.name, spec.backend.device), 1)


def packed_widths(lengths: np.ndarray, tokens_per_micro: int, fill: bool = False,
                  segment: int | None = None) -> np.ndarray:
    """Columns of each micro-batch ``backends.base.pack`` makes of samples of ``lengths``: every
    one but the last filled to ``tokens_per_micro`` (wider only for a sample longer than that),
    the last too with ``fill`` (``train.pack_fill``)."""
    return np.array([row.width for row in pack_layout(lengths, tokens_per_micro, fill, segment)], np.int64)


def packed_pair_span(lengths: np.ndarray, tokens_per_micro: int, fill: bool = False,
                     segment: int | None = None) -> float:
    """The most (query, key) pairs per position of the micro-batches ``pack`` makes of samples
    of ``lengths``: each one's segments' squares (its samples, with the pads that follow them
    under ``fill``, and its pad segments) summed over its columns, what attention run one
    sample at a time computes."""
    return pack_figures(lengths, np.zeros(len(lengths), np.int64), tokens_per_micro, fill, segment).pair_span


def packed_steps(src: DataSource, targets: np.ndarray, tokens_per_micro: int, steps: int, world_size: int = 1,
                 fill: bool = False) -> PackedFigures:
    """The micro-batches ``pack`` makes of the first ``steps`` optimizer steps of ``src``, each
    rank packing its own share of a step (``rank_slice``: rows rank, rank + W, ...), read
    from the samples' lengths and target counts (``targets``: ``Tokenized.targets``, which
    ``pack`` keeps: it masks each sample's first token). Under ``fill`` each sample's segment
    is padded up to the data's longest sample (``DataSource.longest``), as the loop packs it."""
    out = PackedFigures(0, 0, 0.0, 0, 0)
    for i in range(steps):
        idx = src.step_indices(i)
        for rank in range(world_size):
            mine = idx[rank::world_size]
            out = out.merge(pack_figures(src.lengths[mine], targets[mine], tokens_per_micro, fill, src.longest))
    return out


def fit_to_micro(tok: Tokenized, cap: int, overflow: str) -> tuple[Tokenized, int]:
    """Samples longer than ``cap`` tokens (``train.tokens_per_micro`` below ``train.seq_len``)
    cut once, before training, so every step trains the same samples whatever the governor
    later does: "truncate" keeps the first ``cap`` tokens; "split" cuts pieces of ``cap``
    tokens, each starting at the previous piece's last token (its context only: a sample's
    first token is no target), so every target is trained exactly once. A piece or a
    truncation left without a target is dropped. Returns (the samples, how many were cut)."""
    if not len(tok.ids) or int(tok.lengths.max()) <= cap:
        return tok, 0
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    cut = 0
    for x, m in zip(tok.ids, tok.masks):
        x, m = np.asarray(x), np.asarray(m)
        if len(x) <= cap:
            ids.append(x)
            masks.append(m)
            continue
        cut += 1
        starts = [0] if overflow == "truncate" else range(0, len(x) - 1, cap - 1)
        for s in starts:
            if m[s + 1 : s + cap].any():
                ids.append(x[s : s + cap])
                masks.append(m[s : s + cap])
    return Tokenized(ids, masks, tok.truncated, tok.dropped_no_target, tok.longest, tok.records, tok.formats), cut
