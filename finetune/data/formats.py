"""Records as files and data sets hold them: which source ``data=`` names (synthetic, a JSONL
file, a hub data set), how a file is read (JSONL or one JSON array, plain or gzip / bz2 / xz /
zstd told by its first bytes, a UTF-8 byte-order mark, CRLF ends, a pipe), and the record
formats (``check_record``, ``record_format``). Every record that cannot be used is named by file
and line."""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from itertools import chain
from pathlib import Path
from typing import Any

from finetune.data import cache as tokcache
from finetune.errors import UserError
from finetune.spec import DataSpec
from finetune.synthetic import generate


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
    if "chosen" in rec or "rejected" in rec:
        check_pair(rec, where)
        return
    if "label" in rec and "completion" in rec:
        check_unpaired(rec, where)
        return
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


PAIR_FORMAT = "preference pairs"  # record_format's name for {"prompt", "chosen", "rejected"}
UNPAIRED_FORMAT = "unpaired (KTO)"  # record_format's name for {"prompt", "completion", "label"}
# the run's count of preference records says which rendered through the chat template (their
# prompt, as mode=generate formats it, is a chat prompt): "preference pairs, chat turns"
CHAT_TURNS = ", chat turns"


def _turns_text(value: Any) -> str:
    """A completion's text as a pair holds it: a string, or the contents of its chat turns."""
    if isinstance(value, str):
        return value
    return "".join(str(m.get("content") or "") for m in value if isinstance(m, dict))


def _check_turns(value: Any, where: str, key: str) -> None:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: '{key}' must be a string or a non-empty list of {{role, content}} turns")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: '{key}' turn {i} is not a {{role, content}} object with string content; "
                            "give every turn a role and its text")


def check_pair(rec: dict[str, Any], where: str) -> None:
    """UserError naming ``where`` (file:line) for a preference record that cannot train: a
    missing prompt, chosen or rejected, an empty completion, or chosen equal to rejected
    (a pair with no preference: its loss has no gradient)."""
    for key in ("prompt", "chosen", "rejected"):
        if key not in rec:
            other = "rejected" if key == "chosen" else "chosen"
            raise UserError(f"{where}: a preference record without '{key}'; give every pair a prompt, a chosen and a "
                            f"rejected completion (this one has {other if other in rec else 'neither'})"
                            if key != "prompt" else
                            f"{where}: a preference record without 'prompt'; give every pair the prompt its "
                            "completions answer (a string or chat turns)")
        value = rec[key]
        if not isinstance(value, str):
            _check_turns(value, where, key)
    for key in ("chosen", "rejected"):
        if not _turns_text(rec[key]).strip():
            raise UserError(f"{where}: '{key}' is empty; every pair needs two non-empty completions: fix or remove it")
    if rec["chosen"] == rec["rejected"]:
        raise UserError(f"{where}: 'chosen' equals 'rejected'; a pair must prefer one completion over a different "
                        "one: fix or remove it")


def check_unpaired(rec: dict[str, Any], where: str) -> None:
    """UserError naming ``where`` (file:line) for a KTO record that cannot train: a missing or
    empty prompt or completion (strings or chat turns), or a label that is not true or false."""
    for key in ("prompt", "completion"):
        if key not in rec:  # (a record without a completion is not read as KTO's)
            raise UserError(f"{where}: a labelled (KTO) record without '{key}'; give every record a prompt, a "
                            "completion and a label (true: desirable, false: undesirable)")
        if not isinstance(rec[key], str):
            _check_turns(rec[key], where, key)
        if not _turns_text(rec[key]).strip():
            # the prompt's first token carries the label (finetune/data/tokens.py ``_unpaired_chunk``)
            raise UserError(f"{where}: '{key}' is empty; a KTO record needs a prompt and a non-empty completion: fix "
                            "or remove it")
    if not isinstance(rec["label"], bool):
        raise UserError(f"{where}: 'label' is {rec['label']!r}; give true (a desirable completion) or false (an "
                        "undesirable one)")


def record_format(record: dict[str, Any]) -> str:
    """The format a (checked) record is read as, in ``_render``'s order: "preference pairs",
    "unpaired (KTO)", "chat messages", "prompt/completion", "question/answer" or "text"."""
    if "chosen" in record:
        return PAIR_FORMAT
    if "label" in record and "completion" in record:
        return UNPAIRED_FORMAT
    if "messages" in record:
        return "chat messages"
    if "prompt" in record and "completion" in record:
        return "prompt/completion"
    if "question" in record and "answer" in record:
        return "question/answer"
    return "text"


# the readers whose code decides which records a source yields: the token cache's key hashes
# them (finetune/data/tokens.py ``_code_fingerprint``), so an edit to one is a new entry
READERS = (_jsonl_records, _line_records, _array_records, _open_data, _hf_records)
