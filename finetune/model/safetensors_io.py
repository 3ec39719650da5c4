"""safetensors files, framework-free: the one reader of their header, the one table of their
dtypes, and whole files of tensors read and written with numpy (no torch, no mlx).

The format (safetensors/src/tensor.rs): an 8-byte little-endian header length, a JSON header
``{name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}``, then the raw
little-endian tensor bytes, each tensor's ``data_offsets`` counted from the end of the header.
The model's checks (finetune/model/source.py: a damaged download, the checkpoint's element
count), finetune-export (adapters read and written, a base's shapes) and the secret scan of
an export (finetune/redact.py) all read it here.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from finetune.errors import UserError

# safetensors' own limit on the JSON header (safetensors/src/tensor.rs MAX_HEADER_SIZE): a
# larger length in the first 8 bytes is not a header but damage.
SAFETENSORS_MAX_HEADER_BYTES = 100_000_000

# safetensors' dtype names (safetensors/src/tensor.rs Dtype): bytes per element, and the numpy
# type a tensor of that dtype is read into (None: not converted; bf16 kept as its raw uint16
# bits, as no arithmetic is done on the tensors read here). A name not here is left unchecked
# by ``damage`` rather than refused (the format may grow).
DTYPES: dict[str, tuple[int, Any]] = {
    "BOOL": (1, np.bool_), "U8": (1, np.uint8), "I8": (1, np.int8),
    "F8_E5M2": (1, None), "F8_E4M3": (1, None), "F8_E8M0": (1, None),
    "I16": (2, np.int16), "U16": (2, None), "F16": (2, np.float16), "BF16": (2, np.uint16),
    "I32": (4, np.int32), "U32": (4, np.uint32), "F32": (4, np.float32),
    "I64": (8, np.int64), "U64": (8, None), "F64": (8, np.float64), "C64": (8, None),
}


def dtype_bytes(dtype: str) -> int | None:
    """Bytes per element of safetensors dtype ``dtype``; None for a name this table lacks."""
    entry = DTYPES.get(dtype)
    return entry[0] if entry else None


def _header_length(f: Any, size: int) -> int | str:
    """The header length a file's first 8 bytes announce, or why it cannot be one."""
    head = f.read(8)
    if len(head) < 8:
        return f"{size} bytes, shorter than the 8-byte header length"
    n = int.from_bytes(head, "little")
    if n > SAFETENSORS_MAX_HEADER_BYTES or 8 + n > size:
        return f"its header claims {n:,} bytes but the file holds {size:,}"
    return n


def header_bytes(path: Path | str) -> bytes | str:
    """The raw JSON header of a ``.safetensors`` file (what the secret scan reads: the rest is
    tensor data), or why it has none."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as f:
            n = _header_length(f, size)
            return n if isinstance(n, str) else f.read(n)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"


def read_header(path: Path | str) -> tuple[dict[str, Any], int] | str:
    """(the JSON header, the byte offset where tensor data starts) of a ``.safetensors`` file,
    or why it has none (the 8-byte little-endian length, then that many bytes of a JSON object)."""
    raw = header_bytes(path)
    if isinstance(raw, str):
        return raw
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return "its header is not valid JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    return header, 8 + len(raw)


def header(path: Path | str) -> tuple[dict[str, Any], int]:
    """``read_header``, raising UserError (naming the file and why) for a file without one."""
    got = read_header(path)
    if isinstance(got, str):
        raise UserError(f"{path} is not a safetensors file ({got}); re-save it with safetensors")
    return got


def tensors_of(head: dict[str, Any]) -> dict[str, Any]:
    """The tensor entries of a header (its ``__metadata__`` left out)."""
    return {k: v for k, v in head.items() if k != "__metadata__"}


def damage(path: Path | str) -> str | None:
    """Why a ``.safetensors`` file cannot be whole, or None when its layout holds: the 8-byte
    little-endian header length, the JSON header it announces, and every tensor's
    ``data_offsets`` inside the file (their end is the file's end, as safetensors writes it),
    each tensor's bytes its dtype times its shape. Reads the header only: no torch, no weights."""
    got = read_header(path)
    if isinstance(got, str):
        return got
    head, start = got
    size = Path(path).stat().st_size
    data_bytes, end_max = size - start, 0
    for name, t in tensors_of(head).items():
        off = t.get("data_offsets") if isinstance(t, dict) else None
        if (not isinstance(off, list) or len(off) != 2 or not all(isinstance(x, int) for x in off)
                or not 0 <= off[0] <= off[1]):
            return f"tensor {name} has no valid data_offsets"
        if off[1] > data_bytes:
            return f"tensor {name} ends at byte {start + off[1]:,} of a {size:,}-byte file"
        width, shape = dtype_bytes(str(t.get("dtype"))), t.get("shape")
        if width is not None and isinstance(shape, list) and off[1] - off[0] != width * math.prod(shape):
            return f"tensor {name} holds {off[1] - off[0]:,} bytes, not {t['dtype']}{shape}"
        end_max = max(end_max, off[1])
    if end_max != data_bytes:
        return f"{data_bytes - end_max:,} bytes after its last tensor"
    return None


# ---- whole files of tensors (finetune-export's adapters) ----------------------------------
@dataclass
class Tensor:
    """A tensor as stored: its safetensors dtype name and its values (bf16 as uint16 bits)."""

    dtype: str
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def T(self) -> Tensor:  # numpy's name for the transpose
        return Tensor(self.dtype, np.ascontiguousarray(self.data.T))


def read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Every tensor of ``path`` (values copied out of the file) and its ``__metadata__``."""
    head, start = header(path)
    meta = head.pop("__metadata__", None) or {}
    raw = Path(path).read_bytes()
    out = {}
    for name, h in head.items():
        np_type = DTYPES.get(h["dtype"], (0, None))[1]
        if np_type is None:
            raise UserError(f"{path}: tensor {name} has dtype {h['dtype']}, which finetune-export does not convert")
        b, e = h["data_offsets"]
        dtype = np.dtype(np_type).newbyteorder("<")
        count = int(np.prod(h["shape"], dtype=np.int64))
        if count * dtype.itemsize != e - b or start + e > len(raw):
            raise UserError(f"{path}: tensor {name} does not fit its byte range; the file is damaged")
        arr = np.frombuffer(raw, dtype=dtype, count=count, offset=start + b)
        out[name] = Tensor(h["dtype"], arr.reshape(h["shape"]).copy())
    return out, meta


def write_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (sorted by name, as the safetensors library does) into ``path``."""
    head: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        n = t.data.nbytes
        head[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the library writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            data = tensors[name].data
            f.write(np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<")).tobytes())
