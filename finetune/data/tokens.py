"""Records -> token ids with a loss mask (``Tokenized``), in memory (``tokenize``) or through
the token cache (``prepare``: finetune/data/cache.py, flat memory-mapped arrays keyed by the data,
the tokenizer and every setting that changes tokens, which the next run and every sweep job
reuse).

Records stream from the source ``TOKENIZE_CHUNK`` at a time, so a file of any length tokenizes
in the memory of one chunk. One record's text is cut at ``record_char_cap`` characters before
tokenizing, so a giant record costs what its truncation to ``train.seq_len`` keeps.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain, islice
from typing import Any

import numpy as np

from finetune import synthetic
from finetune.data import cache as tokcache
from finetune.data.formats import (_BOM, CHAT_TURNS, PAIR_FORMAT, READERS, UNPAIRED_FORMAT, _hf_dataset, _hf_records, _jsonl_path,
                                   _jsonl_records, _unreadable, check_pair, check_record, check_unpaired, compression,
                                   is_pipe, iter_records, record_format)
from finetune.errors import UserError
from finetune.prompting import QA_PROMPT
from finetune.spec import DataSpec, RunSpec
from finetune.model.tiny import cache_root
from finetune.data.cache import Damaged, Ragged, TokenWriter

log = logging.getLogger("finetune")


@dataclass
class Tokenized:
    """A data set's samples as token ids and loss masks, and what tokenizing counted."""

    ids: Sequence[np.ndarray]  # token ids per sample: a list of arrays, or a Ragged view of one flat array
    masks: Sequence[np.ndarray]  # int8, 1 where the token counts as a target
    truncated: int
    dropped_no_target: int
    longest: int
    records: int = 0  # records read (kept, truncated and dropped ones alike)
    formats: dict[str, int] = field(default_factory=dict)  # records read per format (record_format)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample (int64), without touching the samples when they are one flat array."""
        if isinstance(self.ids, Ragged):
            return self.ids.lengths
        return np.fromiter((len(x) for x in self.ids), np.int64, len(self.ids))

    def targets(self) -> np.ndarray:
        """Label tokens per sample (int64): its mask past the first token, which no sample
        predicts (a packed row masks it too)."""
        if isinstance(self.masks, Ragged) and len(self.masks):
            flat, off = self.masks.flat, self.masks.offsets
            sums = np.add.reduceat(flat.astype(np.int64), off[:-1]) if len(flat) else np.zeros(len(off) - 1, np.int64)
            return sums - flat[off[:-1]].astype(np.int64)
        return np.fromiter((int(np.asarray(m)[1:].sum()) for m in self.masks), np.int64, len(self.masks))


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
        p, c = QA_PROMPT.format(record["question"]), str(record["answer"])
    elif "text" in record:
        t = str(record["text"])
        return t, [(0, len(t))]
    else:
        raise UserError(f"record with keys {sorted(record)} has no known format; use text, prompt+completion, "
                        "question+answer or messages")
    text = p + c
    return text, [(len(p) if mask_prompt else 0, len(text))]


TOKENIZE_CHUNK = 64  # records per tokenizer call (measured: 256 left +57 MiB of RSS, 64 +27 MiB, same speed)


def _encode(texts: list[str], tokenizer: Any) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Token ids and (start, end) character offsets per text, no special tokens added.

    A fast tokenizer with no truncation or padding set is asked directly (what its
    ``__call__`` does after setting those off, without building a BatchEncoding: ~15% faster
    here); any other goes through ``__call__``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is not None and hasattr(backend, "encode_batch") and backend.truncation is None
            and backend.padding is None
            and getattr(backend, "encode_special_tokens", False) == bool(getattr(tokenizer, "split_special_tokens", False))):
        encs = backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encs], [e.offsets for e in encs]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]


@dataclass
class _Chunk:
    ids: np.ndarray  # int64, kept samples end to end
    mask: np.ndarray  # int8, aligned with ids
    lengths: np.ndarray  # int64 tokens per kept sample
    truncated: int
    dropped: int
    longest: int
    kept: np.ndarray  # bool per record: it has a target token within seq_len (else dropped)


