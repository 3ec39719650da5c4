"""What a preference step adds to a plan (``objective=dpo|orpo|simpo``), on top of pricing.

A preference run's micro-batch is ``train.batch_size`` pairs (finetune/data/pairs.py): the
governor's levers and the planner's micro-batch searches move it in whole pairs, as the loop's
pair step splits a step (``Batch.split(2 * micro)``). Priced here, with the backend's memory
model saying what its framework holds:

- both sequences: a micro-batch of P pairs is 2P rows through the model at the pair's width
  (chosen and rejected as one batch), so every activation and the head are priced at 2P rows
  (``rows_setup``); where the backend's preference step computes the log-probs over every
  position's whole logits (the memory model's ``PAIR_HEAD_WHOLE``), the target-only head does
  not apply to it; ``train.loss_chunk`` never applies to a pair step, and is priced as not applied;
  where it runs each pair's prompt once (``PAIR_PROMPT_ONCE``: mlx, backends/mlx/shared_prompt.py)
  and the data's most positions a pair takes are known (``Setup.pair_positions``), a micro-batch
  is priced as the one packed row of at most P x that many positions it runs as; where it runs
  one row a pair (the setup's ``pair_row_each``: cuda, backends/cuda/shared_prompt.py), as P
  rows of the data's pair_positions (else 2T - 1, the bound) with the rows' [P, 1, L, L] mask;
- the reference under LoRA/DoRA/QLoRA (objective.reference=auto): a no-grad forward of the same
  rows with the adapters off, run after the policy's forward while its saved activations and
  log-probs are alive; it keeps nothing but its [rows] log-probs, so it adds a transient: one
  layer's temporaries, then its logits and log-softmax for the gather (``mm.reference_pass``);
- the reference under method=full (or objective.reference=precompute): one fp32 log-prob a
  sample, two a pair, computed in no-grad passes before step 1 and held where the backend holds
  it (``mm.REFERENCE_TABLE_WHERE``: host memory on cuda, a numpy array); no reference pass a step;
- ORPO and SimPO have no reference.

Every figure is an int of bytes. ``section`` is what plan.json holds under ``preference``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from finetune.backends import memory_model
from finetune.model.inventory import Setup
from finetune.model.types import ModelDesc

# one fp32 reference log-prob a sample (backends/cuda/preference.py precompute_reference), two a pair
REFERENCE_LOGP_BYTES = 4


def rows_setup(s: Setup) -> Setup:
    """The setup the memory model prices a step's activations with: ``batch`` rows (2 a pair),
    the head on every position in one piece where the backend's preference step computes it
    so. The same setup for SFT (and idempotent: rows_setup(rows_setup(s)) == rows_setup(s))."""
    if s.pair_rows == 1 and s.objective == "sft":
        return s
    kw: dict[str, Any] = {"batch": s.rows, "pair_rows": 1, "loss_chunk": 0}  # a pair step never chunks its head
    mm = memory_model(s.backend)
    if getattr(mm, "PAIR_HEAD_WHOLE", True) or (s.pair_rows == 1 and getattr(mm, "UNPAIRED_HEAD_WHOLE", False)):
        kw.update(target_head=False)
    T = s.seq_len - 1
    if getattr(mm, "PAIR_PROMPT_ONCE", False) and s.pair_rows == 2 and s.pair_positions and not s.packed:
        # each pair's prompt once: the micro-batch is one row of at most P x pair_positions
        # positions, its attention segment by segment (none wider than T), so priced as a packed
        # row; its targets (head_fraction of the padded rows' positions) are a larger share of it
        n = s.batch * s.pair_positions
        if n < s.rows * T:
            kw.update(batch=1, seq_len=n + 1, packed=True, pair_span=T, longest_sample=T,
                      target_fraction=min(1.0, s.target_fraction * s.rows * T / n))
    elif L := row_positions(s):
        # each pair's prompt once, one row a pair (cuda), as wide as the micro-batch's widest pair,
        # with the [P, 1, L, L] mask the rows take (``padding_mask``: the masked sdpa's k and v
        # repeated over the row and its mask per layer, a bound of the pieces shared_prompt.py
        # runs; under eager, the [P, H, L, L] scores at that width)
        kw.update(batch=s.batch, seq_len=L + 1, padding_mask=True,
                  target_fraction=min(1.0, s.target_fraction * s.rows * T / (s.batch * L)))
    return replace(s, **kw)


def row_positions(s: Setup) -> int:
    """Where the backend runs each pair's prompt once, one row a pair (``Setup.pair_row_each``:
    cuda), the positions of a row: the data's widest pair (``pair_positions``), else 2T - 1 (a
    prompt of one token shared; a pair sharing none runs as its padded rows), the bound; 0
    where a micro-batch runs as 2P padded rows (packed, KTO, a precomputed reference's steps)."""
    if not (s.pair_row_each and s.pair_rows == 2 and not s.packed and s.reference != "precomputed"):
        return 0
    return s.pair_positions or 2 * (s.seq_len - 1) - 1


def whole_head(s: Setup) -> bool:
    """A preference step: its log-probs ignore ``train.loss_chunk`` (the head on the targets at
    once, or on every position), so there is no chunked-loss lever."""
    return s.objective != "sft"


def reference_pass(arch: ModelDesc, s: Setup) -> dict[str, int]:
    """The no-grad reference forward of one micro-batch (the memory model's
    ``reference_pass``), at the rows of ``s`` (a rows setup)."""
    return memory_model(s.backend).reference_pass(arch, rows_setup(s))


def step_reference(arch: ModelDesc, s: Setup) -> dict[str, int] | None:
    """The reference pass a step runs (adapters off), None where it runs none (a table, or no
    reference at all)."""
    return reference_pass(arch, s) if s.reference == "adapters_off" else None


def table_bytes(s: Setup) -> int | None:
    """The precomputed reference log-probs: one fp32 a sample of every pair (train and
    validation, as the run computes them); 0 where the run keeps no table, None where the
    data's pairs are not known (a plan that did not read the data)."""
    if s.reference != "precomputed":
        return 0
    return 2 * REFERENCE_LOGP_BYTES * s.pairs_total if s.pairs_total else None


def add_table(s: Setup, devices: list[Any]) -> None:
    """The table in the phases of the device that holds it: on the host (every phase's host
    bytes from the load on: the run computes it before its first sample; where the device is
    the host, its device level too)."""
    table = table_bytes(s) or 0
    if not table or not devices:
        return
    where = memory_model(s.backend).REFERENCE_TABLE_WHERE
    for ph in devices[0]["phases"].values():
        if where == "host":
            ph["host_bytes"] += table
            if not devices[0].get("device_level_planned"):
                ph["device_bytes"] += table


def section(arch: ModelDesc, s: Setup, core: Any) -> dict[str, Any]:
    """plan.json's ``preference``: the pairs and rows of a micro-batch, the log-prob gathers,
    the reference as the run has it and what it costs."""
    rs = rows_setup(s)
    ref = reference_pass(arch, s) if s.reference else None
    table = table_bytes(s)
    mm = memory_model(s.backend)
    weights = core["bytes"]["weights"]
    return {
        "objective": s.objective,
        "pairs_per_micro_batch": s.batch,
        "rows_per_micro_batch": s.rows,  # chosen and rejected through the model as one batch
        # where each pair's prompt runs once, one row a pair (cuda): the positions of that row
        # as priced (the data's widest pair, or 2T - 1 without data, the bound); None: 2P rows
        "pair_row_positions": row_positions(s) or None,
        "head_on_every_position": not rs.target_head,
        # the head's logits, log-softmax and their gradients for the log-prob gathers (the plan's logits)
        "logprob_gather_bytes": core["bytes"]["logits"],
        "reference": s.reference,  # adapters_off | precomputed | None (orpo, simpo)
        # the reference's no-grad forward alone (one layer's temporaries, then its logits and
        # log-softmax), and what it adds to the step's logits region (priced in ``logits``)
        "reference_pass_transient_bytes": ref["transient"] if ref and s.reference == "adapters_off" else 0,
        "reference_pass_added_bytes": core["activations_detail"].get("reference_pass_added", 0),
        "reference_table_bytes": table,
        "reference_table_bytes_per_pair": 2 * REFERENCE_LOGP_BYTES if s.reference == "precomputed" else 0,
        "reference_table_where": mm.REFERENCE_TABLE_WHERE if s.reference == "precomputed" else None,
        "pairs_total": s.pairs_total or None,
        # before step 1, the table's no-grad passes at this micro-batch: the weights and one
        # forward's transient (no gradients or optimizer state yet)
        "reference_precompute_peak_allocated_bytes": weights + ref["transient"]
        if ref and s.reference == "precomputed" else None,
    }


def table_line(pref: dict[str, Any]) -> str:
    """mode=plan's line for a preference run (GiB = 2^30 bytes)."""
    gib = 2 ** 30
    ref = pref["reference"]
    text = (f"  objective {pref['objective']}: micro-batch {pref['pairs_per_micro_batch']} pairs = "
            f"{pref['rows_per_micro_batch']} rows (chosen + rejected, one forward); log-prob gathers "
            f"{pref['logprob_gather_bytes'] / gib:.3f} GiB")
    if ref == "adapters_off":
        text += (f"; reference: adapters off, no grad, transient {pref['reference_pass_transient_bytes'] / gib:.3f} GiB "
                 "a micro-batch")
    elif ref == "precomputed":
        table = pref["reference_table_bytes"]
        text += ("; reference: log-probs precomputed before step 1, "
                 + (f"{table:,} B" if table is not None else f"{pref['reference_table_bytes_per_pair']} B a pair")
                 + f" on the {pref['reference_table_where']}")
    else:
        text += "; no reference"
    return text
