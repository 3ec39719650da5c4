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
(finetune/tokcache.py: flat memory-mapped arrays, keyed by the data, the tokenizer and every
setting that changes tokens), which the next run and every sweep job reuse (``prepare``).
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import logging
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from finetune import tokcache
from finetune.backends.base import Batch, pack_layout, padded_length
from finetune.errors import UserError
from finetune.prompting import QA_PROMPT
from finetune.tokcache import Damaged, Ragged, TokenWriter
from finetune import synthetic
from finetune.backends import capabilities, run_device
from finetune.synthetic import generate
from finetune.spec import DataSpec, RunSpec
from finetune.tiny import cache_root

log = logging.getLogger("finetune")

GROUP_STEPS = 16  # effective batches sorted together by length: less padding, still shuffled


@dataclass
class Tokenized:
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


def _jsonl_path(dspec: DataSpec) -> Path:
    path = Path(str(dspec.path)).expanduser()
    if path.is_dir():
        raise UserError(f"data.path={dspec.path} is a directory; point it at a .jsonl file inside it")
    if not path.is_file() and not is_pipe(path):
        raise UserError(f"data.path={dspec.path} does not exist; point it at a .jsonl file")
    return path


def is_pipe(path: Path) -> bool:
    """A FIFO or a process substitution (``data.path=<(zcat x.gz)`` is /dev/fd/N, a pipe):
    its bytes can be read once, and it has no size or mtime to key a cache on."""
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _unreadable(dspec: DataSpec, e: OSError) -> UserError:
    return UserError(f"data.path={dspec.path} cannot be read ({e.strerror or e}); check its permissions "
                     "or copy it somewhere readable")


# Formats recognised by their first bytes, whatever the file is called. (the name in messages,
# the opener; None: no stdlib reader, so the message says how to decompress it.)
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
          (b"PK\x03\x04", "zip"))
_DECOMPRESS_HINT = {"zstd": "zstd -d {p} -o out.jsonl (or pip install zstandard to read it directly)",
                    "zip": "unzip {p}, then point data.path at the .jsonl inside"}
_BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark: Notepad, Excel and PowerShell write it
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # PowerShell 5's `>` and Out-File write UTF-16 LE
# A file whose first character is "[" is one JSON array: it is decoded from one str holding the
# whole (decompressed) file, so it must fit memory: 256 MiB of text is at most 1 GiB as a str
# (4 bytes a character for text outside Latin-1), records then made one at a time.
JSON_ARRAY_MAX_BYTES = 256 * 2**20


def compression(head: bytes) -> str | None:
    """The compression a file's first bytes announce ("gzip", "bz2", "xz", "zstd", "zip"), or None."""
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


class _Prefixed(io.RawIOBase):
    """Bytes already read (to sniff a pipe's format) put back in front of the rest of it."""

    def __init__(self, head: bytes, rest: io.BufferedIOBase):
        self.head, self.rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.head:
            n = min(len(b), len(self.head))
            b[:n], self.head = self.head[:n], self.head[n:]
            return n
        return self.rest.readinto(b)


def _open_data(path: Path, stack: ExitStack) -> tuple[io.BufferedIOBase, str | None]:
    """``path``'s bytes, decompressed when its first bytes say gzip, bz2, xz (stdlib) or zstd
    (the ``zstandard`` module, where installed), and the compression's name. A pipe is read
    once: the bytes sniffed are put back in front of the stream."""
    raw = stack.enter_context(path.open("rb"))
    head = raw.read(8)
    if raw.seekable():
        raw.seek(0)
        f: io.BufferedReader = raw
    else:
        f = stack.enter_context(io.BufferedReader(_Prefixed(head, raw), tokcache.READ_BLOCK))
    kind = compression(head)
    if kind is None:
        return f, None
    if kind == "gzip":
        import gzip

        return stack.enter_context(gzip.GzipFile(fileobj=f, mode="rb")), kind
    if kind == "bz2":
        import bz2

        return stack.enter_context(bz2.BZ2File(f)), kind
    if kind == "xz":
        import lzma

        return stack.enter_context(lzma.LZMAFile(f)), kind
    if kind == "zstd":
        try:
            import zstandard
        except ImportError:
            pass
        else:
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
            return stack.enter_context(io.BufferedReader(reader, tokcache.READ_BLOCK)), kind
    raise UserError(f"{path} is {kind}-compressed and cannot be read as it is; decompress it first: "
                    + _DECOMPRESS_HINT[kind].format(p=path))