# How far past the characters that ``seq_len`` tokens can cover a record's text is kept (see
# ``record_char_cap``): 2x, for normalizers that fold several characters into one (NFC joins a
# letter and its accent) and for the word the cut falls in, whose tokens may change.
CHAR_CAP_MARGIN = 2


def record_char_cap(tokenizer: Any, seq_len: int) -> int:
    """Characters of one record's text worth tokenizing: ``CHAR_CAP_MARGIN * (seq_len + 1) *``
    the longest vocabulary entry. No token covers more characters than its vocabulary string
    holds (a byte-level entry has one character a byte, and a byte is at most one character),
    so the first ``seq_len + 1`` tokens of any text lie within ``(seq_len + 1) * longest``
    characters, whatever the text (a run of spaces, minified code), and cutting the text
    twice as far on leaves them as they were. A 45 MB record then costs what it keeps: with a
    longest entry of 128 characters and seq_len 2048, about 0.5 M characters."""
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return CHAR_CAP_MARGIN * (seq_len + 1) * max(longest, 1)


def _chunk_samples(records: list[dict[str, Any]], tokenizer: Any, seq_len: int, mask_prompt: bool,
                   char_cap: int | None = None) -> _Chunk:
    """One tokenizer call over ``records``; then, over the chunk's tokens as flat arrays: the
    loss mask from each record's character spans, EOS appended (a target when the record has
    any), truncation to ``seq_len``, and samples with no target after their first token dropped.
    A text longer than ``char_cap`` characters is cut there first (``record_char_cap``)."""
    rendered = [_render(r, tokenizer, mask_prompt) for r in records]
    if char_cap is not None:
        rendered = [(t[:char_cap], s) if len(t) > char_cap else (t, s) for t, s in rendered]
    ids_lists, offs_lists = _encode([t for t, _ in rendered], tokenizer)
    n = np.fromiter(map(len, ids_lists), np.int64, len(ids_lists))
    total = int(n.sum())
    ids = np.fromiter(chain.from_iterable(ids_lists), np.int64, total)
    # (start, end) pairs flattened at C speed, then every other one: each token's first character
    starts = np.fromiter(chain.from_iterable(chain.from_iterable(offs_lists)), np.int64, 2 * total)[::2]
    rec = np.repeat(np.arange(len(records)), n)  # the record each token belongs to
    mask = np.zeros(total, np.bool_)
    for j in range(max((len(s) for _, s in rendered), default=0)):  # j-th span of every record at once
        a = np.array([s[j][0] if len(s) > j else 0 for _, s in rendered], np.int64)
        b = np.array([s[j][1] if len(s) > j else 0 for _, s in rendered], np.int64)  # [0, 0): no span
        mask |= (starts >= a[rec]) & (starts < b[rec])
    eos = tokenizer.eos_token_id
    if eos is not None:
        ends = np.cumsum(n)
        ids = np.insert(ids, ends, eos)
        mask = np.insert(mask, ends, np.array([bool(s) for _, s in rendered]))
        n = n + 1
    keep_len = np.minimum(n, seq_len)
    first = np.cumsum(n) - n  # each sample's first token in the flat arrays
    pos = np.arange(len(ids)) - np.repeat(first, n)
    cut = pos < seq_len
    ids, mask = ids[cut], mask[cut]
    # targets after each sample's first token (nothing to learn from when the prompt fills seq_len)
    csum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    start = np.cumsum(keep_len) - keep_len
    targets = csum[start + keep_len] - csum[np.minimum(start + 1, start + keep_len)]
    kept = targets > 0
    tok_kept = np.repeat(kept, keep_len)
    return _Chunk(ids[tok_kept], mask[tok_kept].astype(np.int8), keep_len[kept], int((n > seq_len).sum()),
                  int((~kept).sum()), int(n.max(initial=0)), kept)


