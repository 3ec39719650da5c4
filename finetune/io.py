"""Atomic writes: nothing a reader can see is ever half-written, and each file and directory
comes out with the mode a plain ``open``/``mkdir`` would have given it under the process's
umask (``mkstemp``/``mkdtemp`` make 0600/0700, and safetensors writes 0600 whatever the umask).
And the run directory's lock: one run per directory."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

LOCK_FILE = ".lock"  # in the run dir; its content is never read, only its fcntl lock


def process_umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc, kernel 4.7+);
    elsewhere set and put back at once (``os.umask`` has no read-only form)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode(is_dir: bool = False, executable: bool = False, umask: int | None = None) -> int:
    """The mode ``open`` (0o666) or ``mkdir`` (0o777) gives a new file or directory under the
    process's umask (or ``umask``): 0644/0755 under umask 022, 0600/0700 under 077.
    ``executable``: a file that has an execute bit keeps them (0o777 & ~umask, a linker's)."""
    return (0o777 if is_dir or executable else 0o666) & ~(process_umask() if umask is None else umask)


def as_umask(root: str | Path) -> None:
    """Give ``root`` and everything under it (symlinks left alone) the mode the umask gives a
    new file or directory (``umask_mode``): what a temporary name made 0600/0700 is then as
    readable as any file the process writes in place."""
    mask = process_umask()
    root = Path(root)
    for p in (root, *root.rglob("*")):
        st = p.lstat()
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            continue  # a symlink (its own mode means nothing), a fifo
        mode = umask_mode(stat.S_ISDIR(st.st_mode), bool(st.st_mode & 0o111), umask=mask)
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(p, mode)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, rename it into place
    (with the mode the umask gives a new file, not mkstemp's 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())
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
    """Yield an empty temporary directory; on success it is fsynced and replaces ``path`` whole,
    itself and everything in it with the modes the umask gives (``finalize_dir``).

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
    used where several processes filled one ``tmp``, as sharded checkpoints do), its modes
    first set as the umask says (``as_umask``: mkdtemp made ``tmp`` 0700, writers such as
    safetensors made their files 0600)."""
    tmp, path = Path(tmp), Path(path)
    as_umask(tmp)
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
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)  # as the umask says
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