def _jsonl_records(dspec: DataSpec) -> Iterator[dict[str, Any]]:
    """Stream a JSONL file's records, one line in memory at a time, checking each; compressed
    (gzip, bz2, xz, zstd: told by their first bytes), from a pipe, with a byte-order mark and
    CRLF line ends alike. A file that is one JSON array is read whole (``_array_records``)."""
    path = _jsonl_path(dspec)
    kept = n = 0
    cap = dspec.max_samples  # read once: a config lookup a line is measurable at a million lines
    try:
        with ExitStack() as stack:
            f, kind = _open_data(path, stack)
            first = f.readline(JSON_ARRAY_MAX_BYTES + 1)
            if first.startswith(_UTF16_BOMS):
                raise UserError(f"{path} is UTF-16 text (byte-order mark {first[:2].hex(' ')}); re-encode it as "
                                f"UTF-8: iconv -f UTF-16 -t UTF-8 {path} > {path.stem}.utf8.jsonl")
            first = first.removeprefix(_BOM)  # utf-8-sig: the mark is not part of line 1's record
            if first.lstrip().startswith(b"["):
                records: Iterator[tuple[int, Any]] = _array_records(path, first, f, kind)
            else:
                if len(first) > JSON_ARRAY_MAX_BYTES:  # one long first line: read the rest of it
                    first += f.readline()
                records = _line_records(path, chain([first], f))
            for n, rec in records:
                check_record(rec, f"{path}:{n}")
                yield rec
                kept += 1
                if cap and kept >= cap:
                    break
    except OSError as e:
        if e.errno is None:  # gzip's BadGzipFile, bz2's "Invalid data stream": not the disk, the bytes
            raise _damaged(path, e) from None
        raise _unreadable(dspec, e) from None
    except Exception as e:
        if isinstance(e, EOFError) or type(e).__name__ in ("LZMAError", "ZstdError"):
            raise _damaged(path, e) from None  # a compressed stream cut short, or damaged
        raise
    if not kept:
        raise UserError(f"{path} holds no records; it needs one JSON object a line")


def _damaged(path: Path, e: BaseException) -> UserError:
    return UserError(f"{path} cannot be decompressed ({str(e) or type(e).__name__}): it is damaged or truncated; "
                     "copy or download it again")


