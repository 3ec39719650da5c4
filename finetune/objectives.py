"""The preference losses (``objective=dpo|orpo|simpo|kto``), one formula each, framework-neutral.

Every function takes ``xp``, the array namespace of the backend that calls it (``torch`` on cuda,
``mlx.core`` on mlx): the formulas use only what both spell alike (``logaddexp``, ``maximum``,
``zeros_like``, ``log1p``, ``expm1``, ``exp``, ``log``, ``where``), so the two backends compute
the same numbers from the same log-probabilities. Nothing here imports torch or mlx.

A pair's log-probability is the sum, over its completion's target tokens (the loss mask: the
prompt never counts), of log p(token | everything before it); ``*_tokens`` counts those tokens.

The loss of an optimizer step is the mean over its pairs (TRL's ``per_sequence_loss.mean()``);
the loop passes each micro-batch the step's ``1 / pairs`` (and ORPO's NLL ``1 / chosen target
tokens``), so any split into micro-batches of whole pairs sums to the same loss and gradients
(backends/base.py's contract: a sum times a scale of the whole step).

Metrics carry TRL's names (``METRICS``): ``rewards/chosen`` and ``rewards/rejected`` are the
step's mean implicit rewards, ``rewards/accuracies`` the share of pairs whose chosen reward is
the higher, ``rewards/margins`` the mean difference, ``logps/*`` the mean log-probabilities (as
the objective uses them: summed for DPO, averaged per token for ORPO and SimPO).

KTO (``kto_terms``) trains on unpaired records labelled desirable or not: ``rewards/chosen`` and
``logps/chosen`` are means over the step's desirable records, ``*/rejected`` over its
undesirable ones, ``rewards/margins`` their difference, ``kl`` the step's reference point (TRL's
KTOTrainer logs the same); ``rewards/accuracies`` compares pairs and is null (TRL logs none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from finetune.spec import ObjectiveSpec

LN2 = math.log(2.0)  # DPO's sigmoid loss where the policy equals the reference (-log sigmoid(0))

# TRL's metric names (trl/trainer/dpo_trainer.py _compute_loss, experimental/cpo and orpo
# get_batch_loss_metrics), in the order the run log writes them
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def logsigmoid(xp: Any, x: Any) -> Any:
    """log(sigmoid(x)) = -log(1 + exp(-x)), stable for either sign."""
    return -xp.logaddexp(xp.zeros_like(x), -x)


def log1mexp(xp: Any, x: Any) -> Any:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (Maechler 2012; TRL's
    experimental/orpo/orpo_trainer.py ``log1mexp`` branches the same way)."""
    return xp.where(x < -LN2, xp.log1p(-xp.exp(x)), xp.log(-xp.expm1(x)))


@dataclass(frozen=True)
class PairTerms:
    """Per-pair results of an objective: the loss to average over pairs, the implicit rewards,
    the log-probabilities logged as ``logps/*`` and (ORPO) the chosen NLL summed over tokens."""

    losses: Any  # [P]
    chosen_rewards: Any  # [P], no gradient needed
    rejected_rewards: Any  # [P]
    chosen_logps: Any  # [P], as logged
    rejected_logps: Any  # [P]
    chosen_nll_sum: Any | None = None  # ORPO: sum over the chosen completions' tokens of -log p


def pair_terms(obj: ObjectiveSpec, xp: Any, chosen_logps: Any, rejected_logps: Any, chosen_tokens: Any,
               rejected_tokens: Any, ref_chosen_logps: Any = None, ref_rejected_logps: Any = None) -> PairTerms:
    """The per-pair loss and rewards of ``obj`` from summed completion log-probabilities.

    Args:
        chosen_logps, rejected_logps: [P] sums of log p over each completion's target tokens.
        chosen_tokens, rejected_tokens: [P] target tokens of each completion (float).
        ref_chosen_logps, ref_rejected_logps: [P] the reference's sums (DPO only).
    """
    if obj.name == "dpo":
        return _dpo(obj, xp, chosen_logps, rejected_logps, chosen_tokens, rejected_tokens, ref_chosen_logps,
                    ref_rejected_logps)
    if obj.name == "orpo":
        return _orpo(obj, xp, chosen_logps, rejected_logps, chosen_tokens, rejected_tokens)
    if obj.name == "simpo":
        return _simpo(obj, xp, chosen_logps, rejected_logps, chosen_tokens, rejected_tokens)
    raise ValueError(f"objective {obj.name} has no pair loss")


