"""A run's directory as Hydra hands it over: made before Hydra writes into it (or refused in
one line), locked for a single training run, and put back as it was when the command is refused.

Hydra makes the run dir, opens its log and saves ``.hydra/{config,hydra,overrides}.yaml``
before the task runs (``hydra.core.utils.run_job``). Hydra calls ``RunDirCallback`` just before
that (``on_run_start``; conf/config.yaml ``hydra.callbacks``): it takes a training run's lock
first, so a second run into a busy directory is refused having written nothing, and keeps what
those files held (``RunDirGuard``); a command refused later (a resume of another run, a missing
data file) calls ``put_back``, which leaves an existing run's directory as it was and removes
one that holds only what Hydra wrote.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from finetune.run import files as checkpoints
from finetune.config import config_error_line
from finetune.errors import UserError, refuse


class RunDirGuard:
    """A single training run's directory as it was before Hydra wrote into it, and its lock."""

    HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")

    def __init__(self, run_dir: Path, subdir: str | None):
        self.run_dir = run_dir
        self.hydra_dir = run_dir / subdir if subdir else None
        self.hydra_dir_existed = bool(self.hydra_dir and self.hydra_dir.is_dir())
        self.files: dict[Path, bytes | None] = {}
        if self.hydra_dir is not None:
            for name in self.HYDRA_FILES:
                f = self.hydra_dir / name
                self.files[f] = f.read_bytes() if f.is_file() else None
        self.logs = {f: f.stat().st_size for f in run_dir.glob("*.log") if f.is_file()}
        self.lock = checkpoints.lock_run_dir(run_dir)

    def restore(self) -> None:
        """Put back what this command wrote before the run began (nothing once it has begun)."""
        if self.lock.begun:
            return
        for f, old in self.files.items():
            try:
                if old is None:
                    f.unlink(missing_ok=True)
                elif not f.is_file() or f.read_bytes() != old:
                    f.write_bytes(old)
            except OSError:
                pass
        if self.hydra_dir is not None and not self.hydra_dir_existed:
            try:
                self.hydra_dir.rmdir()  # only when empty: nothing of anyone else's goes
            except OSError:
                pass
        for f in self.run_dir.glob("*.log"):
            try:
                if f not in self.logs:
                    f.unlink()
                elif f.stat().st_size > self.logs[f]:
                    os.truncate(f, self.logs[f])
            except OSError:
                pass
        self.lock.release(remove=True)


# the guards this process took, by run dir: Hydra makes the callback that takes one, and the
# task that refuses the command finds it by its run dir (as the loop finds its lock, io.held_lock)
_GUARDS: dict[Path, RunDirGuard] = {}


def several_ranks() -> bool:
    """A launcher started this process as one of several (torchrun, srun, mlx.launch, mpirun):
    rank 0's Trainer takes the lock once the ranks agree on one run dir."""
    env = os.environ
    return any(int(env.get(k) or 1) > 1 for k in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")) \
        or "MLX_RANK" in env


class RunDirCallback(Callback):
    """Hydra callback (conf/config.yaml ``hydra.callbacks``), called before Hydra writes into
    the run dir: the dir made and written to (or the command refused in one line), and a
    single training run's guard taken."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        try:
            # the path Hydra records (hydra.runtime.output_dir): the task's run_dir
            run_dir = Path(os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir"))))
            checkpoints.make_run_dir(run_dir)
            if config.get("mode") == "train" and not several_ranks():
                _GUARDS[run_dir] = RunDirGuard(run_dir, config.hydra.output_subdir)
        except UserError as e:  # not writable, or another run holds its lock
            refuse(e)
        except OmegaConfBaseException as e:  # Hydra would raise it next; a callback's error only warns
            refuse(UserError(config_error_line(e) or str(e)))

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            refuse(UserError(f"cannot write {e.filename or sweep_dir} ({e.strerror or e}); set hydra.sweep.dir= "
                             "to a writable directory"))


def put_back(run_dir: Any) -> None:
    """After a refused command: what this command wrote into the run dir before its run began
    undone (``RunDirGuard.restore``), and a run dir that holds only what Hydra wrote (.hydra/,
    its log) removed, so nothing is left that looks like a run's result."""
    if run_dir is None:
        return
    d = Path(os.path.abspath(str(run_dir)))
    guard = _GUARDS.pop(d, None)
    if guard is not None:
        guard.restore()
    if d.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in d.iterdir()):
        shutil.rmtree(d, ignore_errors=True)
