"""Saving and resuming one run's checkpoints, on one rank or several.

``finetune.run.files`` finds checkpoints and owns the run dir's files without a model (the
CLI and the supervisor read it before anything loads); this module writes and reads them with
the run's collaborators: the backend's state, the governor's levers, the ranks' agreement on
whether a save worked, and the identity a resume must share with the run that saved.

A checkpoint is written whole or not at all (``finetune.io.atomic_dir``); a failed write
leaves the earlier ones as they were and, per ``train.on_save_error``, stops the run
(UserError) or is logged as an event and the run goes on.
"""

from __future__ import annotations

import functools
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.run import files as checkpoints
from finetune.backends.base import Comm
from finetune.errors import UserError
from finetune.run.faults import Faults
from finetune.io import atomic_dir, atomic_write_json, disk_errors, finalize_dir
from finetune.run.log import RunLogWriteError
from finetune.io import fsync_tree
from finetune.model.describe import lora_keys
from finetune.planner.setup import model_handle
from finetune.spec import DataSpec, RunSpec

log = logging.getLogger("finetune")

# what a resumed run must share with its checkpoint (see Checkpointer.identity)
IDENTITY_KEYS = ("backend", "model_path", "method", "lora_rank", "lora_keys", "seed", "data")
State = Callable[[], dict[str, Any]]  # a checkpoint's trainer state, built when it is written