def _render_prompted(p: Any, completions: list[Any], tokenizer: Any, fix: str) -> tuple[str, list[str]]:
    """(prompt, [completion, ...]) text of a record whose completions answer one prompt. Chat
    turns go through the tokenizer's chat template as TRL's DPOTrainer and KTOTrainer render them
    (trl/data_utils.py ``apply_chat_template``): the prompt with the generation prompt added, each
    completion as what the whole conversation adds after it, so only the completion's tokens are
    targets. ``fix``: what to do without a chat template."""
    if isinstance(p, str) and all(isinstance(c, str) for c in completions):
        return p, list(completions)
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"the records hold chat turns but the model's tokenizer has no chat template; {fix}")
    turns = (lambda v: [{"role": "user", "content": v}] if isinstance(v, str) else list(v))
    prompt = tokenizer.apply_chat_template(turns(p), tokenize=False, add_generation_prompt=True)

    def completion(v: Any) -> str:
        msgs = [{"role": "assistant", "content": v}] if isinstance(v, str) else list(v)
        whole = tokenizer.apply_chat_template(turns(p) + msgs, tokenize=False)
        return whole[len(prompt):] if whole.startswith(prompt) else whole

    return prompt, [completion(c) for c in completions]


def _render_pair(record: dict[str, Any], tokenizer: Any) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) text of a preference record (``_render_prompted``)."""
    p, (c, r) = _render_prompted(record["prompt"], [record["chosen"], record["rejected"]], tokenizer,
                                 "give prompt, chosen and rejected as strings, or use a chat model")
    return p, c, r


def _pair_chunk(records: list[dict[str, Any]], tokenizer: Any, seq_len: int, char_cap: int | None) -> _Chunk:
    """``_chunk_samples`` over the pairs of ``records``: each pair's chosen then rejected
    sample, side by side (samples 2i and 2i + 1), only completion tokens targets; a pair one of
    whose samples keeps no target within ``seq_len`` is dropped whole (counted once)."""
    rows: list[dict[str, Any]] = []
    for rec in records:
        p, c, r = _render_pair(rec, tokenizer)
        rows += [{"prompt": p, "completion": c}, {"prompt": p, "completion": r}]
    ch = _chunk_samples(rows, tokenizer, seq_len, True, char_cap)
    full = np.zeros(len(rows), np.int64)
    full[ch.kept] = ch.lengths
    ok = ch.kept[0::2] & ch.kept[1::2]
    # a pair that seq_len cut to the same tokens (they differed only past it) has no preference left
    at = np.cumsum(ch.kept) - 1  # each kept row's place among the kept
    ends = np.cumsum(ch.lengths)
    for i in np.flatnonzero(ok):
        c, r = at[2 * i], at[2 * i + 1]
        if ch.lengths[c] == ch.lengths[r] and np.array_equal(ch.ids[ends[c] - ch.lengths[c]:ends[c]],
                                                               ch.ids[ends[r] - ch.lengths[r]:ends[r]]):
            ok[i] = False
    keep_rows = np.repeat(ok, 2)
    tok_keep = np.repeat(keep_rows[ch.kept], ch.lengths)
    return _Chunk(ch.ids[tok_keep], ch.mask[tok_keep], full[keep_rows], ch.truncated, int((~ok).sum()), ch.longest,
                  keep_rows)


def _unpaired_chunk(records: list[dict[str, Any]], tokenizer: Any, seq_len: int, char_cap: int | None) -> _Chunk:
    """``_chunk_samples`` over KTO's labelled records: only completion tokens targets, and the
    record's label in the mask of its first token, which is always a prompt token (a KTO
    record's prompt is never empty: formats.py ``check_unpaired``) and never a target (nothing
    predicts it: ``Tokenized.targets`` and the backends skip it). 1: desirable, 0: undesirable
    (``finetune.data.pairs.unpaired_labels`` reads it back). The token cache keeps it as it
    keeps any mask, under its own key (``prepare``: settings ``unpaired``)."""
    rows = []
    for rec in records:
        p, (c,) = _render_prompted(rec["prompt"], [rec["completion"]], tokenizer,
                                   "give prompt and completion as strings, or use a chat model")
        rows.append({"prompt": p, "completion": c})
    ch = _chunk_samples(rows, tokenizer, seq_len, True, char_cap)
    labels = np.array([bool(r["label"]) for r in records], np.int8)[ch.kept]
    mask = ch.mask.copy()
    mask[np.cumsum(ch.lengths) - ch.lengths] = labels
    return replace(ch, mask=mask)


def _check_objective(fmt: str, pairs: bool, unpaired: bool = False) -> None:
    """One line naming the fix for records the objective cannot train on."""
    if fmt == PAIR_FORMAT and not pairs:
        raise UserError('the data holds preference pairs ({"prompt", "chosen", "rejected"}); train them with '
                        "objective=dpo (or orpo, simpo), or give objective=sft prompt/completion records"
                        if not unpaired else
                        'objective=kto needs labelled records {"prompt", "completion", "label"}, and the data holds '
                        "preference pairs; train them with objective=dpo (or orpo, simpo), or write each pair as two "
                        "records (chosen: label true, rejected: label false)")
    if fmt == UNPAIRED_FORMAT and not unpaired:
        raise UserError('the data holds labelled records ({"prompt", "completion", "label"}, KTO\'s); train them '
                        "with objective=kto" + (", or give pairs {\"prompt\", \"chosen\", \"rejected\"}" if pairs
                                                  else ""))
    if pairs and fmt != PAIR_FORMAT:
        raise UserError(f'a preference objective needs pairs {{"prompt", "chosen", "rejected"}}, and the data holds '
                        f"{fmt} records; train those with objective=sft")
    if unpaired and fmt not in (UNPAIRED_FORMAT, PAIR_FORMAT):
        raise UserError(f'objective=kto needs labelled records {{"prompt", "completion", "label"}}, and the data '
                        f"holds {fmt} records; train those with objective=sft")


def _tokenize_into(records: Iterable[dict[str, Any]], tokenizer: Any, seq_len: int, mask_prompt: bool,
                   writer: TokenWriter, progress: Callable[[int], None] | None = None,
                   pairs: bool = False, unpaired: bool = False) -> dict[str, int]:
    """Stream records through ``_chunk_samples`` ``TOKENIZE_CHUNK`` at a time into ``writer``:
    memory holds one chunk's Python objects (one call over every record would hold all their
    offset tuples, ~100 B a token, and the heap that leaves behind stays in the process's RSS).
    Returns the counts: records, truncated, dropped_no_target, longest, and records per format."""
    formats: dict[str, int] = {}
    stats: dict[str, Any] = {"records": 0, "truncated": 0, "dropped_no_target": 0, "longest": 0, "formats": formats}
    it, cap = iter(records), record_char_cap(tokenizer, seq_len)
    while chunk := list(islice(it, TOKENIZE_CHUNK)):
        for r in chunk:
            f = record_format(r)
            _check_objective(f, pairs, unpaired)
            if f in (PAIR_FORMAT, UNPAIRED_FORMAT) and not all(
                    isinstance(r.get(k), str) for k in ("prompt", "chosen", "rejected", "completion") if k in r):
                f += CHAT_TURNS  # rendered through the chat template (_render_prompted): a chat prompt
            formats[f] = formats.get(f, 0) + 1
        # pairs: samples 2i (chosen) and 2i + 1 (rejected) of each kept pair; unpaired: the label rides
        # in each sample's first mask entry
        c = (_pair_chunk(chunk, tokenizer, seq_len, cap) if pairs else
             _unpaired_chunk(chunk, tokenizer, seq_len, cap) if unpaired else
             _chunk_samples(chunk, tokenizer, seq_len, mask_prompt, cap))
        writer.add(c.ids, c.mask, c.lengths)
        stats["records"] += len(chunk)
        stats["truncated"] += c.truncated
        stats["dropped_no_target"] += c.dropped
        stats["longest"] = max(stats["longest"], c.longest)
        if progress is not None:
            progress(len(chunk))
    return stats


def _tokenized(ids: Ragged, masks: Ragged, stats: dict[str, Any]) -> Tokenized:
    return Tokenized(ids, masks, int(stats["truncated"]), int(stats["dropped_no_target"]), int(stats["longest"]),
                     int(stats["records"]), {str(k): int(v) for k, v in (stats.get("formats") or {}).items()})


def tokenize(records: Iterable[dict[str, Any]], tokenizer: Any, seq_len: int, mask_prompt: bool,
             progress: Callable[[int], None] | None = None, pairs: bool = False,
             unpaired: bool = False) -> Tokenized:
    """Tokenize records (EOS appended, counted in the loss), truncate to ``seq_len``, in memory.

    ``records`` may be any iterable (a list, ``iter_records``); the samples are one flat array
    of ids and one of masks, each sample a view (``Ragged``)."""
    writer = TokenWriter(tokcache.ids_dtype(tokenizer))
    stats = _tokenize_into(records, tokenizer, seq_len, mask_prompt, writer, progress, pairs, unpaired)
    return _tokenized(*writer.finish_in_memory(), stats)


# -- the token cache (finetune/data/cache.py) -------------------------------------------------------

def _code_fingerprint(name: str) -> str:
    """A hash of the code that decides which records are read and what tokens they become: an
    edit to it (a new format, a changed mask rule) is a new cache entry, never a stale one."""
    funcs: list[Any] = [check_record, check_pair, check_unpaired, _render, _render_prompted, _render_pair, _pair_chunk,
                        _unpaired_chunk, _encode, record_char_cap,
                        _chunk_samples, _tokenize_into, *READERS]
    if name == "synthetic":
        funcs.append(synthetic)
    try:
        text = "\n".join(inspect.getsource(f) for f in funcs)
    except (OSError, TypeError):  # no source shipped: the installed package's version stands in
        from importlib.metadata import version

        text = version("finetune")
    return hashlib.sha256(f"{tokcache.CACHE_FORMAT}\n{QA_PROMPT}\n{text}".encode()).hexdigest()


def _source(dspec: DataSpec, seed: int, keyed: bool) -> tuple[str, dict[str, Any] | None, Iterator[dict[str, Any]],
                                                            int | None]:
    """(label, key of what is read or None, the records, how many lines or records to expect).
    Keyed, a JSONL file is read once here to hash its content (and count its lines)."""
    if dspec.name == "jsonl":
        path = _jsonl_path(dspec)
        if not keyed or is_pipe(path):  # a pipe is read once, by the tokenizer: nothing to hash it with first
            return path.name, None, _jsonl_records(dspec), dspec.max_samples or None
        try:
            st = path.stat()
            sha, lines = tokcache.digest_file(path, count_lines=True)
            with path.open("rb") as f:
                head = f.read(4096)
        except OSError as e:
            raise _unreadable(dspec, e) from None
        key: dict[str, Any] | None = {"kind": "jsonl", "path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
               "sha256": sha, "max_samples": dspec.max_samples}
        # newlines count records only in plain JSONL (not compressed bytes, not a pretty-printed array)
        plain = compression(head) is None and not head.removeprefix(_BOM).lstrip().startswith(b"[")
        total = min(lines, dspec.max_samples or lines) if plain else dspec.max_samples or None
        return path.name, key, _jsonl_records(dspec), total
    if dspec.name == "synthetic":
        key = {"kind": "synthetic", "num_samples": int(dspec.num_samples), "seed": int(seed)}
        return "synthetic", key, iter_records(dspec, seed), int(dspec.num_samples)
    if dspec.name == "hf":
        ds = _hf_dataset(dspec)
        key = {"kind": "hf", "name": dspec.hf_name, "config": dspec.hf_config, "split": dspec.hf_split,
               "fingerprint": getattr(ds, "_fingerprint", None), "rows": len(ds), "max_samples": dspec.max_samples}
        if key["fingerprint"] is None:
            key = None  # a data set without a fingerprint cannot be told from an edited one
        return f"{dspec.hf_name}-{dspec.hf_split}", key, _hf_records(dspec, ds), len(ds)
    raise UserError(f"data={dspec.name} is not valid; choose one of: synthetic, jsonl, hf")


def _progress_bar(enabled: bool, total: int | None) -> Any:
    """A tqdm bar on stderr counting lines (records) a second, shown only once tokenizing
    has taken a second (small data sets print nothing)."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="tokenize", unit=" lines", unit_scale=True, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5, delay=1.0)


