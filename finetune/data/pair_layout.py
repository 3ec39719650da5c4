"""Where a micro-batch of interleaved pairs sits in one shared-prompt row (each pair's prompt run
once): numpy only, read by both backends' pair steps (backends/mlx/shared_prompt.py,
backends/cuda/shared_prompt.py)."""

from __future__ import annotations

import numpy as np

from finetune.data.pairs import prompt_split


class Layout:
    """Where a micro-batch of interleaved pairs (even rows chosen, odd rejected) sits in its
    shared-prompt row, all numpy, read before the graph is built.

    Attributes:
        ids: [1, N] the row's tokens.
        positions: [N] each token's position in its own sequence.
        spans: per segment, [start, end) in the row and its prompt's [start, end) or None.
        gather: [n] the row positions whose hidden states predict the targets.
        targets: [n] the target tokens.
        weights: [rows, n] each target's mask weight in its row (0 elsewhere).
        shared: prompt tokens run once rather than twice, over the micro-batch.
    """

    def __init__(self, ids: np.ndarray, mask: np.ndarray):
        rows = ids.shape[0]
        seq: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        self.spans: list[tuple[int, int, tuple[int, int] | None]] = []
        gather: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        owner: list[np.ndarray] = []
        weight: list[np.ndarray] = []
        base = self.shared = 0
        for c in range(0, rows, 2):
            r = c + 1
            p, n_c, n_r = prompt_split(ids[c], mask[c], ids[r], mask[r])  # ValueError: a row without targets
            tc, tr = np.flatnonzero(mask[c, 1:]) + 1, np.flatnonzero(mask[r, 1:]) + 1  # target columns
            seq += [ids[c, :n_c], ids[r, p:n_r]]
            pos += [np.arange(n_c), np.arange(p, n_r)]
            self.spans.append((base, base + n_c, None))
            if n_r > p:
                self.spans.append((base + n_c, base + n_c + n_r - p, (base, base + p) if p else None))
            for row, t, at in ((c, tc, base + tc - 1),
                               (r, tr, np.where(tr - 1 < p, base + tr - 1, base + n_c + tr - 1 - p))):
                gather.append(at)
                targets.append(ids[row, t])
                owner.append(np.full(len(t), row))
                weight.append(mask[row, t].astype(np.float32))
            base += n_c + n_r - p
            self.shared += p
        self.ids = np.concatenate(seq)[None].astype(np.int32)
        self.positions = np.concatenate(pos).astype(np.int32)
        self.gather = np.concatenate(gather).astype(np.int32)
        self.targets = np.concatenate(targets).astype(np.int32)
        own, w = np.concatenate(owner), np.concatenate(weight)
        self.weights = np.zeros((rows, len(w)), np.float32)
        self.weights[own, np.arange(len(w))] = w
