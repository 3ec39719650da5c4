"""``mode=plan`` reads the data (issue 23): the lengths of the samples the run will train on.

A plan at ``train.seq_len`` prices the longest sample the configuration allows; the run's
governor re-plans at the data's own longest micro-batch before it loads the model. The plan a
user reads first says the same: ``mode=plan`` tokenizes the data as the run does (through the
token cache, reused or built: ``finetune.data.build``), plans the widest micro-batch the run
will really see (packed: the widest packed micro-batch of its steps; unpacked: the longest
sample, padded as the run pads), and keeps the ``train.seq_len`` plan as the upper bound.

The tokenizer comes from where the run would load it without downloading anything: the tiny
model (built here), a local ``model.path``, or a hub id's snapshot already in the hub cache.
Where none is there (a preset whose weights were never downloaded), the plan stays at
``train.seq_len`` and says why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from finetune import data as data_mod
from finetune.backends.base import padded_length
from finetune.model.source import TOKENIZER_FILES, local_model_dir
from finetune.spec import RunSpec


@dataclass(frozen=True)
class DataLengths:
    """Tokens per training sample (after truncation and packing's cut), and what the plan prices."""

    source: str  # the data as the run names it (synthetic, the file's name, the hub data set)
    samples: int  # training samples (the validation split left out)
    min: int
    median: int
    p90: int
    p99: int
    max: int
    mean: float
    planned_tokens: int  # the widest micro-batch the run sees: what the run's governor plans
    head_fraction: float  # the most of a micro-batch's positions that are targets (the head runs there)
    packed: bool
    # packed: the most (query, key) pairs per position of a packed micro-batch (attention runs one
    # sample at a time, so a row's scores are its samples' squares); None unpacked
    pair_span: float | None = None
    # the padded widths of the first optimizer steps (unpacked; the allocator replay's shapes)
    step_widths: tuple[int, ...] = ()
    # packed: the most target positions one packed micro-batch of the run's steps holds (the
    # output head's rows); None unpacked
    row_targets: int | None = None
    # a preference objective: the data's pairs, train and validation (a precomputed reference
    # holds two log-probs of each); None otherwise (then ``samples`` counts pairs too)
    pairs: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if k == "step_widths" else v) for k, v in asdict(self).items()
                if k not in ("pair_span", "row_targets", "pairs") or v is not None}


def data_lengths(spec: RunSpec) -> tuple[DataLengths | None, str]:
    """The data's lengths as the run will see them, or (None, why they were not read).

    Raises:
        UserError: the data itself cannot be read (the run would stop the same way).
    """
    model_dir = local_model_dir(spec.model, seed=0)  # the run's own (finetune.run.loop: resolve_model_dir(seed=0))
    if not isinstance(model_dir, Path):
        return None, model_dir
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None, f"{model_dir} holds no tokenizer files (the run downloads them)"
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=spec.model.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, f"the tokenizer in {model_dir} cannot be loaded ({first[:160]})"
    src, stats = data_mod.build(spec, tokenizer)
    lens = np.asarray(src.lengths)[src.train_idx]
    pct = np.percentile(lens, [50, 90, 99]) if len(lens) else np.zeros(3)
    d = spec.data
    source = {"synthetic": "synthetic", "jsonl": Path(str(d.path)).name, "hf": f"{d.hf_name}:{d.hf_split}"}[d.name]
    planned = int(stats.get("max_micro_tokens") or stats["max_padded_tokens"])
    widths = () if spec.train.packing else tuple(
        padded_length(int(src.step_lengths(i).max()), stats["pad_multiple"], spec.train.seq_len)
        for i in range(min(2, spec.train.steps)))
    return DataLengths(source=source, samples=int(len(lens)), min=int(lens.min()), median=int(pct[0]),
                       p90=int(pct[1]), p99=int(pct[2]), max=int(lens.max()), mean=round(float(lens.mean()), 1),
                       planned_tokens=planned, head_fraction=round(float(stats["head_fraction"]), 4),
                       packed=bool(spec.train.packing),
                       pair_span=stats.get("pair_span") if spec.train.packing else None, step_widths=widths,
                       row_targets=stats.get("max_micro_targets") if spec.train.packing else None,
                       pairs=stats.get("pairs")), ""
