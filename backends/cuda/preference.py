"""The cuda backend's preference step (``objective=dpo|orpo|simpo|kto``): chosen and rejected rows
through the model as one batch, the reference's log-probabilities, the loss of
finetune/objectives.py. KTO's records are rows of their own, labelled in the mask
(finetune/objectives.py ``unpaired_labels``), and its KL reference point is taken once a step
over the step's mismatched rows (``kto_kl``), before the step's micro-batches.

A micro-batch holds whole pairs, interleaved (finetune/data/pairs.py): even rows the chosen
completions, odd rows the rejected. One forward gives every row's summed completion
log-probability; the reference's come from

- the base with the adapters off (PEFT's ``disable_adapter()``) under LoRA/DoRA/QLoRA, under
  ``torch.no_grad()``: no activation is kept for backward (TRL's DPOTrainer with a PEFT model
  and no ref_model: ``use_adapter(model, None)``);
- a table computed in one no-grad pass before step 1 (``precompute_reference``) under
  method=full or objective.reference=precompute: TRL's ``precompute_ref_log_probs``. The table
  is one fp32 number per sample, keyed by the sample's id (``Batch.indices``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from finetune import objectives
from finetune.backends.base import Batch, OutOfMemory
from finetune.backends.cuda import shared_prompt
from finetune.backends.cuda.loss import _body, _head_applies, head_call, output_head
from finetune.data.pair_layout import Layout
from finetune.objectives import PairSums, PairTerms, unpaired_labels


class CudaPreference:
    """Mixed into ``CudaBackend``: what its preference steps add (the reference table)."""

    model: Any
    spec: Any
    scaler: Any
    _ref_logps: np.ndarray | None = None  # precompute_reference's table: sample id -> reference log-prob

    # provided by CudaBackend
    _to_device: Callable[..., torch.Tensor]
    _autocast: Callable[[], Any]
    zero_grad: Callable[[], None]
    release_cache: Callable[[], None]

    def _row_logps(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows] summed log p of each row's targets, fp32, [rows] target tokens): one forward
        of every row, the head's logits upcast to fp32 before log_softmax. The head runs on the
        completion's target positions only (backends/cuda/loss.py's target head: the model's
        body, its hidden states at the targets gathered, the head on those), the same numbers
        as the head on every position, where the model's logits are its head applied to its
        hidden states (checked once per model); else on every position."""
        return self._logps_of(batch.input_ids, batch.loss_mask)

    def _logps_of(self, ids_np: np.ndarray, mask_np: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``_row_logps`` of the padded rows ``ids_np`` with their loss mask ``mask_np``."""
        ids = self._to_device(ids_np, np.int64)
        mask = self._to_device(mask_np, np.float32)[:, 1:]
        if not _head_applies(self.model, ids, None, self._autocast):
            with self._autocast():
                logits = self.model(input_ids=ids, use_cache=False).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            picked = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            return (picked * mask).sum(dim=1), mask.sum(dim=1)
        hook = output_head(self.model)
        hidden = _body(self.model, hook, ids, None, self._autocast)
        width = hidden.shape[1] - 1
        at = mask.reshape(-1).nonzero().squeeze(1)  # the mask is 0/1 (a pair's completion tokens)
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, at.to(hidden.device))
        with self._autocast():
            logits = head_call(self.model, hook)(flat)
        targets = ids[:, 1:].reshape(-1).index_select(0, at).to(logits.device)
        picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        sums = torch.zeros(ids.shape[0], dtype=picked.dtype, device=picked.device).index_add(
            0, (at // width).to(picked.device), picked)
        return sums.to(mask.device), mask.sum(dim=1)

    def _pair_logps(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``_row_logps`` of a micro-batch of interleaved pairs: each pair's prompt run once
        (backends/cuda/shared_prompt.py) where the model allows it and the rows are not packed,
        else the padded rows. Not where the reference is a precomputed table: its passes batch
        the pairs otherwise than the steps, and a pair's row is as wide as its micro-batch's
        widest, whose masked keys move its sums by rounding (at step 1 a reward of ~1e-8 rather
        than 0 flips rewards/accuracies); the adapters-off reference runs the step's own rows."""
        if batch.position_ids is None and not self.spec.objective.unpaired and not self._uses_table() \
                and shared_prompt.applies(
                self.model, lambda i, m: self._logps_of(i, m)[0], self._shared_logps) is None:
            got = self._shared_logps(batch.input_ids, batch.loss_mask)
            if got is not None:
                return got, self._to_device(batch.loss_mask, np.float32)[:, 1:].sum(dim=1)
        return self._row_logps(batch)

    def _shared_logps(self, ids_np: np.ndarray, mask_np: np.ndarray) -> torch.Tensor | None:
        """[rows] each row's summed target log-probs (fp32) from one shared-prompt row of the
        interleaved pairs ``ids_np`` (the head on the targets only); None where a row has no
        target or the head is not the body's output as loss.py applies it."""
        try:
            lay = Layout(np.asarray(ids_np), np.asarray(mask_np))
        except ValueError:
            return None
        if not lay.shared:  # no prompt to share: the padded rows
            return None
        rows = shared_prompt.PairRows(lay)
        ids = self._to_device(rows.ids, np.int64)
        if not _head_applies(self.model, ids, None, self._autocast):
            return None
        hook = output_head(self.model)
        impl = str(getattr(shared_prompt._config(self.model), "_attn_implementation", "sdpa"))
        dtype = next(self.model.parameters()).dtype
        mask = rows.mask(impl, dtype if dtype.is_floating_point else torch.float32).to(ids.device)
        pos = self._to_device(rows.positions, np.int64)
        shared_prompt.mark(mask, rows)
        hidden = _body(self.model, hook, ids, mask, self._autocast, pos)
        at = torch.from_numpy(rows.gather).to(hidden.device)
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, at)
        with self._autocast():
            logits = head_call(self.model, hook)(flat)
        targets = torch.from_numpy(lay.targets.astype(np.int64)).to(logits.device)
        picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return torch.from_numpy(lay.weights).to(picked.device) @ picked

    def _uses_table(self) -> bool:
        o = self.spec.objective
        return o.needs_reference and (o.reference == "precompute" or self.spec.method.name == "full")

    def _reference(self, batch: Batch) -> torch.Tensor | None:
        """[rows] the reference's summed log-probabilities, or None (ORPO, SimPO)."""
        if not self.spec.objective.needs_reference:
            return None
        if self._uses_table():
            if self._ref_logps is None:
                raise RuntimeError("the reference log-probs were not precomputed before training")
            return torch.from_numpy(self._ref_logps[np.asarray(batch.indices)]).to(self.device_of_loss())
        with torch.no_grad(), self.model.disable_adapter():
            return self._pair_logps(batch)[0]

    def device_of_loss(self) -> torch.device:
        return next(p for p in self.model.parameters()).device

    def precompute_reference(self, batches: list[Batch], samples: int) -> int:
        """The reference log-probability of every sample, in no-grad passes over ``batches``
        (the model as it is now: before step 1, the reference), in eval mode. Returns the
        table's bytes (one fp32 a sample). A no-op unless the run reads a table."""
        if not self._uses_table():
            return 0
        table = np.zeros(samples, np.float32)
        self.model.eval()
        try:
            with torch.no_grad():
                off = self.model.disable_adapter() if hasattr(self.model, "disable_adapter") \
                    else contextlib.nullcontext()
                with off:
                    for b in batches:
                        table[np.asarray(b.indices)] = self._pair_logps(b)[0].cpu().numpy()
        finally:
            self.model.train()
        self._ref_logps = table
        return int(table.nbytes)

    def _terms(self, batch: Batch) -> tuple[PairTerms, torch.Tensor]:
        logps, tokens = self._pair_logps(batch)
        ref = self._reference(batch)
        rc, rr = (ref[0::2], ref[1::2]) if ref is not None else (None, None)
        terms = objectives.pair_terms(self.spec.objective, torch, logps[0::2], logps[1::2], tokens[0::2], tokens[1::2],
                                      rc, rr)
        return terms, tokens

    @staticmethod
    def _sums(terms: PairTerms, loss: torch.Tensor) -> PairSums:
        cr, rr = terms.chosen_rewards.detach(), terms.rejected_rewards.detach()
        return PairSums(float(loss.detach()), int(cr.numel()), float(cr.sum()), float(rr.sum()),
                        float((cr > rr).float().sum()), float(terms.chosen_logps.detach().sum()),
                        float(terms.rejected_logps.detach().sum()))

    def forward_backward_pairs(self, batch: Batch, per_pair: float, per_chosen_token: float,
                               on_phase: Callable[[str], None] | None = None) -> PairSums:
        """Accumulate the gradients of this micro-batch's share of its step's loss
        (``objectives.scaled_loss``); return that share and the metrics' sums.

        Raises:
            OutOfMemory: as ``forward_backward`` (every gradient of the step dropped).
        """
        def compute() -> tuple[torch.Tensor, Callable[[torch.Tensor], PairSums]]:
            terms, _ = self._terms(batch)
            return objectives.scaled_loss(terms, per_pair, per_chosen_token), lambda loss: self._sums(terms, loss)

        return self._backward(compute, on_phase)

    def _backward(self, compute: Callable[[], tuple[torch.Tensor, Callable[[torch.Tensor], PairSums]]],
                  on_phase: Callable[[str], None] | None) -> PairSums:
        try:
            loss, sums_of = compute()
            if on_phase:
                on_phase("forward")
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            sums = sums_of(loss)
        except torch.OutOfMemoryError as e:
            message = str(e).splitlines()[0] if str(e) else "out of memory"
        else:
            if on_phase:
                on_phase("backward")
            return sums
        loss = sums_of = None  # type: ignore[assignment]
        self.zero_grad()
        self.release_cache()
        raise OutOfMemory(f"torch.OutOfMemoryError in forward/backward: {message}")

    # -- KTO ---------------------------------------------------------------------------------
    def kto_kl(self, kl_rows: Batch, rows: int) -> float:
        """KTO's reference point z0 of a step (``objectives.kto_kl``) from its mismatched rows
        (finetune/data/pairs.py ``UnpairedSource.kl_batch``), ``rows`` rows a forward, no grad:
        the policy as it is, then the base with the adapters off. Taken once per optimizer step,
        over the whole step's records, before its micro-batches: every split of the step sees
        the same z0, so the same loss (TRL takes it per device batch: the same where a step is
        one batch).

        Raises:
            OutOfMemory: a forward of ``rows`` rows did not fit.
        """
        try:
            with torch.no_grad():
                pol, ref = [], []
                for micro in kl_rows.split(rows):
                    pol.append(self._row_logps(micro)[0])
                    with self.model.disable_adapter():
                        ref.append(self._row_logps(micro)[0])
                return float(objectives.kto_kl(torch, torch.cat(pol), torch.cat(ref)))
        except torch.OutOfMemoryError as e:
            message = str(e).splitlines()[0] if str(e) else "out of memory"
        self.release_cache()
        raise OutOfMemory(f"torch.OutOfMemoryError in KTO's KL pass: {message}")

    def _kto(self, batch: Batch, kl: float) -> tuple[PairTerms, torch.Tensor]:
        logps, _ = self._row_logps(batch)
        ref = self._reference(batch)
        desirable = torch.from_numpy(unpaired_labels(batch)).to(logps.device)
        return objectives.kto_terms(self.spec.objective, torch, logps, ref, desirable, kl), desirable

    @staticmethod
    def _kto_sums(terms: PairTerms, desirable: torch.Tensor, loss: torch.Tensor, kl: float) -> PairSums:
        r, lp = terms.chosen_rewards.detach(), terms.chosen_logps.detach()
        d = desirable
        return PairSums(float(loss.detach()), 0, float(r[d].sum()), float(r[~d].sum()), 0.0, float(lp[d].sum()),
                        float(lp[~d].sum()), chosen_n=int(d.sum()), rejected_n=int((~d).sum()), kl=kl)

    def forward_backward_unpaired(self, batch: Batch, per_record: float, kl: float,
                                  on_phase: Callable[[str], None] | None = None) -> PairSums:
        """KTO: accumulate the gradients of this micro-batch's share of its step's loss (its
        records' losses times ``per_record``, 1 / the step's records) at the step's ``kl``;
        return that share and the metrics' sums.

        Raises:
            OutOfMemory: as ``forward_backward``.
        """
        def compute() -> tuple[torch.Tensor, Callable[[torch.Tensor], PairSums]]:
            terms, desirable = self._kto(batch, kl)
            return terms.losses.sum() * per_record, lambda loss: self._kto_sums(terms, desirable, loss, kl)

        return self._backward(compute, on_phase)

    def eval_unpaired(self, batch: Batch, per_record: float, kl: float) -> PairSums:
        """``forward_backward_unpaired``'s sums in eval mode, without gradients."""
        self.model.eval()
        try:
            with torch.no_grad():
                terms, desirable = self._kto(batch, kl)
                return self._kto_sums(terms, desirable, terms.losses.sum() * per_record, kl)
        finally:
            self.model.train()

    def eval_pairs(self, batch: Batch, per_pair: float, per_chosen_token: float) -> PairSums:
        """``forward_backward_pairs``' sums in eval mode, without gradients."""
        self.model.eval()
        try:
            with torch.no_grad():
                terms, _ = self._terms(batch)
                return self._sums(terms, objectives.scaled_loss(terms, per_pair, per_chosen_token))
        finally:
            self.model.train()
