"""Data pipeline: records -> token ids with a loss mask -> length-grouped, deterministic batches.

Formats a record may take (jsonl or a hub data set):
  {"text": ...}                                   every token counts in the loss
  {"prompt": ..., "completion": ...}              only completion tokens count (data.mask_prompt)
  {"question": ..., "answer": ...}                as prompt/completion (GSM8K's shape)
  {"messages": [{"role": ..., "content": ...}]}   rendered with the tokenizer's chat template;
                                                  only assistant turns count

The order of samples is a pure function of (seed, effective batch size, step), never of the
micro-batch, so the governor can split an optimizer step differently without changing which
samples it trains on or in what order.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from finetune.backends.base import Batch, padded_length
from finetune.config import UserError

log = logging.getLogger("finetune")

GROUP_STEPS = 16  # effective batches sorted together by length: less padding, still shuffled


@dataclass
class Tokenized:
    ids: list[np.ndarray]  # int32 token ids per sample
    masks: list[np.ndarray]  # int8, 1 where the token counts as a target
    truncated: int
    dropped_no_target: int
    longest: int


def load_records(data_cfg: Any, seed: int) -> list[dict[str, Any]]:
    """Read the configured source into a list of dict records."""
    if data_cfg.name == "synthetic":
        from finetune.synthetic import generate

        return generate(data_cfg.num_samples, seed=seed)
    if data_cfg.name == "jsonl":
        path = Path(data_cfg.path).expanduser()
        if path.is_dir():
            raise UserError(f"data.path={data_cfg.path} is a directory; point it at a .jsonl file inside it")
        if not path.is_file():
            raise UserError(f"data.path={data_cfg.path} does not exist; point it at a .jsonl file")
        records = []
        n = 0
        try:
            with path.open("rb") as f:  # decoded a line at a time: an error names its line
                for n, raw in enumerate(f, 1):
                    line = raw.decode("utf-8")
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UserError(f"{path}:{n} is not valid JSON ({e.msg}); fix or remove that line") from None
                    check_record(rec, f"{path}:{n}")
                    records.append(rec)
                    if data_cfg.max_samples and len(records) >= data_cfg.max_samples:
                        break
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{n} is not UTF-8 text (byte {e.object[e.start]:#04x}); re-encode the file "
                            "as UTF-8 (iconv -t UTF-8)") from None
        except OSError as e:
            raise UserError(f"data.path={data_cfg.path} cannot be read ({e.strerror or e}); check its permissions "
                            "or copy it somewhere readable") from None
        if not records:
            raise UserError(f"{path} holds no records; it needs one JSON object a line")
        return records
    if data_cfg.name == "hf":
        try:
            import datasets
        except ImportError:
            raise UserError("data=hf needs the datasets package: pip install 'finetune[hf]'") from None
        ds = datasets.load_dataset(data_cfg.hf_name, data_cfg.hf_config, split=data_cfg.hf_split)
        if data_cfg.max_samples:
            ds = ds.select(range(min(data_cfg.max_samples, len(ds))))
        records = [dict(r) for r in ds]
        for i, rec in enumerate(records):
            check_record(rec, f"{data_cfg.hf_name} row {i}")
        return records
    raise UserError(f"data={data_cfg.name} is not valid; choose one of: synthetic, jsonl, hf")


_TEXT_FIELDS = ("text", "prompt", "completion", "question", "answer")


def check_record(rec: Any, where: str) -> None:
    """UserError, naming the line and the fix, for a record of the wrong shape: not an object,
    a text field that is not a string, chat turns that are not {role, content} objects."""
    if not isinstance(rec, dict):
        raise UserError(f"{where} is a JSON {type(rec).__name__}, not an object; each line needs one object such as "
                        '{"prompt": "...", "completion": "..."}')
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} turns")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m.get("role"):
                raise UserError(f"{where}: chat turn {i} has no 'role'; give every turn a role (system, user, "
                                "assistant) and a content string")
            if not isinstance(m.get("content"), str):
                raise UserError(f"{where}: chat turn {i} ({m['role']}) has no string 'content'; give every turn "
                                "its text as a string")
        return
    for key in _TEXT_FIELDS:
        if key in rec and not isinstance(rec[key], str):
            if key == "answer" and isinstance(rec[key], (int, float)) and not isinstance(rec[key], bool):
                continue  # a numeric answer reads as its text
            raise UserError(f"{where}: '{key}' is a {type(rec[key]).__name__}, not a string; store it as text")


def _render(record: dict[str, Any], tokenizer: Any, mask_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
    """Return (text, character spans that count in the loss)."""
    if "messages" in record:
        msgs = record["messages"]
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError("data has chat 'messages' but the model's tokenizer has no chat template; "
                            "use {'prompt','completion'} records or a chat model")
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        if not mask_prompt:
            return text, [(0, len(text))]
        spans = []
        for i, m in enumerate(msgs):
            if m.get("role") == "assistant":
                start = len(tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)) if i else 0
                end = len(tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False))
                spans.append((start, end))
        return text, spans
    if "prompt" in record and "completion" in record:
        p, c = str(record["prompt"]), str(record["completion"])
    elif "question" in record and "answer" in record:
        p, c = f"Question: {record['question']}\nAnswer: ", str(record["answer"])
    elif "text" in record:
        t = str(record["text"])
        return t, [(0, len(t))]
    else:
        raise UserError(f"record with keys {sorted(record)} has no known format; use text, prompt+completion, "
                        "question+answer or messages")
    text = p + c
    return text, [(len(p) if mask_prompt else 0, len(text))]


TOKENIZE_CHUNK = 64  # records per tokenizer call (measured: 256 left +57 MiB of RSS, 64 +27 MiB, same speed)


def _encode_chunks(records: list[dict[str, Any]], tokenizer: Any, mask_prompt: bool) -> Any:
    """Yield ((text, loss spans), token ids, token start offsets) per record, tokenizing
    ``TOKENIZE_CHUNK`` records a call. One call over every record would hold all their
    offset tuples (Python objects, ~100 B a token) at once; the heap that leaves behind stays
    in the process's RSS for the whole run."""
    for c in range(0, len(records), TOKENIZE_CHUNK):
        rendered = [_render(r, tokenizer, mask_prompt) for r in records[c : c + TOKENIZE_CHUNK]]
        enc = tokenizer([t for t, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
        for r, ids, offs in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
            yield r, ids, np.fromiter((o[0] for o in offs), dtype=np.int64, count=len(offs))


def tokenize(records: list[dict[str, Any]], tokenizer: Any, seq_len: int, mask_prompt: bool) -> Tokenized:
    """Tokenize records (EOS appended, counted in the loss), truncate to ``seq_len``."""
    eos = tokenizer.eos_token_id
    ids_out, masks_out, truncated, dropped, longest = [], [], 0, 0, 0
    for (_, spans), ids, starts in _encode_chunks(records, tokenizer, mask_prompt):
        mask = np.zeros(len(ids), np.int8)
        for a, b in spans:
            mask |= ((starts >= a) & (starts < b)).astype(np.int8)
        ids = list(ids)
        if eos is not None:
            ids.append(eos)
            mask = np.append(mask, np.int8(1 if spans else 0))
        longest = max(longest, len(ids))
        if len(ids) > seq_len:
            truncated += 1
            ids, mask = ids[:seq_len], mask[:seq_len]
        if mask[1:].sum() == 0:  # nothing to learn from (e.g. the prompt alone fills seq_len)
            dropped += 1
            continue
        ids_out.append(np.asarray(ids, np.int32))
        masks_out.append(mask)
    return Tokenized(ids_out, masks_out, truncated, dropped, longest)


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
        self.pad = {"pad_multiple": pad_multiple, "max_len": max_len}
        self.steps_per_epoch = len(self.train_idx) // effective_batch
        self._epoch_cache: dict[int, list[np.ndarray]] = {}

    def _epoch(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._epoch_cache:
            rng = np.random.default_rng([self.seed, epoch])
            order = self.train_idx[rng.permutation(len(self.train_idx))]
            order = order[: self.steps_per_epoch * self.E]  # drop the ragged tail of an epoch
            lens = np.array([len(self.tok.ids[i]) for i in order])
            batches = []
            chunk = self.E * GROUP_STEPS
            for c in range(0, len(order), chunk):
                o, ln = order[c : c + chunk], lens[c : c + chunk]
                o = o[np.argsort(-ln, kind="stable")]  # longest first within the chunk
                group = [o[i : i + self.E] for i in range(0, len(o), self.E)]
                batches += [group[j] for j in rng.permutation(len(group))]
            self._epoch_cache = {epoch: batches}  # keep one epoch: memory stays flat
        return self._epoch_cache[epoch]

    def train_batch(self, step_index: int) -> Batch:
        """Effective batch for 0-based optimizer step ``step_index`` (the same for any micro-batch)."""
        idx = self._epoch(step_index // self.steps_per_epoch)[step_index % self.steps_per_epoch]
        return collate([self.tok.ids[i] for i in idx], [self.tok.masks[i] for i in idx], idx, self.pad_id, **self.pad)

    def val_batches(self, batch_size: int, max_batches: int) -> list[Batch]:
        idx = sorted(self.val_idx, key=lambda i: -len(self.tok.ids[i]))
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


def pad_multiple(cfg: Any) -> int:
    """``train.pad_multiple``, with 0 (auto) resolved: 32 on an Apple GPU, where MLX reuses a
    freed Metal buffer only for a request within two pages of its size (so repeated shapes
    matter) and mlx-lm pads the same way; 1 elsewhere (measured on CPU: padding cost speed
    and saved nothing once the cache is bounded)."""
    m = int(cfg.train.pad_multiple)
    if m:
        return m
    from finetune.budget import apple_silicon

    return 32 if apple_silicon() and cfg.backend.name in ("mlx", "auto") else 1


def build(cfg: Any, tokenizer: Any, world_size: int = 1) -> tuple[DataSource, dict[str, Any]]:
    """Load, tokenize and split the configured data. Returns the source and its stats.

    ``world_size`` ranks share each optimizer step: the source's batches hold the effective
    batch of all of them (train.batch_size * train.grad_accum per rank), and each rank trains
    its own slice (``rank_slice``)."""
    records = load_records(cfg.data, cfg.train.seed)
    tok = tokenize(records, tokenizer, cfg.train.seq_len, cfg.data.mask_prompt)
    if not tok.ids and tok.dropped_no_target:
        raise UserError(f"no completion tokens left in any of the {tok.dropped_no_target} samples after truncating to "
                        f"train.seq_len={cfg.train.seq_len} (the prompt fills it; longest sample {tok.longest} tokens); "
                        f"raise train.seq_len (e.g. train.seq_len={tok.longest}) or shorten the prompts")
    if not tok.ids:
        raise UserError("no sample has any target token after tokenizing; check the data format or train.seq_len")
    if tok.truncated:
        log.warning("%d of %d samples were longer than train.seq_len=%d and were truncated (longest %d tokens); "
                    "raise train.seq_len to keep them whole", tok.truncated, len(records), cfg.train.seq_len, tok.longest)
    if tok.dropped_no_target:
        log.warning("%d samples had no target token within train.seq_len and were dropped", tok.dropped_no_target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    multiple = pad_multiple(cfg)
    src = DataSource(tok, int(pad), cfg.train.batch_size * cfg.train.grad_accum * int(world_size), cfg.train.seed,
                     cfg.data.val_fraction, cfg.data.max_val_samples, multiple, int(cfg.train.seq_len))
    lens = np.array([len(x) for x in tok.ids])
    stats = {"records": len(records), "samples": len(tok.ids), "train_samples": len(src.train_idx),
             "val_samples": len(src.val_idx), "truncated": tok.truncated, "dropped_no_target": tok.dropped_no_target,
             "mean_tokens": float(lens.mean()), "max_tokens": int(lens.max()),
             # the widest micro-batch the run can see (train.pad_multiple): what plans price
             "pad_multiple": multiple,
             "max_padded_tokens": padded_length(int(lens.max()), multiple, int(cfg.train.seq_len))}
    return src, stats