class Checkpointer:
    """One run's checkpoints: save after a step, resume from the newest good one.

    Args:
        spec: the run's resolved spec (train.*, model, method, data).
        run_dir: the run's directory (rank 0's under several ranks).
        backend: the run's Backend (save_state, load_state; rank_state and sharded where it
            has them).
        backend_name: the backend's name as the checkpoint records it.
        model_dir: the model's resolved directory.
        comm: the ranks of the run.
        governor: the run's Governor; its levers go into each checkpoint and come back on resume.
        runlog: the run log, told of a save that failed under train.on_save_error=continue.
        faults: the run's test-only faults (a full disk inside the write, a pause).
    """

    def __init__(self, spec: RunSpec, run_dir: Path, backend: Any, backend_name: str, model_dir: Path,
                 comm: Comm, governor: Any, runlog: Any, faults: Faults):
        self.spec, self.run_dir, self.backend, self.backend_name = spec, run_dir, backend, backend_name
        self.model_dir, self.comm, self.governor, self.runlog, self.faults = model_dir, comm, governor, runlog, faults
        self.keep = spec.train.keep_checkpoints
        self.effective_batch = spec.train.effective_batch
        self._identity: dict[str, Any] | None = None

    # -- identity ----------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with the run that resumes it: backend, model, method,
        the seed (it draws the adapter's init, dropout and the order of samples) and the data
        source (read once, at the first call: a file edited later is another run's data)."""
        if self._identity is None:
            m = self.spec.method
            data = data_identity(self.spec.data)
            # method.lora.keys as the model resolves them (null: its default keys)
            keys = lora_keys(model_handle(self.spec, self.model_dir).desc, m.lora.keys)
            self._identity = {"backend": self.backend_name, "model": self.spec.model.name,
                              "model_path": str(self.model_dir), "method": m.name,
                              "lora_rank": m.lora.rank, "lora_keys": list(keys),
                              "seed": self.spec.train.seed, "data": data}
        return self._identity

    def trainer_state(self, step: int, tokens: int, samples: int) -> dict[str, Any]:
        """trainer_state.json of the checkpoint after ``step``: the governor's levers, the
        batch and ranks it was trained with, the counts so far and the run's identity."""
        g = self.governor
        return {"step": step, "micro_batch": g.micro, "tokens_per_micro": g.state.tokens_per_micro,
                "grad_checkpointing": g.grad_checkpointing, "loss_chunk": g.loss_chunk,
                "effective_batch": self.effective_batch, "world_size": self.comm.world_size,
                "tokens": tokens, "samples": samples, **self.identity()}

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, tokens: int, samples: int, signalled: bool = False) -> bool:
        """Write the checkpoint after ``step`` (temporary name, fsync, rename), then prune to
        ``train.keep_checkpoints``. A failed write leaves the earlier checkpoints as they were
        and, per ``train.on_save_error``, stops the run (UserError) or returns False.
        ``signalled``: a signal asked for this save (a test's pause strikes only then)."""
        # built where it is written: on rank 0 alone, once the tensors are down
        state = functools.partial(self.trainer_state, step, tokens, samples)
        if self.comm.world_size > 1:
            return self._save_ranks(step, state, signalled)
        error = self.write(step, state, signalled)
        if error is not None:
            return self._failed(step, checkpoints.checkpoint_path(self.run_dir, step), error)
        checkpoints.prune(self.run_dir, keep=self.keep)
        return True

    def write(self, step: int, state: State, signalled: bool = False) -> OSError | None:
        """One process's checkpoint after ``step``, whole or not at all; the error, if any.
        ``state`` gives its trainer state."""
        try:
            with atomic_dir(checkpoints.checkpoint_path(self.run_dir, step)) as tmp, disk_errors(tmp):
                (tmp / "backend").mkdir()
                self.backend.save_state(tmp / "backend")
                self.faults.in_save(step, signalled)
                atomic_write_json(tmp / checkpoints.STATE_FILE, state())
        except OSError as e:
            return e
        return None

    def _save_ranks(self, step: int, state: State, signalled: bool) -> bool:
        """The checkpoint of a run of several ranks. ddp: rank 0 writes it (every rank's RNG
        in it). fsdp: every rank writes its shards into one temporary directory (torch's
        distributed checkpoint), then rank 0 adds the trainer state and renames it into place.
        Every rank learns whether the save worked (one agreement), so all stop or all go on."""
        path = checkpoints.checkpoint_path(self.run_dir, step)
        rank_states = self.comm.all_gather_object(self.backend.rank_state() if hasattr(self.backend, "rank_state")
                                                  else None)
        if getattr(self.backend, "sharded", False):
            error = self._write_shards(step, path, state, rank_states, signalled)
        elif self.comm.rank == 0:
            error = self._write_whole(step, path, state, rank_states, signalled)
        else:
            error = None
        if self.comm.agree(error is not None).raised[0]:
            return self._failed(step, path, error or OSError(f"rank 0 could not write {path}"))
        if self.comm.rank == 0:
            checkpoints.prune(self.run_dir, keep=self.keep)
        return True

    def _write_whole(self, step: int, path: Path, state: State, rank_states: list[Any],
                     signalled: bool) -> OSError | None:
        """ddp's checkpoint, written by rank 0 alone with every rank's state in it."""
        try:
            with atomic_dir(path) as tmp, disk_errors(tmp):
                (tmp / "backend").mkdir()
                self.backend.save_state(tmp / "backend", *self._rank_states(rank_states))
                self.faults.in_save(step, signalled)
                atomic_write_json(tmp / checkpoints.STATE_FILE, state())
        except OSError as e:
            return e
        return None

    def _write_shards(self, step: int, path: Path, state: State, rank_states: list[Any],
                      signalled: bool) -> OSError | None:
        """fsdp's checkpoint: rank 0 makes the temporary directory, every rank writes its
        shards there, rank 0 adds the trainer state and renames it into place; the ranks agree
        after each part, so none writes into a directory another could not make."""
        comm, rank = self.comm, self.comm.rank
        tmp = path.with_name(f".{path.name}.shards.tmp")
        error: OSError | None = None
        if rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / "backend").mkdir(parents=True)
            except OSError as e:
                error = e
        if not comm.agree(error is not None).raised[0]:
            try:
                with disk_errors(tmp):
                    self.backend.save_state(tmp / "backend", *self._rank_states(rank_states))
            except OSError as e:
                error = e
            if not comm.agree(error is not None).raised[0] and rank == 0:
                try:
                    self.faults.in_save(step, signalled)
                    atomic_write_json(tmp / checkpoints.STATE_FILE, state())

                    fsync_tree(tmp)
                    finalize_dir(tmp, path)
                except OSError as e:
                    error = e
        if rank == 0 and error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return error

    def _rank_states(self, rank_states: list[Any]) -> tuple[Any, ...]:
        # a backend that keeps per-rank state (torch's RNG) takes every rank's; MLX draws its
        # dropout keys from (seed, rank, micro-step) and needs none
        return (rank_states,) if hasattr(self.backend, "rank_state") else ()

    def _failed(self, step: int, path: Path, e: OSError) -> bool:
        """A checkpoint not written: say so; stop (UserError) or go on, per train.on_save_error."""
        prev = checkpoints.latest_checkpoint(self.run_dir)
        kept = f"the previous checkpoint {prev.name} is intact" if prev else "no earlier checkpoint exists"
        msg = (f"checkpoint at step {step} not saved ({e.strerror or e}); {kept}; free space or fix "
               f"permissions on {path.parent}")
        if self.spec.train.on_save_error == "continue":
            log.warning("%s; training goes on (train.on_save_error=continue)", msg)
            self.runlog.event({"step": step, "trigger": "save_error", "action": "continue",
                               "before": None, "after": None, "error": str(e)})
            return False
        raise UserError(f"{msg}, then continue with train.resume=true hydra.run.dir={self.run_dir} "
                        "(or set train.on_save_error=continue)") from None

    def adapter_failed(self, step: int, e: OSError, tokens: int, samples: int) -> UserError:
        """The final adapter not written: keep the trained state as a checkpoint where one can
        be written (a resume then writes the adapter without training again), else say plainly
        which steps are lost."""
        d = self.run_dir
        why = f"adapter not saved to {d / 'adapter'} ({e.strerror or e})"
        fix = f"free space or fix permissions on {d}"
        if self.comm.world_size == 1:
            failed = self.write(step, functools.partial(self.trainer_state, step, tokens, samples))
            if failed is None:
                checkpoints.prune(d, keep=self.keep)
                return UserError(f"{why}; the trained state after step {step} is kept as "
                                 f"{checkpoints.checkpoint_path(d, step).relative_to(d)}: {fix}, then "
                                 f"train.resume=true hydra.run.dir={d} writes the adapter (no step is trained again)")
            why += f", nor a checkpoint of step {step} ({failed.strerror or failed})"
        prev = checkpoints.latest_state(d)
        if prev is not None and int(prev[1]["step"]) < step:
            return UserError(f"{why}; steps {int(prev[1]['step']) + 1}-{step} are lost, the checkpoint "
                             f"{prev[0].name} is intact: {fix}, then continue with train.resume=true hydra.run.dir={d}")
        return UserError(f"{why}: the {step} trained steps are lost (metrics.jsonl keeps their losses); {fix} and "
                         "run again (train.save_every=N keeps checkpoints along the way)")

    # -- resume ------------------------------------------------------------------------------
    def resume(self) -> tuple[int, int, int]:
        """Load the newest good checkpoint when train.resume is set: (its step, tokens,
        samples), or (0, 0, 0) for a fresh run. A damaged checkpoint gives way to the one
        before; one from another run (identity, effective batch) stops the run (UserError)."""
        if not self.spec.train.resume:
            return 0, 0, 0
        ckpts = checkpoints.list_checkpoints(self.run_dir)
        if not ckpts:
            raise UserError(f"train.resume=true but {self.run_dir}/checkpoints holds no checkpoint; "
                            "point hydra.run.dir at the run to continue, or set train.save_every")
        for ckpt in reversed(ckpts):  # newest first; a damaged one gives way to the one before
            state = self._read(ckpt)
            if state is None or not self._load(ckpt, state):
                continue
            self.governor.restore(state)
            if self.comm.rank != 0:
                pass
            elif ckpt != ckpts[-1]:
                print(f"resumed from {ckpt} (the previous good checkpoint) at step {state['step']}", file=sys.stderr)
            else:
                print(f"resumed from {ckpt} at step {state['step']}", file=sys.stderr)
            return int(state["step"]), state["tokens"], state["samples"]
        raise UserError(f"every checkpoint in {self.run_dir}/checkpoints is damaged; start a new run dir "
                        "(or remove train.resume=true)")

    def _read(self, ckpt: Path) -> dict[str, Any] | None:
        """``ckpt``'s trainer state, or None (said) when it cannot be read."""
        try:
            state = checkpoints.read_state(ckpt)
            int(state["step"]), int(state["tokens"]), int(state["samples"]), int(state["effective_batch"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"checkpoint {ckpt.name} is damaged (trainer state: {e}); trying the one before", file=sys.stderr)
            return None
        return state

    def _load(self, ckpt: Path, state: dict[str, Any]) -> bool:
        """Check that ``ckpt`` is this run's (UserError if not) and load its backend state;
        False (said) when that state is damaged."""
        self._check_same_run(ckpt, state)
        try:
            self.backend.load_state(ckpt / "backend")
        except Exception as e:  # a truncated or missing tensor file, a wrong shape
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"checkpoint {ckpt.name} is damaged ({type(e).__name__}: {first[:200]}); trying the one before",
                  file=sys.stderr)
            return False
        return True

    def _check_same_run(self, ckpt: Path, state: dict[str, Any]) -> None:
        """UserError unless ``state`` shares this run's identity and effective batch (times
        ranks: a run may resume on other ranks if the batch per optimizer step is the same)."""
        mine, eff = self.identity(), self.effective_batch
        for key in IDENTITY_KEYS:
            if key in state and state[key] != mine[key]:
                raise UserError(f"checkpoint {ckpt} is from another run ({_differs(key, state[key], mine[key])}); "
                                "resume with the same backend, model, method, seed and data, or start a new run dir")
        world, saved_world = self.comm.world_size, int(state.get("world_size", 1))
        if state["effective_batch"] * saved_world != eff * world:
            if world == saved_world == 1:
                raise UserError(f"checkpoint was trained with effective batch {state['effective_batch']}, this "
                                f"run has {eff}; keep train.batch_size * train.grad_accum equal to resume")
            raise UserError(f"checkpoint was trained with effective batch {state['effective_batch'] * saved_world} "
                            f"({saved_world} rank(s)), this run has {eff * world} ({world} rank(s)); keep "
                            "train.batch_size * train.grad_accum * ranks equal to resume")