def prepare(spec: RunSpec, tokenizer: Any) -> Tokenized:
    """The configured data tokenized: reused from the token cache when an entry for this data,
    tokenizer and settings exists; else tokenized chunk by chunk straight into a new entry
    (``data.cache=false``: into memory, nothing written). Says which in one line on stderr."""
    d, seq_len, mask_prompt = spec.data, spec.train.seq_len, spec.data.mask_prompt
    pairs = spec.objective.paired  # samples 2i, 2i + 1: a pair's chosen and rejected
    unpaired = spec.objective.unpaired  # KTO: each sample's label in its first mask entry
    seed, show, t0 = spec.train.seed, spec.train.progress, time.perf_counter()
    label, source_key, records, total = _source(d, seed, keyed=bool(d.cache))
    _remove_stale_temporaries(d.cache_dir)
    if not d.cache or source_key is None:
        why = ("data.cache=false" if not d.cache else "data.path is a pipe, read once" if d.name == "jsonl"
               else "the data set has no fingerprint")
        return _in_memory(records, tokenizer, seq_len, mask_prompt, show, total, t0, f"{why}: nothing cached", pairs,
                          unpaired)
    key = {"source": source_key, "tokenizer": tokcache.tokenizer_fingerprint(tokenizer),
           "settings": {"seq_len": seq_len, "mask_prompt": mask_prompt, **({"pairs": True} if pairs else {}),
                        **({"unpaired": True} if unpaired else {})},
           "code": _code_fingerprint(d.name)}
    path = tokcache.entry_path(tokcache.cache_dir(d.cache_dir), label, key)
    built = False
    for _ in range(2):  # look; on a miss build; look again (at ours, or at the one a faster job published)
        try:
            hit = tokcache.load(path, key)
        except Damaged as e:
            log.warning("token cache at %s is damaged (%s); rebuilding it", path, e)
            tokcache.set_aside(path)
            hit = None
        if hit is not None:
            ids, masks, manifest = hit
            took = time.perf_counter() - t0
            print(f"tokenized {len(ids)} samples in {took:.1f} s (cached to {path})" if built else
                  f"reused the token cache at {path} ({len(ids)} samples, {took:.2f} s)", file=sys.stderr)
            return _tokenized(ids, masks, manifest["stats"])
        if built:
            break
        try:
            writer = TokenWriter(tokcache.ids_dtype(tokenizer), path)
        except OSError as e:
            log.warning("token cache dir %s cannot be written (%s); tokenizing without it", path.parent,
                        e.strerror or e)
            break
        bar = _progress_bar(show, total)
        try:
            stats = _tokenize_into(records, tokenizer, seq_len, mask_prompt, writer, None if bar is None else bar.update,
                                   pairs, unpaired)
            path = writer.publish(stats, key)
        except OSError as e:  # disk full, the dir removed under us: the run goes on without a cache
            writer.abort()
            log.warning("token cache at %s could not be written (%s); tokenizing without it", path, e.strerror or e)
            break
        except BaseException:
            writer.abort()
            raise
        finally:
            if bar is not None:
                bar.close()
        built = True
    # No usable entry (an unwritable dir, a failed write, an entry damaged as soon as written):
    # tokenize into memory, from the start of the data again.
    _, _, records, _ = _source(d, seed, keyed=False)
    return _in_memory(records, tokenizer, seq_len, mask_prompt, show, total, t0, "not cached", pairs, unpaired)


def _remove_stale_temporaries(cache_dir: str | None) -> None:
    """Temporaries that killed writers left (a token cache entry being built, a tiny model
    being assembled) go when the next run starts: those of a dead process, or untouched for
    an hour when no process is named (tokcache.remove_stale_temporaries)."""
    for root in {tokcache.cache_dir(cache_dir), cache_root()}:
        for p in tokcache.remove_stale_temporaries(root):
            log.info("removed %s, left by a writer that is gone", p)


def _in_memory(records: Iterator[dict[str, Any]], tokenizer: Any, seq_len: int, mask_prompt: bool, show: bool,
               total: int | None, t0: float, why: str, pairs: bool = False, unpaired: bool = False) -> Tokenized:
    bar = _progress_bar(show, total)
    try:
        tok = tokenize(records, tokenizer, seq_len, mask_prompt, None if bar is None else bar.update, pairs, unpaired)
    finally:
        if bar is not None:
            bar.close()
    print(f"tokenized {len(tok.ids)} samples in {time.perf_counter() - t0:.1f} s ({why})", file=sys.stderr)
    return tok
