"""Atomic writes: nothing a reader can see is ever half-written. And the run directory's lock:
one run per directory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

LOCK_FILE = ".lock"  # in the run dir; its content is never read, only its fcntl lock


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def fsync_tree(root: str | Path) -> None:
    """fsync every file under ``root``, then each directory (so the names are durable too)."""
    root = Path(root)
    dirs = [root]
    for p in root.rglob("*"):
        if p.is_dir():
            dirs.append(p)
        elif p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in dirs:
        _fsync_dir(d)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # a platform without directory fds (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it is fsynced and replaces ``path`` whole.

    A crash inside the block leaves ``path`` as it was (the old version, or absent).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finalize_dir(tmp, path)


def finalize_dir(tmp: str | Path, path: str | Path) -> None:
    """Put the complete directory ``tmp`` in place of ``path`` (the end of ``atomic_dir``; also
    used where several processes filled one ``tmp``, as sharded checkpoints do)."""
    tmp, path = Path(tmp), Path(path)
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def disk_errors(where: str | Path) -> Iterator[None]:
    """A full disk (or quota) while writing ``where``, as OSError whatever the writer raised:
    torch.save and MLX raise RuntimeError, safetensors SafetensorError, each with the OS's
    words in the message. Checked here, inside the write, while the half-written files still
    hold the space (once the temporary directory is removed the disk has room again)."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        import errno

        text = str(e)
        full = any(w in text for w in ("No space left", "ENOSPC", "Disk quota exceeded", "EDQUOT", "File too large"))
        if not full:
            try:
                st = os.statvfs(where)
                full = st.f_bavail * st.f_frsize < (1 << 20)  # under 1 MiB left: the write ran out
            except OSError:
                pass
        if not full:
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from e


class DirBusy(Exception):
    """Another process holds the directory's lock."""


class DirLock:
    """An exclusive ``fcntl.flock`` on ``<dir>/.lock``, held by this process until it exits
    (the OS releases it when the process dies, so ``kill -9`` leaves no stale lock).

    ``created``: this process made the lock file (a refused command removes it again, so the
    directory is left as it was). ``begun``: the run has started writing its results; until
    then a refusal may put back what was there before."""

    def __init__(self, directory: Path, fd: int | None, created: bool):
        self.directory, self.fd, self.created, self.begun = directory, fd, created, False

    def release(self, *, remove: bool = False) -> None:
        """Unlock; ``remove``: delete the lock file too (only while nothing was begun here)."""
        _HELD.pop(self.directory, None)
        if remove and self.created:
            (self.directory / LOCK_FILE).unlink(missing_ok=True)
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = None


_HELD: dict[Path, DirLock] = {}


def lock_dir(directory: str | Path) -> DirLock:
    """Take ``directory``'s lock, or return the one this process already holds. Raises
    DirBusy when another process holds it; OSError when the lock file cannot be made.
    Where fcntl does not exist (Windows) the lock is a no-op."""
    d = Path(directory).resolve()
    if d in _HELD:
        return _HELD[d]
    try:
        import fcntl
    except ImportError:
        _HELD[d] = DirLock(d, None, False)
        return _HELD[d]
    path = d / LOCK_FILE
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        import errno

        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DirBusy(str(d)) from None
        raise
    _HELD[d] = DirLock(d, fd, created)
    return _HELD[d]


def held_lock(directory: str | Path) -> DirLock | None:
    """The lock this process holds on ``directory``, or None."""
    return _HELD.get(Path(directory).resolve())