def _line_records(path: Path, lines: Iterable[bytes]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line; a line is decoded on its own, so an
    error names it. CRLF ends are whitespace to the JSON parser."""
    for n, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{n} is not UTF-8 text (byte {e.object[e.start]:#04x}); re-encode the file "
                            "as UTF-8 (iconv -t UTF-8)") from None
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n} is not valid JSON ({e.msg}); fix or remove that line") from None


def _array_records(path: Path, first: bytes, rest: io.BufferedIOBase, kind: str | None) -> Iterator[tuple[int, Any]]:
    """(line, element) for each element of a file that is one JSON array (``[{...}, {...}]``,
    pretty-printed or not), read whole when it is at most ``JSON_ARRAY_MAX_BYTES``; else a
    UserError saying how to convert it to JSONL."""
    blob = first + rest.read(JSON_ARRAY_MAX_BYTES + 1 - len(first))
    if len(blob) > JSON_ARRAY_MAX_BYTES:
        src = f"{'zcat' if kind == 'gzip' else 'cat'} {path} | jq -c '.[]'" if kind else f"jq -c '.[]' {path}"
        limit = (f"{JSON_ARRAY_MAX_BYTES // 2**20} MiB" if JSON_ARRAY_MAX_BYTES >= 2**20
                 else f"{JSON_ARRAY_MAX_BYTES:,} bytes")
        raise UserError(f"{path} is one JSON array of more than {limit}, too big to "
                        f"read whole; convert it to JSONL (one object a line): {src} > {path.stem}.jsonl")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        line = blob.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line} is not UTF-8 text (byte {e.object[e.start]:#04x}); re-encode the file "
                        "as UTF-8 (iconv -t UTF-8)") from None
    del blob
    decoder, line, at = json.JSONDecoder(), 1, 0

    def where(pos: int) -> int:
        nonlocal line, at
        line += text.count("\n", at, pos)
        at = pos
        return line

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip(text.index("[") + 1)
    if pos < len(text) and text[pos] == "]":
        pos += 1
    else:
        while True:
            try:
                rec, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{where(e.pos)} is not valid JSON ({e.msg}); the file is one JSON array: "
                                "fix that element") from None
            yield where(pos), rec
            pos = skip(end)
            if pos < len(text) and text[pos] == ",":
                pos = skip(pos + 1)
                continue
            if pos < len(text) and text[pos] == "]":
                pos += 1
                break
            raise UserError(f"{path}:{where(pos)} is not valid JSON (expected ',' or ']' in the array); "
                            "fix that element")
    if skip(pos) < len(text):
        raise UserError(f"{path}:{where(skip(pos))} holds more after the JSON array ends; give one array, "
                        "or one JSON object a line (JSONL)")


def _hf_dataset(dspec: DataSpec) -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the datasets package: pip install 'finetune[hf]'") from None
    ds = datasets.load_dataset(dspec.hf_name, dspec.hf_config, split=dspec.hf_split)
    if dspec.max_samples:
        ds = ds.select(range(min(dspec.max_samples, len(ds))))
    return ds


def _hf_records(dspec: DataSpec, ds: Any) -> Iterator[dict[str, Any]]:
    for i, r in enumerate(ds):  # an arrow table on disk: rows are read as they are asked for
        rec = dict(r)
        check_record(rec, f"{dspec.hf_name} row {i}")
        yield rec


def iter_records(dspec: DataSpec, seed: int) -> Iterator[dict[str, Any]]:
    """The configured source's records one at a time, each checked (``check_record``): a
    file of any size streams through in constant memory."""
    if dspec.name == "synthetic":
        return iter(generate(dspec.num_samples, seed=seed))
    if dspec.name == "jsonl":
        _jsonl_path(dspec)  # a missing file is reported now, not at the first record
        return _jsonl_records(dspec)
    if dspec.name == "hf":
        return _hf_records(dspec, _hf_dataset(dspec))
    raise UserError(f"data={dspec.name} is not valid; choose one of: synthetic, jsonl, hf")


def load_records(dspec: DataSpec, seed: int) -> list[dict[str, Any]]:
    """Read the configured source into a list of dict records."""
    return list(iter_records(dspec, seed))


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
    if not (("prompt" in rec and "completion" in rec) or ("question" in rec and "answer" in rec) or "text" in rec):
        raise UserError(f"{where}: a record with keys {sorted(rec)[:8]} has no known format; give each record text, "
                        "prompt+completion, question+answer or messages")


def record_format(record: dict[str, Any]) -> str:
    """The format a (checked) record is read as, in ``_render``'s order: "chat messages",
    "prompt/completion", "question/answer" or "text"."""
    if "messages" in record:
        return "chat messages"
    if "prompt" in record and "completion" in record:
        return "prompt/completion"
    if "question" in record and "answer" in record:
        return "question/answer"
    return "text"


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
                  int((~kept).sum()), int(n.max(initial=0)))


def _tokenize_into(records: Iterable[dict[str, Any]], tokenizer: Any, seq_len: int, mask_prompt: bool,
                   writer: TokenWriter, progress: Callable[[int], None] | None = None) -> dict[str, int]:
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
            formats[f] = formats.get(f, 0) + 1
        c = _chunk_samples(chunk, tokenizer, seq_len, mask_prompt, cap)
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
             progress: Callable[[int], None] | None = None) -> Tokenized:
    """Tokenize records (EOS appended, counted in the loss), truncate to ``seq_len``, in memory.

    ``records`` may be any iterable (a list, ``iter_records``); the samples are one flat array
    of ids and one of masks, each sample a view (``Ragged``)."""
    writer = TokenWriter(tokcache.ids_dtype(tokenizer))
    stats = _tokenize_into(records, tokenizer, seq_len, mask_prompt, writer, progress)
    return _tokenized(*writer.finish_in_memory(), stats)


# -- the token cache (finetune/tokcache.py) -------------------------------------------------------

def _code_fingerprint(name: str) -> str:
    """A hash of the code that decides which records are read and what tokens they become: an
    edit to it (a new format, a changed mask rule) is a new cache entry, never a stale one."""
    funcs: list[Any] = [check_record, _render, _encode, record_char_cap, _chunk_samples, _tokenize_into,
                        _jsonl_records, _line_records, _array_records, _open_data, _hf_records]
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
    seed, show, t0 = spec.train.seed, spec.train.progress, time.perf_counter()
    label, source_key, records, total = _source(d, seed, keyed=bool(d.cache))
    _remove_stale_temporaries(d.cache_dir)
    if not d.cache or source_key is None:
        why = ("data.cache=false" if not d.cache else "data.path is a pipe, read once" if d.name == "jsonl"
               else "the data set has no fingerprint")
        return _in_memory(records, tokenizer, seq_len, mask_prompt, show, total, t0, f"{why}: nothing cached")
    key = {"source": source_key, "tokenizer": tokcache.tokenizer_fingerprint(tokenizer),
           "settings": {"seq_len": seq_len, "mask_prompt": mask_prompt}, "code": _code_fingerprint(d.name)}
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
            stats = _tokenize_into(records, tokenizer, seq_len, mask_prompt, writer, None if bar is None else bar.update)
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
    return _in_memory(records, tokenizer, seq_len, mask_prompt, show, total, t0, "not cached")


def _remove_stale_temporaries(cache_dir: str | None) -> None:
    """Temporaries that killed writers left (a token cache entry being built, a tiny model
    being assembled) go when the next run starts: those of a dead process, or untouched for
    an hour when no process is named (tokcache.remove_stale_temporaries)."""
    for root in {tokcache.cache_dir(cache_dir), cache_root()}:
        for p in tokcache.remove_stale_temporaries(root):
            log.info("removed %s, left by a writer that is gone", p)


def _in_memory(records: Iterator[dict[str, Any]], tokenizer: Any, seq_len: int, mask_prompt: bool, show: bool,
               total: int | None, t0: float, why: str) -> Tokenized:
    bar = _progress_bar(show, total)
    try:
        tok = tokenize(records, tokenizer, seq_len, mask_prompt, None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    print(f"tokenized {len(tok.ids)} samples in {time.perf_counter() - t0:.1f} s ({why})", file=sys.stderr)
    return tok


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
        self.lengths = tok.lengths  # tokens per sample, read once (the samples may be memory-mapped)
        # the longest sample: the segment train.pack_fill pads each sample's up to (base.pack_layout)
        self.longest = int(self.lengths.max())
        self.pad: dict[str, Any] = {"pad_multiple": pad_multiple, "max_len": max_len}  # collate's keywords
        self.steps_per_epoch = len(self.train_idx) // effective_batch
        self._epoch_cache: dict[int, list[np.ndarray]] = {}

    def _epoch(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._epoch_cache:
            rng = np.random.default_rng([self.seed, epoch])
            order = self.train_idx[rng.permutation(len(self.train_idx))]
            order = order[: self.steps_per_epoch * self.E]  # drop the ragged tail of an epoch
            lens = self.lengths[order]
            batches = []
            chunk = self.E * GROUP_STEPS
            for c in range(0, len(order), chunk):
                o, ln = order[c : c + chunk], lens[c : c + chunk]
                o = o[np.argsort(-ln, kind="stable")]  # longest first within the chunk
                group = [o[i : i + self.E] for i in range(0, len(o), self.E)]
                batches += [group[j] for j in rng.permutation(len(group))]
            self._epoch_cache = {epoch: batches}  # keep one epoch: memory stays flat
        return self._epoch_cache[epoch]

    def step_indices(self, step_index: int) -> np.ndarray:
        """The samples of 0-based optimizer step ``step_index``, in the step's order."""
        return self._epoch(step_index // self.steps_per_epoch)[step_index % self.steps_per_epoch]

    def step_lengths(self, step_index: int) -> np.ndarray:
        """Tokens of each sample of 0-based optimizer step ``step_index``, in the step's order."""
        return self.lengths[self.step_indices(step_index)]

    def train_batch(self, step_index: int) -> Batch:
        """Effective batch for 0-based optimizer step ``step_index`` (the same for any micro-batch)."""
        idx = self._epoch(step_index // self.steps_per_epoch)[step_index % self.steps_per_epoch]
        return collate([self.tok.ids[i] for i in idx], [self.tok.masks[i] for i in idx], idx, self.pad_id, **self.pad)

    def val_batches(self, batch_size: int, max_batches: int) -> list[Batch]:
        idx = self.val_idx[np.argsort(-self.lengths[self.val_idx], kind="stable")]  # longest first
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


def pad_multiple(spec: RunSpec) -> int:
    """``train.pad_multiple``, with 0 (auto) resolved: 32 on an Apple GPU, where MLX reuses a
    freed Metal buffer only for a request within two pages of its size (so repeated shapes
    matter) and mlx-lm pads the same way; 1 elsewhere (measured on CPU: padding cost speed
    and saved nothing once the cache is bounded)."""
    m = spec.train.pad_multiple
    if m:
        return m

    caps = capabilities(spec.backend.resolved)  # auto: mlx on Apple Silicon
    if not caps.default_pad_multiple:
        return 1  # no device of this backend pads by default: nothing to probe

    return caps.default_pad_multiple.get(run_device(caps.name, spec.backend.device), 1)


def build(spec: RunSpec, tokenizer: Any) -> tuple[DataSource, dict[str, Any]]:
    """Load, tokenize and split the configured data. Returns the source and its stats.

    The world's ranks (``spec.world``) share each optimizer step: the source's batches hold the
    effective batch of all of them (train.batch_size * train.grad_accum per rank), and each rank
    trains its own slice (``rank_slice``)."""
    t = spec.train
    tok = prepare(spec, tokenizer)
    if not tok.ids and tok.dropped_no_target:
        raise UserError(f"no completion tokens left in any of the {tok.dropped_no_target} samples after truncating to "
                        f"train.seq_len={t.seq_len} (the prompt fills it; longest sample {tok.longest} tokens); "
                        f"raise train.seq_len (e.g. train.seq_len={tok.longest}) or shorten the prompts")
    if not tok.ids:
        raise UserError("no sample has any target token after tokenizing; check the data format or train.seq_len")
    if tok.truncated:
        log.warning("%d of %d samples were longer than train.seq_len=%d and were truncated (longest %d tokens); "
                    "raise train.seq_len to keep them whole", tok.truncated, tok.records, t.seq_len, tok.longest)
    if tok.dropped_no_target:
        log.warning("%d samples had no target token within train.seq_len and were dropped", tok.dropped_no_target)

    cap, cut = t.packed_tokens, 0
    if cap:
        tok, cut = fit_to_micro(tok, cap, t.pack_overflow)
        if cut:
            log.warning("%d samples were longer than train.tokens_per_micro=%d and were %s (train.pack_overflow)", cut,
                        cap, "truncated" if t.pack_overflow == "truncate" else "split into pieces")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    multiple = pad_multiple(spec)
    src = DataSource(tok, int(pad), t.effective_batch * spec.world.world_size, t.seed, spec.data.val_fraction,
                     spec.data.max_val_samples, multiple, t.seq_len)
    lens = src.lengths
    stats: dict[str, Any] = {"records": tok.records, "formats": dict(tok.formats), "samples": len(tok.ids),
             "train_samples": len(src.train_idx),
             "val_samples": len(src.val_idx), "truncated": tok.truncated, "dropped_no_target": tok.dropped_no_target,
             "mean_tokens": float(lens.mean()), "max_tokens": int(lens.max()),
             # the widest micro-batch the run can see (train.pad_multiple): what plans price
             "pad_multiple": multiple,
             "max_padded_tokens": padded_length(int(lens.max()), multiple, t.seq_len)}
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


def packed_widths(lengths: np.ndarray, tokens_per_micro: int, fill: bool = False,
                  segment: int | None = None) -> np.ndarray:
    """Columns of each micro-batch ``backends.base.pack`` makes of samples of ``lengths``: every
    one but the last filled to ``tokens_per_micro`` (wider only for a sample longer than that),
    the last too with ``fill`` (``train.pack_fill``)."""
    return np.array([row.width for row in pack_layout(lengths, tokens_per_micro, fill, segment)], np.int64)


def packed_pair_span(lengths: np.ndarray, tokens_per_micro: int, fill: bool = False,
                     segment: int | None = None) -> float:
    """The most (query, key) pairs per position of the micro-batches ``pack`` makes of samples
    of ``lengths``: each one's segments' squares (its samples, with the pads that follow them
    under ``fill``, and its pad segments) summed over its columns, what attention run one
    sample at a time computes."""
    lens = [int(x) for x in lengths]
    return max(r.pair_span(lens) for r in pack_layout(lens, tokens_per_micro, fill, segment))


@dataclass(frozen=True)
class PackedSteps:
    """What the packed micro-batches of a run's steps hold at most (``packed_steps``)."""

    widest: int  # columns of the widest micro-batch
    targets: int  # target positions of the micro-batch that holds the most (the output head's rows)
    pair_span: float  # (query, key) pairs per position of the micro-batch with the most (packed_pair_span)
    pad_tokens: int  # pad columns over all the steps and ranks (what pack computes and no loss counts)


def packed_steps(src: DataSource, targets: np.ndarray, tokens_per_micro: int, steps: int, world_size: int = 1,
                 fill: bool = False) -> PackedSteps:
    """The micro-batches ``pack`` makes of the first ``steps`` optimizer steps of ``src``, each
    rank packing its own share of a step (``rank_slice``: rows rank, rank + W, ...), read
    from the samples' lengths and target counts (``targets``: ``Tokenized.targets``, which
    ``pack`` keeps: it masks each sample's first token). Under ``fill`` each sample's segment
    is padded up to the data's longest sample (``DataSource.longest``), as the loop packs it."""
    segment = src.longest
    widest = most = pads = 0
    span = 0.0
    for i in range(steps):
        idx = src.step_indices(i)
        for rank in range(world_size):
            mine = idx[rank::world_size]
            lens = [int(n) for n in src.lengths[mine]]
            tgt = targets[mine]
            for r in pack_layout(lens, tokens_per_micro, fill, segment):
                widest = max(widest, r.width)
                most = max(most, int(tgt[r.first:r.end].sum()))
                span = max(span, r.pair_span(lens))
                pads += r.width - r.used
    return PackedSteps(widest, most, span, pads)


def fit_to_micro(tok: Tokenized, cap: int, overflow: str) -> tuple[Tokenized, int]:
    """Samples longer than ``cap`` tokens (``train.tokens_per_micro`` below ``train.seq_len``)
    cut once, before training, so every step trains the same samples whatever the governor
    later does: "truncate" keeps the first ``cap`` tokens; "split" cuts pieces of ``cap``
    tokens, each starting at the previous piece's last token (its context only: a sample's
    first token is no target), so every target is trained exactly once. A piece or a
    truncation left without a target is dropped. Returns (the samples, how many were cut)."""
    if not len(tok.ids) or int(tok.lengths.max()) <= cap:
        return tok, 0
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    cut = 0
    for x, m in zip(tok.ids, tok.masks):
        x, m = np.asarray(x), np.asarray(m)
        if len(x) <= cap:
            ids.append(x)
            masks.append(m)
            continue
        cut += 1
        starts = [0] if overflow == "truncate" else range(0, len(x) - 1, cap - 1)
        for s in starts:
            if m[s + 1 : s + cap].any():
                ids.append(x[s : s + cap])
                masks.append(m[s : s + cap])
    return Tokenized(ids, masks, tok.truncated, tok.dropped_no_target, tok.longest, tok.records, tok.formats), cut