def _dpo(obj: ObjectiveSpec, xp: Any, pc: Any, pr: Any, nc: Any, nr: Any, rc: Any, rr: Any) -> PairTerms:
    """DPO and its variants on the log-ratios to the reference.

    - sigmoid: -log sigmoid(beta * (log-ratio chosen - log-ratio rejected)), Rafailov et al. 2023
      "Direct Preference Optimization", eq. 7; with label smoothing eps, the conservative cDPO
      (Mitchell 2023): -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d) (TRL 1.16's
      ``robust``/``aot`` and CPO's sigmoid weight the two terms alike; at eps=0 it is TRL's
      DPOTrainer ``loss_type="sigmoid"``, trl/trainer/dpo_trainer.py ``_compute_loss``).
    - ipo: (d / tokens - 1 / (2 beta))^2, Azar et al. 2023 "A General Theoretical Paradigm to
      Understand Learning from Human Preferences", eq. 17, each log-ratio averaged over its
      completion's tokens as TRL's ``loss_type="ipo"`` does (confirmed with the authors, per TRL).
    - hinge: relu(1 - beta d), SLiC-HF (Zhao et al. 2023), TRL's ``loss_type="hinge"``.

    Rewards: beta * log-ratio (TRL). logps/*: the policy's summed log-probabilities.
    """
    cr, rr_ = pc - rc, pr - rr
    d = cr - rr_
    b = obj.beta
    if obj.loss_type == "sigmoid":
        eps = obj.label_smoothing
        losses = -logsigmoid(xp, b * d)
        if eps:
            losses = (1 - eps) * losses - eps * logsigmoid(xp, -b * d)
    elif obj.loss_type == "ipo":
        delta = cr / xp.maximum(nc, xp.zeros_like(nc) + 1) - rr_ / xp.maximum(nr, xp.zeros_like(nr) + 1)
        losses = (delta - 1 / (2 * b)) ** 2
    elif obj.loss_type == "hinge":
        z = 1 - b * d
        losses = xp.maximum(z, xp.zeros_like(z))
    else:
        raise ValueError(f"objective.loss_type={obj.loss_type} is not a DPO loss")
    return PairTerms(losses, b * cr, b * rr_, pc, pr)


def _orpo(obj: ObjectiveSpec, xp: Any, pc: Any, pr: Any, nc: Any, nr: Any) -> PairTerms:
    """ORPO, Hong et al. 2024 "ORPO: Monolithic Preference Optimization without Reference
    Model", eqs. 4-7: L = NLL(chosen) - lambda * log sigmoid(log odds(chosen) - log odds(rejected)),
    where log odds(y) = log p - log(1 - p) with p the completion's per-token mean probability
    (TRL's experimental/orpo/orpo_trainer.py ``odds_ratio_loss`` with ``average_log_prob=True``;
    lambda is TRL's ``beta``). The NLL is the chosen completions' token mean over the step (the
    loop's scale); TRL's ORPO counts the prompt's tokens in it too, the paper and we only the
    completion's.

    Rewards: beta * mean log p (TRL). logps/*: the per-token mean log-probabilities.
    """
    ac = pc / xp.maximum(nc, xp.zeros_like(nc) + 1)
    ar = pr / xp.maximum(nr, xp.zeros_like(nr) + 1)
    log_odds = (ac - ar) - (log1mexp(xp, ac) - log1mexp(xp, ar))
    losses = -obj.beta * logsigmoid(xp, log_odds)
    return PairTerms(losses, obj.beta * ac, obj.beta * ar, ac, ar, chosen_nll_sum=-pc)


def _simpo(obj: ObjectiveSpec, xp: Any, pc: Any, pr: Any, nc: Any, nr: Any) -> PairTerms:
    """SimPO, Meng et al. 2024 "SimPO: Simple Preference Optimization with a Reference-Free
    Reward", eq. 6: -log sigmoid(beta * mean log p(chosen) - beta * mean log p(rejected) - gamma)
    (TRL's experimental/cpo/cpo_trainer.py ``cpo_loss`` with ``loss_type="simpo"``,
    ``cpo_alpha=0``, ``label_smoothing=0``: beta * (logits - gamma / beta)).

    Rewards: beta * mean log p (TRL). logps/*: the per-token mean log-probabilities.
    """
    ac = pc / xp.maximum(nc, xp.zeros_like(nc) + 1)
    ar = pr / xp.maximum(nr, xp.zeros_like(nr) + 1)
    losses = -logsigmoid(xp, obj.beta * (ac - ar) - obj.gamma)
    return PairTerms(losses, obj.beta * ac, obj.beta * ar, ac, ar)


def unpaired_labels(batch: Any) -> Any:
    """[rows] bool numpy array: each KTO row's label (true: desirable), which its first mask
    entry holds (finetune/data/tokens.py ``_unpaired_chunk``; that entry is never a target)."""
    import numpy as np

    return np.asarray(batch.loss_mask[:, 0]) == 1


def kto_kl(xp: Any, kl_logps: Any, ref_kl_logps: Any) -> Any:
    """KTO's reference point z0 (Ethayarajh et al. 2024 "KTO: Model Alignment as Prospect
    Theoretic Optimization", eq. 7 and sec. 4.1): KL(policy || reference) estimated as the mean,
    over mismatched (prompt, completion) rows, of the summed completion log-ratio, clamped at 0 and
    carrying no gradient (trl/trainer/kto_trainer.py ``KTOTrainer._compute_loss``:
    ``(KL_logps - ref_KL_logps).mean().detach()``, ``.clamp(min=0)``)."""
    kl = (kl_logps - ref_kl_logps).mean()
    return xp.maximum(kl, xp.zeros_like(kl))


