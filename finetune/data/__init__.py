"""Data pipeline: records -> token ids with a loss mask -> length-grouped, deterministic batches.

Formats a record may take (jsonl or a hub data set):
  {"text": ...}                                   every token counts in the loss
  {"prompt": ..., "completion": ...}              only completion tokens count (data.mask_prompt)
  {"question": ..., "answer": ...}                as prompt/completion (GSM8K's shape)
  {"messages": [{"role": ..., "content": ...}]}   rendered with the tokenizer's chat template;
                                                  only assistant turns count

A file is read as other tools leave it: JSONL or one JSON array (read whole up to
``JSON_ARRAY_MAX_BYTES``), plain or gzip / bz2 / xz / zstd (told by its first bytes, not its
name), with a UTF-8 byte-order mark and CRLF line ends, or from a pipe (``data.path=<(zcat
x.gz)``: read once, never cached). A record that cannot be used is named by file and line. One
record's text is cut at ``record_char_cap`` characters before tokenizing, so a giant record
costs what its truncation to ``train.seq_len`` keeps.

The order of samples is a pure function of (seed, effective batch size, step), never of the
micro-batch, so the governor can split an optimizer step differently without changing which
samples it trains on or in what order.

Records stream from the source ``TOKENIZE_CHUNK`` at a time, so a file of any length tokenizes
in the memory of one chunk; the tokens go straight into an entry of the token cache
(finetune/data/cache.py: flat memory-mapped arrays, keyed by the data, the tokenizer and every
setting that changes tokens), which the next run and every sweep job reuse (``prepare``).

The package, one job a module, each importing only those before it: ``formats`` reads records
(files, data sets, record formats), ``tokens`` turns them into token ids and loss masks
(through the token cache), ``batches`` makes the steps' batches (split, schedule, padding,
ranks, packing's view); this module is the pipeline's front: ``build`` and ``describe``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from finetune.backends.base import padded_length
from finetune.data.cache import Ragged
from finetune.data.batches import DataSource, fit_to_micro, pad_multiple, packed_steps
from finetune.data.formats import load_records
from finetune.data.pairs import PairSource, UnpairedSource, pair_positions
from finetune.data.tokens import TOKENIZE_CHUNK, Tokenized, prepare, record_char_cap, tokenize
from finetune.errors import UserError
from finetune.spec import RunSpec

# the pipeline's front (build, describe), and what tests and benchmarks reach through it
__all__ = ["TOKENIZE_CHUNK", "DataSource", "Tokenized", "build", "describe", "load_records", "prepare",
           "record_char_cap", "tokenize"]

log = logging.getLogger("finetune")


def build(spec: RunSpec, tokenizer: Any) -> tuple[DataSource, dict[str, Any]]:
    """Load, tokenize and split the configured data. Returns the source and its stats.

    The world's ranks (``spec.world``) share each optimizer step: the source's batches hold the
    effective batch of all of them (train.batch_size * train.grad_accum per rank), and each rank
    trains its own slice (``rank_slice``)."""
    t = spec.train
    obj = spec.objective
    pairs = obj.paired
    if obj.preference and t.packing:
        raise UserError(f"objective={obj.name} does not pack its pairs yet; use train.packing=false")
    if obj.unpaired and (spec.method.name == "full" or obj.reference == "precompute"):
        # KTO's KL rows pair records anew every step: no table computed before training holds them
        raise UserError("objective=kto takes its reference from the base with the adapters off; use method=lora "
                        "(or dora, qlora) and objective.reference=auto")
    if obj.preference and spec.world.world_size > 1:
        raise UserError(f"objective={spec.objective.name} runs in one process for now; launch it without torchrun / "
                        "mlx.launch")
    tok = prepare(spec, tokenizer)
    if not tok.ids and tok.dropped_no_target:
        raise UserError(f"no completion tokens left in any of the {tok.dropped_no_target} samples after truncating to "
                        f"train.seq_len={t.seq_len} (the prompt fills it; longest sample {tok.longest} tokens); "
                        f"raise train.seq_len (e.g. train.seq_len={tok.longest}) or shorten the prompts")
    if not tok.ids:
        raise UserError("no sample has any target token after tokenizing; check the data format or train.seq_len")
    if tok.truncated:  # pairs: 2 samples a record
        log.warning("%d of %d samples were longer than train.seq_len=%d and were truncated (longest %d tokens); "
                    "raise train.seq_len to keep them whole", tok.truncated, tok.records * (2 if pairs else 1),
                    t.seq_len, tok.longest)
    if tok.dropped_no_target and pairs:
        log.warning("%d pairs had a completion with no target token within train.seq_len, or the same tokens in "
                    "both, and were dropped; raise train.seq_len to keep them", tok.dropped_no_target)
    elif tok.dropped_no_target:
        log.warning("%d samples had no target token within train.seq_len and were dropped", tok.dropped_no_target)

    cap, cut = t.packed_tokens, 0
    if cap:
        tok, cut = fit_to_micro(tok, cap, t.pack_overflow)
        if cut:
            log.warning("%d samples were longer than train.tokens_per_micro=%d and were %s (train.pack_overflow)", cut,
                        cap, "truncated" if t.pack_overflow == "truncate" else "split into pieces")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    multiple = pad_multiple(spec)
    if pairs:  # a step's effective batch counts pairs (finetune/data/pairs.py)
        src: DataSource = PairSource(tok, int(pad), t.effective_batch, t.seed, spec.data.val_fraction,
                                     spec.data.max_val_samples, multiple, t.seq_len)
    elif obj.unpaired:  # KTO: a row a record, and the step's KL rows
        src = UnpairedSource(tok, int(pad), t.effective_batch, t.seed, spec.data.val_fraction,
                             spec.data.max_val_samples, multiple, t.seq_len)
        _check_kto_weights(spec, tok)
    else:
        src = DataSource(tok, int(pad), t.effective_batch * spec.world.world_size, t.seed, spec.data.val_fraction,
                         spec.data.max_val_samples, multiple, t.seq_len)
    lens = tok.lengths if pairs else src.lengths
    stats: dict[str, Any] = {"records": tok.records, "formats": dict(tok.formats), "samples": len(tok.ids),
             "train_samples": len(src.train_idx),
             "val_samples": len(src.val_idx), "truncated": tok.truncated, "dropped_no_target": tok.dropped_no_target,
             "mean_tokens": float(lens.mean()), "max_tokens": int(lens.max()),
             # the widest micro-batch the run can see (train.pad_multiple): what plans price
             "pad_multiple": multiple,
             "max_padded_tokens": padded_length(int(lens.max()), multiple, t.seq_len)}
    if pairs:  # a pair's two samples are rows of one micro-batch: the planner prices 2 rows a pair
        stats.update(pairs=len(src.lengths), train_pairs=len(src.train_idx), val_pairs=len(src.val_idx), rows_per_item=2)
        stats["pair_positions"] = pair_positions(tok)  # the most a pair takes with its prompt run once (mlx; cuda: one row a pair)
    targets = tok.targets()
    if cap:
        # every packed micro-batch of the run's steps, as each rank packs its share of a step
        # (rank_slice: rows rank, rank + W, ...): the widest, the most targets one holds and
        # the most attention pairs per position are what the plan prices (a run that survives
        # them survives every step)
        rows = packed_steps(src, targets, cap, t.steps, spec.world.world_size, t.pack_fill)
        stats.update(tokens_per_micro=cap, pack_overflow=t.pack_overflow, pack_cut=cut, pack_fill=t.pack_fill,
                     max_micro_tokens=rows.widest, max_micro_targets=rows.targets, pair_span=round(rows.pair_span, 4),
                     pad_tokens_per_step=round(rows.pad_tokens / max(1, t.steps), 1))
    # what share of a micro-batch's positions the output head runs on (it runs on targets only):
    # at most the largest target share of any sample's tokens (packed), or the most targets a
    # sample has over the planned width (unpacked: a row holds one sample). Every sample has a
    # target by now (checked above).
    targets = tok.targets()
    head = float((targets / np.maximum(lens, 1)).max()) if cap else int(targets.max()) / stats["max_padded_tokens"]
    stats["head_fraction"] = min(1.0, head)
    return src, stats


def _check_kto_weights(spec: RunSpec, tok: Tokenized) -> None:
    """Warn, as TRL's KTOTrainer does (``_prepare_dataset``), when the class weights leave
    lambda_D * desirable / (lambda_U * undesirable) outside [1, 4/3] (the KTO paper's eq. 8),
    naming a weight that would bring it inside."""
    m = tok.masks  # each record's label in its first mask entry (tokens.py ``_unpaired_chunk``)
    first = (np.asarray(m.flat)[m.offsets[:-1]] if isinstance(m, Ragged) else
             np.array([np.asarray(x)[0] for x in m]))
    nd = max(int((first == 1).sum()), 1)
    nu = max(int((first != 1).sum()), 1)
    o = spec.objective
    ratio = o.desirable_weight * nd / (o.undesirable_weight * nu)
    if not 1.0 <= ratio <= 4 / 3:
        lo, hi = o.undesirable_weight * nu / nd, o.undesirable_weight * nu / nd * 4 / 3
        log.warning("objective=kto: %d desirable and %d undesirable records weigh %.2f to 1 at these weights; the KTO "
                    "paper (eq. 8) keeps it in [1, 4/3]: set objective.desirable_weight in [%.2f, %.2f]", nd, nu,
                    ratio, lo, hi)


def describe(spec: RunSpec, stats: dict[str, Any]) -> str:
    """One line naming the data a run trains on: the source, its samples (train and
    validation) and the formats its records were read as (``build``'s stats)."""
    d = spec.data
    if d.name == "jsonl":
        source = f"data=jsonl {Path(str(d.path)).expanduser()}"
    elif d.name == "hf":
        source = f"data=hf {d.hf_name}" + (f" ({d.hf_config})" if d.hf_config else "") + f" split {d.hf_split}"
    else:
        source = (f"data=synthetic, the built-in arithmetic samples (data.num_samples={d.num_samples}; "
                  "your own: data.path=FILE.jsonl)")
    formats = stats.get("formats") or {}
    shown = ", ".join(f"{name} ({n:,})" if len(formats) > 1 else name for name, n in formats.items()) or "unknown"
    unscored = [words for f, words in (("prompt/completion", "prompts"), ("question/answer", "questions"),
                                       ("chat messages", "non-assistant turns")) if f in formats]
    return (f"data: {source}: {stats['samples']:,} samples ({stats['train_samples']:,} train, "
            f"{stats['val_samples']:,} validation) from {stats['records']:,} records; format {shown}"
            + (f"; {' and '.join(unscored)} carry no loss (data.mask_prompt=true)" if d.mask_prompt and unscored
               else ""))
