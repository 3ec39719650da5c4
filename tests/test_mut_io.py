"""When a writer's own error means the disk ran full (the words of its message, or under
1 MiB left where it wrote), and a refused run leaving its run dir as it found it: no lock
file. Written for survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from finetune.io import atomic_write_json, disk_errors


@pytest.mark.parametrize(("left_bytes", "full"), [(600 * 1024, True), (1024 * 1024 - 4096, True),
                                                  (1024 * 1024, False), (64 * 2**20, False)])
def test_a_writers_error_is_a_full_disk_when_under_1_mib_is_left(monkeypatch, tmp_path, left_bytes, full):
    # the file system's answer (os.statvfs) stands in for a disk filled to this point
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_bavail=left_bytes // 4096, f_frsize=4096))
    with pytest.raises(OSError if full else RuntimeError) as e:
        with disk_errors(tmp_path):
            raise RuntimeError("failed to write tensor data")  # as safetensors/MLX word it: no OS words
    if full:
        assert e.value.errno == errno.ENOSPC and str(e.value) == f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"


def test_atomic_write_json_makes_the_missing_parent_directories(tmp_path):
    atomic_write_json(tmp_path / "a" / "b" / "state.json", {"step": 3})
    assert (tmp_path / "a" / "b" / "state.json").read_text() == '{\n  "step": 3\n}\n'
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["state.json"]  # no temporary left


def test_a_lock_just_taken_has_not_begun_so_a_refusal_removes_its_lock_file(tmp_path):
    """The loop and the CLI release a refused command's lock with remove=not lock.begun: until
    the run writes its first result, the run dir is left without the lock file it made."""
    from finetune.io import lock_dir

    lock = lock_dir(tmp_path)
    assert (tmp_path / ".lock").is_file() and lock.created and not lock.begun
    lock.release(remove=not lock.begun)
    assert list(tmp_path.iterdir()) == []
