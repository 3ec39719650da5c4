"""The mlx backend's preference step (``objective=dpo|orpo|simpo|kto``): chosen and rejected rows
through the model as one batch, the reference's log-probabilities, the loss of
finetune/objectives.py. The shape of backends/cuda/preference.py, in MLX's words. KTO's records
are rows of their own, labelled in their first mask entry (``objectives.unpaired_labels``); its
KL reference point is taken once a step over the step's mismatched rows (``kto_kl``), before
the step's micro-batches, as on cuda.

A micro-batch holds whole pairs, interleaved (finetune/data/pairs.py): even rows the chosen
completions, odd rows the rejected. One forward gives every row's summed completion
log-probability; the reference's come from

- the base with the adapters off under LoRA/DoRA/QLoRA (``adapters_off``): each of mlx-lm's
  adapter layers (LoRALinear, DoRALinear, LoRASwitchLinear, LoRA/DoRAEmbedding) is swapped in
  its parent for the base layer it wraps (``.linear`` / ``.embedding``, the same arrays, no
  copy) for the reference pass and put back after. A scale of 0 would not do: DoRA's output is
  rescaled by its trained magnitude ``m`` whatever the scale. The pass runs outside
  ``nn.value_and_grad`` and is evaluated before the policy's, so it keeps no activations and
  carries no gradient (PEFT's ``disable_adapter()`` under ``torch.no_grad()`` on cuda);
- a table computed in one pass before step 1 (``precompute_reference``) under method=full or
  objective.reference=precompute: TRL's ``precompute_ref_log_probs``, one fp32 number per
  sample keyed by ``Batch.indices``, as on cuda.

Each pair micro-batch runs as one shared-prompt row (shared_prompt.py, inside ``_pairs``: each
pair's prompt once, the head on target positions only), the reference pass and the policy's
forward and backward alike; packed batches, KTO's rows and a model that cannot run it keep the
padded rows (``row_logps``).

The step runs uncompiled (train.compile leaves it as it is): the loss reads the reference as an
input and the pair split as Python numbers, a swap of layers would retrace a compiled graph, and
the shared-prompt row's length changes with every micro-batch. Compiling the padded step's
value_and_grad measured no faster on MLX's CPU backend (8 rows x 380 tokens, the tiny Qwen2 of
benchmarks/vs_peers.py: 51.98 s compiled against 50.40 s; the step is matmul-bound there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np
from finetune.backends.base import Batch, OutOfMemory, PhaseHook
from mlx import nn
from mlx.utils import tree_map

from finetune import objectives
from finetune.objectives import PairSums, PairTerms, unpaired_labels
from finetune.backends.mlx.shared_prompt import shared_rows


def _wrapped(module: Any) -> Any:
    """The base layer an mlx-lm adapter layer wraps, or None for any other module."""
    from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear
    from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear, LoRASwitchLinear

    if isinstance(module, (LoRALinear, DoRALinear, LoRASwitchLinear)):
        return module.linear
    if isinstance(module, (LoRAEmbedding, DoRAEmbedding)):
        return module.embedding
    return None


def _set_child(root: nn.Module, path: str, child: Any) -> None:
    """Put ``child`` at dotted ``path`` under ``root`` (list indices as numbers)."""
    *parents, last = path.split(".")
    node: Any = root
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = child
    else:
        node[last] = child


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[int]:
    """``model`` as its base: every adapter layer replaced by the layer it wraps for the block,
    put back after (even on an error). Yields how many layers were swapped (0 under method=full)."""
    adapters = [(path, m) for path, m in model.named_modules() if _wrapped(m) is not None]
    for path, m in adapters:
        _set_child(model, path, _wrapped(m))
    try:
        yield len(adapters)
    finally:
        for path, m in adapters:
            _set_child(model, path, m)


def row_logps(model: nn.Module, ids: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    """([rows] summed log p of each row's targets ``ids[:, 1:]`` under ``mask[:, 1:]``, fp32,
    [rows] target tokens): the logits upcast to fp32, log p = logit - logsumexp."""
    logits = model(ids[:, :-1]).astype(mx.float32)
    picked = mx.take_along_axis(logits, ids[:, 1:, None], axis=-1).squeeze(-1) - mx.logsumexp(logits, axis=-1)
    m = mask[:, 1:]
    return (picked * m).sum(axis=1), m.sum(axis=1)


class MlxPreference:
    """Mixed into ``MlxBackend``: its preference steps and the reference table."""

    model: Any
    spec: Any
    method: str
    _grads: dict | None
    _micro: int
    _ref_logps: np.ndarray | None = None  # precompute_reference's table: sample id -> reference log-prob
    _pair_vg: Callable | None = None  # nn.value_and_grad of _pair_loss, built on first use
    _kto_vg: Callable | None = None  # nn.value_and_grad of _kto_loss, built on first use
    _shared: Callable[[], mx.array] | None = None  # the micro-batch's shared-prompt log-probs, inside _pairs

    # provided by MlxBackend
    _arrays: Callable[[Batch], tuple[mx.array, mx.array]]
    _reseed: Callable[[], None]
    is_oom: Callable[[Exception], bool]

    def _uses_table(self) -> bool:
        o = self.spec.objective
        return bool(o.needs_reference and (o.reference == "precompute" or self.method == "full"))

    def _reference(self, batch: Batch, ids: mx.array, mask: mx.array) -> mx.array | None:
        """[rows] the reference's summed log-probabilities, evaluated, or None (ORPO, SimPO);
        inside ``_pairs``, from the micro-batch's shared-prompt row."""
        if not self.spec.objective.needs_reference:
            return None
        if self._uses_table():
            if self._ref_logps is None:
                raise RuntimeError("the reference log-probs were not precomputed before training")
            return mx.array(self._ref_logps[np.asarray(batch.indices)])
        with adapters_off(self.model):
            ref = mx.stop_gradient(self._row_logps(ids, mask))
            mx.eval(ref)  # now, while the base is in place; its graph is freed here
        if self._shared is not None:
            mx.clear_cache()  # see _pairs
        return ref

    def _row_logps(self, ids: mx.array, mask: mx.array) -> mx.array:
        """[rows] summed log-probs of a micro-batch of interleaved pairs: inside ``_shared``,
        each pair's prompt run once and the head on target positions only (shared_prompt.py);
        else ``row_logps`` over the padded rows."""
        return self._shared() if self._shared is not None else row_logps(self.model, ids, mask)[0]

    @contextmanager
    def _pairs(self, batch: Batch) -> Iterator[None]:
        """Around a pair micro-batch's reference pass, forward and backward: its shared-prompt
        row where the model allows it and the rows are not packed (``_row_logps`` reads it).

        The buffers a shared-prompt row frees are released after its reference pass and after
        its step (``mx.clear_cache``): the row is as long as its pairs (no ``pad_multiple``),
        so they fit no later row (MLX reuses a cached buffer only of about the size asked), and
        kept they only add to the process's memory. Measured on the tiny Qwen2 of
        benchmarks/vs_peers.py (4 pairs of 350-380 tokens a step, MLX's CPU backend, cache limit
        300 MiB as memory.cache_limit=auto sets it after step 1): peak RSS 885 MiB kept, 666 MiB
        released (689 released after the reference pass only); the MLX peak 293 MiB either way."""
        if batch.position_ids is not None or self.spec.objective.unpaired:
            yield
            return
        with shared_rows(self.model, batch.input_ids, batch.loss_mask) as self._shared:
            try:
                yield
            finally:
                if self._shared is not None:
                    mx.clear_cache()
                self._shared = None

    def precompute_reference(self, batches: list[Batch], samples: int) -> int:
        """The reference log-probability of every sample, in passes over ``batches`` (the model
        as it is now: before step 1, the reference), in eval mode. Returns the table's bytes
        (one fp32 a sample). A no-op unless the run reads a table."""
        if not self._uses_table():
            return 0
        table = np.zeros(samples, np.float32)
        self.model.eval()
        try:
            with adapters_off(self.model):  # none under method=full
                for b in batches:
                    ids, mask = self._arrays(b)
                    with self._pairs(b):  # each pair's prompt once, as the step runs it
                        logps = self._row_logps(ids, mask)
                        mx.eval(logps)
                    table[np.asarray(b.indices)] = np.array(logps)
        finally:
            self.model.train()
        self._ref_logps = table
        return int(table.nbytes)

    def _pair_terms(self, ids: mx.array, mask: mx.array, ref: mx.array | None) -> PairTerms:
        logps, tokens = self._row_logps(ids, mask), mask[:, 1:].sum(axis=1)
        rc, rr = (ref[0::2], ref[1::2]) if ref is not None else (None, None)
        return objectives.pair_terms(self.spec.objective, mx, logps[0::2], logps[1::2], tokens[0::2], tokens[1::2],
                                     rc, rr)

    def _pair_loss(self, ids: mx.array, mask: mx.array, ref: mx.array | None, per_pair: float,
                   per_chosen_token: float) -> tuple[mx.array, ...]:
        """(the micro-batch's share of its step's loss, then what the metrics read): what
        ``nn.value_and_grad`` differentiates (its first output only)."""
        terms = self._pair_terms(ids, mask, ref)
        loss = objectives.scaled_loss(terms, per_pair, per_chosen_token)
        return loss, terms.chosen_rewards, terms.rejected_rewards, terms.chosen_logps, terms.rejected_logps

    @staticmethod
    def _sums(loss: mx.array, cr: mx.array, rr: mx.array, lc: mx.array, lr: mx.array) -> PairSums:
        return PairSums(float(loss), int(cr.size), float(cr.sum()), float(rr.sum()), float((cr > rr).sum()),
                        float(lc.sum()), float(lr.sum()))

    def forward_backward_pairs(self, batch: Batch, per_pair: float, per_chosen_token: float,
                               on_phase: PhaseHook | None = None) -> PairSums:
        """Accumulate the gradients of this micro-batch's share of its step's loss
        (``objectives.scaled_loss``); return that share and the metrics' sums. value_and_grad
        fuses forward and backward, so only the "backward" phase is reported.

        Raises:
            OutOfMemory: as ``forward_backward`` (the gradients summed before it are kept).
        """
        self._reseed()
        ids, mask = self._arrays(batch)
        if self._pair_vg is None:
            self._pair_vg = nn.value_and_grad(self.model, self._pair_loss)
        vg = self._pair_vg
        with self._pairs(batch):
            out = self._accumulate(lambda: vg(ids, mask, self._reference(batch, ids, mask), per_pair,
                                              per_chosen_token), on_phase)
        return self._sums(*out)

    def _accumulate(self, run: Callable[[], tuple[Any, Any]], on_phase: PhaseHook | None) -> Any:
        """``run()``'s (outputs, gradients), the gradients added to the step's so far and both
        evaluated (memory figures are real after this); the outputs. An MLX out-of-memory error
        becomes OutOfMemory, the step's earlier gradients kept."""
        try:
            out, grads = run()
            total = grads if self._grads is None else tree_map(mx.add, self._grads, grads)
            mx.eval(out, total)
        except RuntimeError as e:
            if self.is_oom(e):
                raise OutOfMemory(str(e)) from e
            raise
        self._grads = total
        self._micro += 1
        if on_phase is not None:
            on_phase("backward")
        return out

    def eval_pairs(self, batch: Batch, per_pair: float, per_chosen_token: float) -> PairSums:
        """``forward_backward_pairs``' sums in eval mode, without gradients."""
        ids, mask = self._arrays(batch)
        self.model.eval()
        try:
            with self._pairs(batch):
                out = self._pair_loss(ids, mask, self._reference(batch, ids, mask), per_pair,
                                      per_chosen_token)
                mx.eval(out)
        finally:
            self.model.train()
        return self._sums(*out)

    # -- KTO ---------------------------------------------------------------------------------
    def kto_kl(self, kl_rows: Batch, rows: int) -> float:
        """KTO's reference point z0 of a step (``objectives.kto_kl``) from its mismatched rows,
        ``rows`` rows a forward, no gradient: the policy as it is, then the base with the
        adapters off. Once per optimizer step, before its micro-batches (backends/cuda/
        preference.py ``kto_kl``: every split of the step sees the same z0).

        Raises:
            OutOfMemory: a forward of ``rows`` rows did not fit.
        """
        pol, ref = [], []
        try:
            for micro in kl_rows.split(rows):
                ids, mask = self._arrays(micro)
                p = mx.stop_gradient(row_logps(self.model, ids, mask)[0])
                mx.eval(p)
                with adapters_off(self.model):
                    r = mx.stop_gradient(row_logps(self.model, ids, mask)[0])
                    mx.eval(r)
                pol.append(p)
                ref.append(r)
            return float(objectives.kto_kl(mx, mx.concatenate(pol), mx.concatenate(ref)))
        except RuntimeError as e:
            if self.is_oom(e):
                raise OutOfMemory(f"KTO's KL pass: {e}") from e
            raise

    def _kto_loss(self, ids: mx.array, mask: mx.array, ref: mx.array, desirable: mx.array, kl: float,
                  per_record: float) -> tuple[mx.array, ...]:
        """(the micro-batch's share of its step's loss, then what the metrics read): what
        ``nn.value_and_grad`` differentiates (its first output only)."""
        logps, _ = row_logps(self.model, ids, mask)
        terms = objectives.kto_terms(self.spec.objective, mx, logps, ref, desirable, kl)
        return terms.losses.sum() * per_record, terms.chosen_rewards, terms.chosen_logps

    @staticmethod
    def _kto_sums(loss: mx.array, rewards: mx.array, logps: mx.array, desirable: np.ndarray, kl: float) -> PairSums:
        r, lp, d = np.array(rewards, np.float64), np.array(logps, np.float64), desirable
        return PairSums(float(loss), 0, float(r[d].sum()), float(r[~d].sum()), 0.0, float(lp[d].sum()),
                        float(lp[~d].sum()), chosen_n=int(d.sum()), rejected_n=int((~d).sum()), kl=kl)

    def forward_backward_unpaired(self, batch: Batch, per_record: float, kl: float,
                                  on_phase: PhaseHook | None = None) -> PairSums:
        """KTO: accumulate the gradients of this micro-batch's share of its step's loss (its
        records' losses times ``per_record``, 1 / the step's records) at the step's ``kl``;
        return that share and the metrics' sums.

        Raises:
            OutOfMemory: as ``forward_backward``.
        """
        self._reseed()
        ids, mask = self._arrays(batch)
        labels = unpaired_labels(batch)
        if self._kto_vg is None:
            self._kto_vg = nn.value_and_grad(self.model, self._kto_loss)
        vg = self._kto_vg
        out = self._accumulate(lambda: vg(ids, mask, self._reference(batch, ids, mask), mx.array(labels), kl,
                                          per_record), on_phase)
        return self._kto_sums(out[0], out[1], out[2], labels, kl)

    def eval_unpaired(self, batch: Batch, per_record: float, kl: float) -> PairSums:
        """``forward_backward_unpaired``'s sums in eval mode, without gradients."""
        ids, mask = self._arrays(batch)
        labels = unpaired_labels(batch)
        self.model.eval()
        try:
            out = self._kto_loss(ids, mask, self._reference(batch, ids, mask), mx.array(labels), kl, per_record)
            mx.eval(out)
        finally:
            self.model.train()
        return self._kto_sums(out[0], out[1], out[2], labels, kl)