def runlog_failed(run_dir: Path, e: RunLogWriteError) -> UserError:
    """metrics.jsonl could not take a line: stop as a failed checkpoint does, saying what the
    newest checkpoint keeps."""
    d = run_dir
    at = f" at step {e.step}" if e.step is not None else ""
    prev = checkpoints.latest_checkpoint(d)
    if prev is not None:
        return UserError(f"{e.filename} not written{at} ({e.strerror}); the checkpoint {prev.name} is intact; free "
                         f"space or fix permissions on {d}, then continue with train.resume=true hydra.run.dir={d}")
    return UserError(f"{e.filename} not written{at} ({e.strerror}); no checkpoint exists (train.save_every=0), so "
                     f"the steps so far are lost; free space or fix permissions on {d} and run again")


def data_identity(data: DataSpec) -> dict[str, Any]:
    """The data a run trains on, as a resume compares it: its kind, what names it, the
    settings that pick its samples and, for a file, its size and modification time (an edited
    file is other data; its content hash would cost a full read on every resume)."""
    ident: dict[str, Any] = {"name": data.name, "max_samples": data.max_samples, "val_fraction": data.val_fraction}
    if data.name == "synthetic":
        ident["num_samples"] = data.num_samples
    elif data.name == "jsonl" and data.path:
        path = Path(str(data.path)).expanduser()
        ident["path"] = str(path.resolve())
        try:
            st = path.stat()
            ident["size"], ident["mtime_ns"] = st.st_size, st.st_mtime_ns
        except OSError:
            ident["size"] = ident["mtime_ns"] = None
    elif data.name == "hf":
        ident.update(hf_name=data.hf_name, hf_config=data.hf_config, hf_split=data.hf_split)
    return ident


def _differs(key: str, saved: Any, mine: Any) -> str:
    """``key=saved, this run has mine``, narrowed to the fields that differ for a dict."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        keys = [k for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]
        return "; ".join(f"{key}.{k}={saved.get(k)}, this run has {mine.get(k)}" for k in keys)
    return f"{key}={saved}, this run has {mine}"