def kto_terms(obj: ObjectiveSpec, xp: Any, logps: Any, ref_logps: Any, desirable: Any, kl: float) -> PairTerms:
    """KTO's per-record loss, Ethayarajh et al. 2024 eq. 7 (TRL's KTOTrainer ``_compute_loss``
    with ``loss_type="kto"``): with r = log p - log p_ref over the completion's tokens,

    - desirable: lambda_D * (1 - sigmoid(beta * (r - z0)))
    - undesirable: lambda_U * (1 - sigmoid(beta * (z0 - r)))

    z0 = ``kl`` (``kto_kl``). The step's loss is the mean over its records (TRL's
    ``losses.nanmean()``): the loop scales each micro-batch by 1 / the step's records.

    Args:
        logps, ref_logps: [R] summed completion log-probabilities of the policy and the reference.
        desirable: [R] bool, the records' labels.

    Returns ``PairTerms`` over records: ``losses`` [R]; ``chosen_rewards`` beta * r of every
    record, ``rejected_rewards`` the same (``kto_sums`` splits them by label); ``*_logps`` the
    policy's sums.
    """
    r = logps - ref_logps
    b = obj.beta
    # 1 - sigmoid(x) = sigmoid(-x) = exp(logsigmoid(-x))
    wd = xp.where(desirable, xp.zeros_like(r) + obj.desirable_weight, xp.zeros_like(r) + obj.undesirable_weight)
    x = xp.where(desirable, b * (r - kl), b * (kl - r))
    losses = wd * xp.exp(logsigmoid(xp, -x))
    return PairTerms(losses, b * r, b * r, logps, logps)


@dataclass
class PairSums:
    """What a micro-batch of pairs (or of KTO's records) adds to its step: the scaled loss
    (summing to the step's loss) and the sums its metrics are means of. Plain floats: the loop
    adds them up. KTO's records set ``chosen_n``/``rejected_n`` (desirable and undesirable
    records; pairs leave them None: each is ``pairs``) and ``kl``, the step's reference point."""

    loss: float = 0.0  # already scaled: the step's loss is the sum over its micro-batches
    pairs: int = 0
    rewards_chosen: float = 0.0
    rewards_rejected: float = 0.0
    correct: float = 0.0  # pairs whose chosen reward beats the rejected one
    logps_chosen: float = 0.0
    logps_rejected: float = 0.0
    chosen_n: int | None = None  # KTO: desirable records
    rejected_n: int | None = None  # KTO: undesirable records
    kl: float | None = None  # KTO: the step's z0, the same for each of its micro-batches

    def add(self, other: PairSums) -> PairSums:
        a, b = self.astuple(), other.astuple()
        unpaired = self.chosen_n is not None or other.chosen_n is not None
        n = (lambda x, y: (x or 0) + (y or 0) if unpaired else None)
        rc, rr, correct, lc, lr = (x + y for x, y in zip(a[2:], b[2:]))
        return PairSums(a[0] + b[0], int(a[1] + b[1]), rc, rr, correct, lc, lr,
                        chosen_n=n(self.chosen_n, other.chosen_n), rejected_n=n(self.rejected_n, other.rejected_n),
                        kl=other.kl if other.kl is not None else self.kl)

    def astuple(self) -> tuple[float, ...]:
        return (self.loss, self.pairs, self.rewards_chosen, self.rewards_rejected, self.correct, self.logps_chosen,
                self.logps_rejected)

    def metrics(self, prefix: str = "") -> dict[str, float | None]:
        """TRL's metrics (``METRICS``, and KTO's ``kl``): means over the pairs (KTO: over each
        label's records) summed; ``prefix`` "eval_" for validation, as TRL names them there."""
        if self.chosen_n is not None:
            nc, nr = self.chosen_n, self.rejected_n or 0
            mc = (self.rewards_chosen / nc, self.logps_chosen / nc) if nc else (None, None)
            mr = (self.rewards_rejected / nr, self.logps_rejected / nr) if nr else (None, None)
            margin = mc[0] - mr[0] if mc[0] is not None and mr[0] is not None else None
            kto = (mc[0], mr[0], None, margin, mc[1], mr[1])
            return {**{prefix + k: v for k, v in zip(METRICS, kto)}, prefix + "kl": self.kl}
        n = self.pairs
        if not n:
            return {prefix + k: None for k in METRICS}
        values = (self.rewards_chosen / n, self.rewards_rejected / n, self.correct / n,
                  (self.rewards_chosen - self.rewards_rejected) / n, self.logps_chosen / n, self.logps_rejected / n)
        return {prefix + k: float(v) for k, v in zip(METRICS, values)}


def scaled_loss(terms: PairTerms, per_pair: float, per_chosen_token: float) -> Any:
    """The micro-batch's share of its step's loss: its pairs' losses times ``per_pair`` (1 /
    the step's pairs), plus ORPO's chosen NLL times ``per_chosen_token`` (1 / the step's chosen
    target tokens)."""
    loss = terms.losses.sum() * per_pair
    if terms.chosen_nll_sum is not None:
        loss = loss + terms.chosen_nll_sum.sum() * per_chosen_token
    return loss
