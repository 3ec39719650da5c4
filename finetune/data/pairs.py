"""Preference pairs as batches (``objective=dpo|orpo|simpo``): the step -> pairs schedule and
batches whose rows keep each pair side by side; and KTO's labelled records (``objective=kto``):
their labels and the mismatched rows its KL estimate reads (``UnpairedSource``).

The tokens hold each pair as two samples, 2i (chosen) and 2i + 1 (rejected)
(finetune/data/tokens.py ``_pair_chunk``). ``PairSource`` is ``DataSource`` over pairs: the
train/validation split, the shuffle and the length grouping see one item per pair (its longer
sample's length), so the order of pairs is a pure function of (seed, pairs per step, step), as
the order of samples is under SFT. A batch's rows are its pairs' samples interleaved (chosen 0,
rejected 0, chosen 1, ...): ``Batch.split`` by an even number of rows keeps every pair whole in
one micro-batch (the loop splits by ``2 * micro``), and the backend reads the chosen rows as the
even ones, the rejected as the odd ones. ``Batch.indices`` carries each row's sample id (2i,
2i + 1): the key of a precomputed reference log-probability.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from finetune.backends.base import Batch
from finetune.data.batches import DataSource, collate
from finetune.data.tokens import Tokenized


class _PairView:
    """What ``DataSource.__init__`` reads of its samples (how many, their lengths), one item a
    pair: a pair is as long as its longer sample."""

    def __init__(self, tok: Tokenized):
        lens = tok.lengths
        self.ids = range(len(lens) // 2)
        self.lengths = np.maximum(lens[0::2], lens[1::2])


class PairSource(DataSource):
    """``DataSource`` over pairs (see the module docstring): ``effective_batch`` counts pairs."""

    def __init__(self, tok: Tokenized, pad_id: int, effective_batch: int, seed: int, val_fraction: float,
                 max_val: int, pad_multiple: int = 1, max_len: int | None = None):
        super().__init__(_PairView(tok), pad_id, effective_batch, seed, val_fraction, max_val,  # type: ignore[arg-type]
                         pad_multiple, max_len)
        self.samples = tok  # the samples themselves: 2 per pair
        self.sample_lengths = tok.lengths

    def pair_batch(self, pairs: np.ndarray) -> Batch:
        """The rows of ``pairs`` (pair ids), each pair's chosen then its rejected sample."""
        rows = np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)
        return collate([self.samples.ids[i] for i in rows], [self.samples.masks[i] for i in rows], rows,
                       self.pad_id, **self.pad)

    def train_batch(self, step_index: int) -> Batch:
        """The pairs of 0-based optimizer step ``step_index``, two rows each."""
        return self.pair_batch(self.step_indices(step_index))

    def val_batches(self, batch_size: int, max_batches: int) -> list[Batch]:
        """Validation pairs, ``batch_size`` pairs (2 * batch_size rows) a batch, longest first."""
        idx = self.val_idx[np.argsort(-self.lengths[self.val_idx], kind="stable")]
        out = [self.pair_batch(idx[i: i + batch_size]) for i in range(0, len(idx), batch_size)]
        return out[:max_batches] if max_batches > 0 else out

    def all_batches(self, batch_size: int) -> list[Batch]:
        """Every pair (train and validation), ``batch_size`` pairs a batch: what a precomputed
        reference pass reads once."""
        idx = np.arange(len(self.lengths))
        return [self.pair_batch(idx[i: i + batch_size]) for i in range(0, len(idx), batch_size)]


def pair_counts(batch: Batch) -> tuple[int, int]:
    """(pairs, target tokens of the chosen completions) of a batch of interleaved pair rows:
    the scales of a step's loss (``finetune.objectives.scaled_loss``)."""
    return len(batch.lengths) // 2, int(batch.loss_mask[0::2, 1:].sum())


def prompt_split(ids_c: np.ndarray, mask_c: np.ndarray, ids_r: np.ndarray, mask_r: np.ndarray) -> tuple[int, int, int]:
    """(p, n_c, n_r) of a pair: p its shared prompt, the positions before either sample's first
    target where their tokens agree; n_c and n_r the positions each sample feeds the model (up
    to its last target's predictor). The mlx pair step runs the pair as n_c + n_r - p positions
    (backends/mlx/shared_prompt.py). ValueError for a sample without targets."""
    tc, tr = np.flatnonzero(mask_c[1:]) + 1, np.flatnonzero(mask_r[1:]) + 1  # target columns
    if not len(tc) or not len(tr):
        raise ValueError("a sample without targets")
    p = int(min(tc[0], tr[0]))
    differ = np.flatnonzero(np.asarray(ids_c[:p]) != np.asarray(ids_r[:p]))
    return (int(differ[0]) if len(differ) else p), int(tc[-1]), int(tr[-1])


def pair_positions(tok: Tokenized) -> int:
    """The most positions any pair takes with its prompt run once (``prompt_split``): where the
    backend shares prompts (mlx), a micro-batch of P pairs runs at most P times this many
    positions through the model, which the planner prices (0 where a sample has no target)."""
    most = 0
    for i in range(0, len(tok.ids) - 1, 2):
        try:
            p, n_c, n_r = prompt_split(tok.ids[i], tok.masks[i], tok.ids[i + 1], tok.masks[i + 1])
        except ValueError:
            return 0
        most = max(most, n_c + n_r - p)
    return most


def stats(src: PairSource, tok: Tokenized) -> dict[str, Any]:
    """The pair counts ``build``'s stats add."""
    return {"pairs": len(src.lengths), "train_pairs": len(src.train_idx), "val_pairs": len(src.val_idx)}


class UnpairedSource(DataSource):
    """``DataSource`` over KTO's labelled records (one row each), with the rows of its KL estimate.

    KTO's reference point z0 = max(0, mean KL(policy || reference)) is estimated, as TRL's
    KTOTrainer does (trl/trainer/kto_trainer.py ``_prepare_dataset``, ``add_kl_completion_ids``),
    from mismatched (prompt, completion) rows of the same records: row i's prompt with row i - 1's
    completion (row 0 with the last one's). TRL rotates within each device batch; we rotate
    within the whole optimizer step, so the estimate, and the loss, do not depend on how the
    governor splits the step (the loop computes it once a step, before its micro-batches)."""

    def _prompt_len(self, i: int) -> int:
        m = np.asarray(self.tok.masks[i])
        return 1 + int(np.argmax(m[1:] > 0))  # the first target after the label entry: the completion

    def kl_batch(self, batch: Batch) -> Batch:
        """The KL rows of ``batch``'s records: prompt of row i + completion of row i - 1, cut to
        train.seq_len; only the completion's tokens are targets. ``indices``: the prompt's record."""
        idx = np.asarray(batch.indices)
        ids, masks = [], []
        for i, j in zip(idx, np.roll(idx, 1)):
            a, b = np.asarray(self.tok.ids[i]), np.asarray(self.tok.ids[j])
            pa, pb = self._prompt_len(int(i)), self._prompt_len(int(j))
            row = np.concatenate([a[:pa], b[pb:]])
            m = np.concatenate([np.zeros(pa, np.int8), np.ones(len(b) - pb, np.int8)])
            cap = self.pad.get("max_len") or len(row)
            ids.append(row[:cap])
            masks.append(m[:cap])
        return collate(ids, masks, idx, self.pad_id, **self.pad)
