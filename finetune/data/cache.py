"""Tokenized data on disk: written once, memory-mapped by the next run and by every sweep job.

An entry is a directory named ``<source>-<key hash>`` under the cache dir holding three flat
arrays as ``.npy`` files (``np.load(..., mmap_mode="r")`` opens them) and a manifest:

  ids.npy      every kept sample's token ids, end to end (uint16 when the vocabulary fits, else int32)
  mask.npy     int8, 1 where the token counts in the loss, aligned with ids
  offsets.npy  int64, samples + 1 entries: sample i is ids[offsets[i]:offsets[i + 1]]
  manifest.json  the full key, counts, the token statistics and a sha256 of each array's data

The key names everything that changes the tokens (the data source and its content, the
tokenizer, seq_len, mask_prompt, max_samples, the code that renders records); the directory
name is its hash, so a changed input is a different entry, never an overwrite. Entries are
built under a temporary name and renamed into place whole; when two jobs build the same entry
at once the first rename wins and the other uses it (both are the same bytes). A reader checks
sizes, offsets and checksums before trusting an entry: a damaged one is rebuilt, never trained on.
A temporary's name carries its writer's host and pid, so the next run removes those of writers
that died (``remove_stale_temporaries``) and never a live one's.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from finetune.io import _fsync_dir, as_umask, fsync_tree
from finetune.model.source import TOKENIZER_FILES
from finetune.model.tiny import cache_root

CACHE_FORMAT = 1  # bump when the layout of an entry changes
HEADER_BYTES = 128  # an .npy v1.0 header for a 1-D array of any length up to 10**20 (numpy pads to 64)
READ_BLOCK = 1 << 20  # bytes per read when hashing: 1 MiB keeps hashing at disk speed, memory flat
FILES = ("ids.npy", "mask.npy", "offsets.npy")


class Damaged(Exception):
    """An entry that exists but cannot be trusted (truncated, edited, half-deleted)."""


def cache_dir(configured: str | None) -> Path:
    """``data.cache_dir``; null: ``$FINETUNE_CACHE/tokens`` (beside the tiny models), else
    ``~/.cache/finetune/tokens``."""
    if configured:
        return Path(configured).expanduser()

    return cache_root() / "tokens"


def digest_file(path: Path, count_lines: bool = False) -> tuple[str, int]:
    """(sha256 hex of the file's bytes, its number of newlines if asked, else 0), read in
    ``READ_BLOCK`` pieces. Raises OSError as reading does."""
    h, lines = hashlib.sha256(), 0
    with path.open("rb") as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
            if count_lines:
                lines += block.count(b"\n")
    return h.hexdigest(), lines



def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer's output: a hash of the files it was loaded from (or, for
    one not loaded from a directory, of its serialized form or vocabulary), plus what can be
    changed after loading (special tokens, chat template) and the library versions that run it."""
    h = hashlib.sha256()
    src = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    files = [src / n for n in TOKENIZER_FILES if (src / n).is_file()] if src.is_dir() else []
    for p in files:
        h.update(p.name.encode() + b"\0")
        h.update(digest_file(p)[0].encode())
    if not files:  # a hub id whose files live elsewhere, or a tokenizer built in memory
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            h.update(backend.to_str().encode())
        else:
            h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    import tokenizers
    import transformers

    return {"class": type(tokenizer).__name__, "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "files_sha256": h.hexdigest(), "vocab": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "special": sorted(map(str, getattr(tokenizer, "all_special_tokens", []))),
            "chat_template": getattr(tokenizer, "chat_template", None),
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def entry_path(root: Path, label: str, key: dict[str, Any]) -> Path:
    """``root/<label>-<hash>``: the label (a file name, a data set id) only helps a person
    find an entry; the hash decides."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._")[:60] or "data"
    return root / f"{safe}-{key_hash(key)}"


class Ragged(Sequence):
    """Samples cut out of one flat array by offsets: ``r[i]`` is a view, no copy. Works the
    same over an in-memory array and a memory-mapped one."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: Any) -> np.ndarray:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]  # type: ignore[return-value]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def ids_dtype(tokenizer: Any) -> np.dtype:
    """uint16 when every id fits (a vocabulary of at most 65,536: half the bytes), else int32."""
    if len(tokenizer) <= 1 << 16 and max(tokenizer.get_vocab().values(), default=0) < 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _npy_header(dtype: np.dtype, count: int) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": (count,)})
    head = buf.getvalue()
    if len(head) != HEADER_BYTES:  # numpy pads a 1-D header to 128 bytes; a new layout would show here
        raise RuntimeError(f"unexpected .npy header size {len(head)} (numpy {np.__version__})")
    return head


class _Column:
    """One flat array appended to an .npy file (header patched at the end), or kept in memory."""

    def __init__(self, dtype: npt.DTypeLike, path: Path | None):
        self.dtype, self.path, self.count = np.dtype(dtype), path, 0
        self.sha = hashlib.sha256()
        self.parts: list[np.ndarray] = []
        self.f: BinaryIO | None = None
        if path is not None:
            self.f = path.open("wb")
            self.f.write(_npy_header(self.dtype, 0))

    def append(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, self.dtype)
        self.count += len(a)
        if self.f is None:
            self.parts.append(a)
            return
        b = a.data.cast("B")
        self.sha.update(b)
        self.f.write(b)

    def finish(self) -> np.ndarray | dict[str, Any]:
        if self.f is None:
            return np.concatenate(self.parts) if self.parts else np.zeros(0, self.dtype)
        self.f.seek(0)
        self.f.write(_npy_header(self.dtype, self.count))
        self.f.close()
        return {"dtype": self.dtype.str, "count": self.count, "sha256": self.sha.hexdigest()}

    def close(self) -> None:
        if self.f is not None and not self.f.closed:
            self.f.close()


class TokenWriter:
    """Collects samples chunk by chunk into the three flat arrays: in a temporary directory
    beside ``final`` (published by ``publish``), or in memory when ``final`` is None."""

    def __init__(self, dtype: np.dtype, final: Path | None = None):
        self.final = final
        self.tmp: Path | None = None
        if final is not None:
            final.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{writer_tag('tmp')}", suffix=".tmp",
                                             dir=final.parent))
        d = self.tmp
        try:
            self.ids = _Column(dtype, d / "ids.npy" if d else None)
            self.mask = _Column(np.int8, d / "mask.npy" if d else None)
            self.offsets = _Column(np.int64, d / "offsets.npy" if d else None)
            self.offsets.append(np.zeros(1, np.int64))
        except BaseException:
            self.abort()
            raise
        self.tokens = 0

    def add(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        """Append a chunk: its samples' ids and masks end to end, and each sample's length."""
        if ids.size and int(ids.max()) > np.iinfo(self.ids.dtype).max:
            raise ValueError(f"token id {int(ids.max())} does not fit {self.ids.dtype}")
        self.ids.append(ids)
        self.mask.append(mask)
        self.offsets.append(self.tokens + np.cumsum(lengths, dtype=np.int64))
        self.tokens += int(ids.shape[0])

    def finish_in_memory(self) -> tuple[Ragged, Ragged]:
        offsets = self.offsets.finish()
        return Ragged(self.ids.finish(), offsets), Ragged(self.mask.finish(), offsets)  # type: ignore[arg-type]

    def publish(self, stats: dict[str, Any], key: dict[str, Any]) -> Path:
        """Close the files, write the manifest, fsync, rename into place. Returns the entry's
        path: ours, or the one another process renamed there first."""
        assert self.tmp is not None and self.final is not None
        files = {"ids.npy": self.ids.finish(), "mask.npy": self.mask.finish(), "offsets.npy": self.offsets.finish()}
        manifest = {"format": CACHE_FORMAT, "key": key, "samples": self.offsets.count - 1, "tokens": self.tokens,
                    "stats": stats, "files": files}
        (self.tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        as_umask(self.tmp)  # mkdtemp made it 0700: a shared cache is as readable as the umask says
        fsync_tree(self.tmp)
        try:
            os.rename(self.tmp, self.final)  # a directory onto a non-empty one fails: the first wins
        except OSError:
            if not self.final.exists():
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)  # another job published the same entry first
        else:
            _fsync_dir(self.final.parent)
        self.tmp = None
        return self.final

    def abort(self) -> None:
        for c in ("ids", "mask", "offsets"):
            if hasattr(self, c):
                getattr(self, c).close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def _data_sha256(path: Path) -> str:
    """sha256 of an .npy file's data (after its header), read with plain reads: checking an
    entry does not pull the whole memory map into this process's RSS."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(HEADER_BYTES)
        while block := f.read(READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def load(path: Path, key: dict[str, Any]) -> tuple[Ragged, Ragged, dict[str, Any]] | None:
    """The entry at ``path`` as (ids, masks, manifest), memory-mapped; None when there is none.

    Raises:
        Damaged: the entry is there but fails a check (manifest, sizes, offsets, checksums).
    """
    mpath = path / "manifest.json"
    if not path.is_dir():
        return None
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise Damaged("no manifest.json") from None
    except (OSError, ValueError) as e:
        raise Damaged(f"manifest.json unreadable: {e}") from None
    try:
        return _check(path, manifest, key)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a manifest of another shape
        raise Damaged(f"manifest.json malformed ({type(e).__name__}: {e})") from None


def _check(path: Path, manifest: dict[str, Any], key: dict[str, Any]) -> tuple[Ragged, Ragged, dict[str, Any]]:
    if manifest.get("format") != CACHE_FORMAT or manifest.get("key") != json.loads(json.dumps(key, default=str)):
        raise Damaged("manifest.json does not match this entry's key")
    arrays = {}
    for name in FILES:
        info = manifest["files"][name]
        p = path / name
        want = HEADER_BYTES + int(info["count"]) * np.dtype(info["dtype"]).itemsize
        try:
            size = p.stat().st_size
        except OSError as e:
            raise Damaged(f"{name}: {e.strerror or e}") from None
        if size != want:
            raise Damaged(f"{name} is {size} bytes, expected {want}")
        try:  # an empty array cannot be memory-mapped; its header is still checked
            a = np.load(p, mmap_mode="r" if int(info["count"]) else None)
        except (OSError, ValueError) as e:
            raise Damaged(f"{name}: {e}") from None
        if a.dtype != np.dtype(info["dtype"]) or a.shape != (int(info["count"]),):
            raise Damaged(f"{name} holds {a.dtype}{list(a.shape)}, expected {info['dtype']}[{info['count']}]")
        if _data_sha256(p) != info["sha256"]:
            raise Damaged(f"{name} fails its checksum")
        arrays[name] = a
    off = arrays["offsets.npy"]
    if (len(off) != manifest["samples"] + 1 or off[0] != 0 or off[-1] != len(arrays["ids.npy"])
            or len(arrays["mask.npy"]) != len(arrays["ids.npy"]) or (len(off) > 1 and np.any(np.diff(off) < 0))):
        raise Damaged("offsets do not describe the arrays")
    return Ragged(arrays["ids.npy"], off), Ragged(arrays["mask.npy"], off), manifest


def set_aside(path: Path) -> None:
    """Move a damaged entry out of the way (a unique name, then deleted): a job still reading
    its memory maps keeps them, and a new build can take the name."""
    aside = path.with_name(f".{path.name}.{writer_tag('damaged')}{os.urandom(3).hex()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another job moved it first
        return
    shutil.rmtree(aside, ignore_errors=True)


def entries(root: Path) -> Iterator[Path]:
    """The published entries under ``root`` (temporary and set-aside ones skipped)."""
    if root.is_dir():
        yield from sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


# -- temporaries of writers that died -------------------------------------------------------------

STALE_AFTER_SECONDS = 3600  # a temporary naming no process of this host, untouched this long, is dead
_TAGGED = re.compile(r"\.(?:tmp|damaged)-([A-Za-z0-9_]+)-(\d+)-")  # what ``writer_tag`` writes
# Temporaries this package's writers leave: tagged ones, and those named before tags (the cache's
# ``.<entry>.<random>.tmp``, the tiny builder's ``.tmp-tiny-<random>``), which only age can retire.
# Matched exactly (an entry's name, then mkdtemp's 8 random characters or a tag), so a shared
# data.cache_dir never loses another program's ``.something.tmp``.
_TEMPORARY = re.compile(r"^\.[A-Za-z0-9._-]*-[0-9a-f]{20}\."
                        r"(?:[a-z0-9_]{8}\.tmp|(?:tmp|damaged)-[A-Za-z0-9_]+-\d+-\w+(?:\.tmp)?)$"
                        r"|^\.tmp-tiny-[a-z0-9_]{8}$")


def _host() -> str:
    import socket

    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:32] or "host"


def writer_tag(kind: str) -> str:
    """``<kind>-<host>-<pid>-``: put in a temporary's name so the next run can tell whether
    its writer still lives (``remove_stale_temporaries``)."""
    return f"{kind}-{_host()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _last_touched(d: Path) -> float:
    """The newest mtime of ``d`` and what it holds (a writer appending to a file touches it)."""
    times = [d.stat().st_mtime]
    for root, dirs, files in os.walk(d):
        for name in (*dirs, *files):
            try:
                times.append(os.lstat(os.path.join(root, name)).st_mtime)
            except OSError:
                pass
    return max(times)


def remove_stale_temporaries(root: Path, now: float | None = None) -> list[Path]:
    """Remove the temporary directories under ``root`` whose writers are gone, and return them.

    A temporary tagged with this host and a pid (``writer_tag``) goes when that pid is not a
    live process, however old (a tokenization may run for hours); one tagged by another host,
    or untagged (older names, the tiny builder's), goes once nothing in it changed for
    ``STALE_AFTER_SECONDS``. A live writer's temporary is never removed."""
    import time

    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        children = list(root.iterdir())
    except OSError:  # no such dir yet, or unreadable: nothing to clean
        return removed
    host = _host()
    for p in children:
        if not _TEMPORARY.match(p.name):
            continue
        try:
            if not p.is_dir() or p.is_symlink():
                continue
            tag = _TAGGED.search(p.name)
            if tag and tag.group(1) == host:
                stale = not _alive(int(tag.group(2)))
            else:
                stale = now - _last_touched(p) > STALE_AFTER_SECONDS
        except OSError:  # removed by another run while we looked
            continue
        if stale:
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append(p)
    return removed
