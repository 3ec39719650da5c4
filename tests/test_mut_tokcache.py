"""The token cache's entries checked file by file: what a damaged entry is refused with, and
what an intact one gives back. Built with TokenWriter directly (no tokenizer needed): the
arrays a run would write, then each damage a disk or a second job can do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from finetune.data import cache as tokcache
from finetune.data.cache import Damaged, TokenWriter
import warm_cli

KEY = {"data": "x.jsonl", "seq_len": 16}
IDS = np.array([5, 6, 7, 8, 9, 10, 11], np.uint16)
MASK = np.array([0, 1, 1, 0, 0, 1, 1], np.int8)
LENGTHS = np.array([3, 4])


def entry(tmp_path: Path) -> Path:
    w = TokenWriter(np.dtype(np.uint16), tmp_path / "cache" / "entry")
    w.add(IDS[:3], MASK[:3], LENGTHS[:1])
    w.add(IDS[3:], MASK[3:], LENGTHS[1:])
    return w.publish({"longest": 4}, KEY)


def test_an_entry_reads_back_as_written(tmp_path: Path) -> None:
    p = entry(tmp_path)
    ids, masks, manifest = tokcache.load(p, KEY)
    assert [list(ids[i]) for i in range(len(ids))] == [[5, 6, 7], [8, 9, 10, 11]]
    assert [list(masks[i]) for i in range(len(masks))] == [[0, 1, 1], [0, 0, 1, 1]]
    assert manifest["samples"] == 2 and manifest["tokens"] == 7 and manifest["stats"] == {"longest": 4}
    assert (p / "ids.npy").stat().st_size == tokcache.HEADER_BYTES + 7 * 2
    assert not list(p.parent.glob(".*"))  # no temporary left beside it


def test_in_memory_writer_gives_the_same_arrays_and_empty_is_empty() -> None:
    w = TokenWriter(np.dtype(np.uint16))
    w.add(IDS, MASK, LENGTHS)
    ids, masks = w.finish_in_memory()
    assert [list(ids[i]) for i in range(len(ids))] == [[5, 6, 7], [8, 9, 10, 11]]
    empty_ids, _ = TokenWriter(np.dtype(np.uint16)).finish_in_memory()
    assert len(empty_ids) == 0 and list(empty_ids.lengths) == []


@pytest.mark.parametrize("cut", [-3, +1])
def test_a_file_of_the_wrong_size_is_damaged_naming_both_sizes(tmp_path: Path, cut: int) -> None:
    p = entry(tmp_path)
    f = p / "ids.npy"
    data = f.read_bytes()
    f.write_bytes(data[:cut] if cut < 0 else data + b"\0" * cut)
    want = tokcache.HEADER_BYTES + 14
    with pytest.raises(Damaged, match=rf"^ids.npy is {want + cut} bytes, expected {want}$"):
        tokcache.load(p, KEY)


def test_a_changed_byte_fails_the_checksum(tmp_path: Path) -> None:
    p = entry(tmp_path)
    f = p / "mask.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(Damaged, match=r"^mask.npy fails its checksum$"):
        tokcache.load(p, KEY)


def test_another_key_or_no_manifest_is_damaged_and_no_entry_is_none(tmp_path: Path) -> None:
    p = entry(tmp_path)
    with pytest.raises(Damaged, match="does not match this entry's key"):
        tokcache.load(p, {**KEY, "seq_len": 32})
    m = json.loads((p / "manifest.json").read_text())
    (p / "manifest.json").write_text(json.dumps({**m, "format": m["format"] + 1}))
    with pytest.raises(Damaged, match="does not match this entry's key"):
        tokcache.load(p, KEY)
    (p / "manifest.json").unlink()
    with pytest.raises(Damaged, match="^no manifest.json$"):
        tokcache.load(p, KEY)
    assert tokcache.load(tmp_path / "nothing", KEY) is None


def test_a_token_id_past_the_dtype_is_refused() -> None:
    w = TokenWriter(np.dtype(np.uint16))
    with pytest.raises(ValueError, match="token id 70000 does not fit uint16"):
        w.add(np.array([1, 70000], np.int64), np.ones(2, np.int8), np.array([2]))


class _Vocab:  # the two things ids_dtype asks of a tokenizer (transformers' API)
    def __init__(self, n: int, top: int):
        self.n, self.top = n, top

    def __len__(self) -> int:
        return self.n

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "z": self.top}


@pytest.mark.parametrize(("n", "top", "want"), [(65536, 65535, np.uint16), (65537, 65535, np.int32),
                                                (32000, 65536, np.int32), (151936, 151935, np.int32)])
def test_ids_are_stored_in_16_bits_only_where_every_id_fits(n: int, top: int, want) -> None:
    assert tokcache.ids_dtype(_Vocab(n, top)) == np.dtype(want)


def test_cleaning_removes_a_dead_writers_temporary_and_keeps_a_live_ones(tmp_path: Path) -> None:
    import sys

    root = tmp_path / "cache"
    live = TokenWriter(np.dtype(np.uint16), root / ("x.jsonl-" + "0123456789abcdef0123"))
    live.add(IDS[:3], MASK[:3], LENGTHS[:1])  # this process is writing it now
    mine = [p for p in root.iterdir() if p.name.startswith(".")]
    assert len(mine) == 1
    gone = warm_cli.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(gone.stdout)  # a process that has exited
    dead = root / mine[0].name.replace(f"-{os.getpid()}-", f"-{dead_pid}-")
    assert dead != mine[0]
    dead.mkdir()
    assert tokcache.remove_stale_temporaries(root) == [dead]
    assert mine[0].is_dir() and not dead.exists()
