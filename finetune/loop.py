"""The one training loop. Both backends run through it; a backend contributes numbers only.

Per optimizer step: take the step's effective batch (fixed by seed and step), split it into
micro-batches of the governor's current size, accumulate gradients with the loss scaled by
1 / (label tokens of the whole step), step the optimizer, sample memory, log one metrics line.
Because the scale is global to the step, the split does not change the math: an adapted run
trains the same samples in the same order to the same losses.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from finetune import checkpoints, faults
from finetune.backends import OutOfMemory, get_backend, resolve_backend_name
from finetune.backends.base import Batch, Comm, pack
from finetune.config import UserError, validate
from finetune.data import rank_slice
from finetune.io import atomic_dir, atomic_write_json, disk_errors, finalize_dir
from finetune.redact import redact_tree
from finetune.runlog import RankRunLog, RunLog, RunLogWriteError

log = logging.getLogger("finetune")


def lr_at(step: int, cfg: Any) -> float:
    """Learning rate for 1-based optimizer ``step``: linear warmup, then the schedule."""
    return schedule(cfg)(step)


def schedule(cfg: Any) -> Callable[[int], float]:
    """``lr_at`` with the config read once: the loop asks every step, and an OmegaConf read
    costs tens of microseconds where a plain float costs nothing."""
    return functools.partial(_lr, base=float(cfg.optim.lr), total=int(cfg.train.steps),
                             warm=int(cfg.train.warmup_steps or 0), kind=str(cfg.train.schedule))


def _lr(step: int, base: float, total: int, warm: int, kind: str) -> float:
    if warm and step <= warm:
        return base * step / warm
    if kind == "constant" or total <= warm:
        return base
    frac = (step - warm) / max(1, total - warm)
    if kind == "linear":
        return base * (1.0 - frac)
    return base * 0.5 * (1.0 + math.cos(math.pi * frac))  # cosine to 0 at the last step


class Trainer:
    """Owns one run: setup, the step loop, evaluation, checkpoints and the run directory."""

    def __init__(self, cfg: Any):
        validate(cfg)
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        # a run dir this process made is removed again if the run fails on a bad input before
        # writing anything a user could take for a result
        self.created_run_dir = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / f".write_test.{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise UserError(f"run dir {self.run_dir} cannot be created or written ({e.strerror or e}); "
                            "set hydra.run.dir= to a writable directory") from None
        self.events: list[dict[str, Any]] = []
        # metrics.jsonl, the progress bar and the chosen loggers; a logger's missing package
        # stops the run here, before anything is downloaded or loaded. Their copy of the
        # config has every token and key masked (finetune/redact.py).
        chosen = cfg.get("logger")
        self.runlog = RunLog(self.run_dir, chosen,
                             redact_tree(OmegaConf.to_container(cfg, resolve=True)) if chosen else None)
        self.comm = Comm()  # one process until connect() joins a launcher's ranks
        self.lock: Any = None  # the run dir's lock (finetune.io.DirLock), taken by claim()
        self._stop: _StopOnSignal | None = None
        self._stop_agreed = False
        self._lr = schedule(cfg)  # optimizer step -> learning rate

    # -- ranks -------------------------------------------------------------------------------
    def connect(self) -> None:
        """Pick the backend and join the launcher's process group, if one started us (torchrun,
        ``accelerate launch``, SLURM, ``mlx.launch``). Under several ranks rank 0's run dir is
        the run's (Hydra names each rank's by its own clock), rank 0 alone writes the run log,
        and the planner plans per rank for ``backend.num_devices`` = the world size."""
        cfg = self.cfg
        self.backend_name, self._backend_reason = resolve_backend_name(cfg.backend.name)
        self.backend = get_backend(self.backend_name)
        self.comm = self.backend.connect(cfg)
        if self.comm.world_size <= 1:
            return
        mine = self.run_dir
        self.run_dir = Path(self.comm.all_gather_object(str(mine))[0])
        if self.run_dir != mine:
            if self.created_run_dir or all(p.name == ".hydra" or p.suffix == ".log" for p in mine.iterdir()):
                shutil.rmtree(mine, ignore_errors=True)  # this rank's own, unused: rank 0's is the run's
            self.created_run_dir = False
            cfg.run_dir = str(self.run_dir)
        if cfg.backend.get("device_map") != "auto":
            cfg.backend.num_devices = self.comm.world_size
        if self.comm.rank != 0:
            self.runlog = RankRunLog(self.run_dir)
            # the warnings every rank would repeat (truncated samples, plan notes): rank 0's
            logging.getLogger("finetune").setLevel(logging.ERROR)

    def claim(self) -> None:
        """The checks that need no model, done before anything is loaded: this process takes
        the run dir's lock (rank 0 under several ranks; the OS drops it when the process dies,
        so ``kill -9`` leaves none behind), a resume finds a checkpoint, and a new run does not
        land on another run's checkpoints or result (``train.overwrite=true`` replaces them once
        the run begins). Every rank learns whether any refused, so all stop together."""
        d, t = self.run_dir, self.cfg.train
        refused: UserError | None = None
        try:
            if self.comm.rank == 0:
                self.lock = checkpoints.lock_run_dir(d)
            if t.resume and not checkpoints.list_checkpoints(d):
                raise UserError(f"train.resume=true but {d}/checkpoints holds no checkpoint; point hydra.run.dir "
                                "at the run to continue, or set train.save_every")
            held = [] if t.resume or t.get("overwrite") else checkpoints.results_in(d)
            if held:
                resume = "continue it with train.resume=true, " if checkpoints.list_checkpoints(d) else ""
                raise UserError(f"run dir {d} holds another run ({', '.join(held)}); {resume}choose a new "
                                "hydra.run.dir, or replace it with train.overwrite=true")
        except UserError as e:
            refused = e
        if self.comm.world_size > 1 and self.comm.all_reduce([1.0 if refused else 0.0])[0] > 0 and refused is None:
            raise UserError("another rank refused the run dir (rank 0 says why)")
        if refused is not None:
            raise refused

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from finetune import data as data_mod
        from finetune.accounting import Accountant
        from finetune.governor import Governor
        from finetune.model_source import check_weights, resolve_model_dir

        cfg = self.cfg
        if not hasattr(self, "backend"):
            self.connect()
        if self.comm.rank == 0:
            print(self._backend_reason + (f"; {self.comm.world_size} ranks ({cfg.backend.strategy})"
                                          if self.comm.world_size > 1 else ""), file=sys.stderr)
        self.governor = Governor(cfg, self.backend_name, self._event)
        # Before any download: stop if even the weights and state cannot fit the budget.
        self.governor.before_load(seq_len=8, only_check=True)
        self.model_dir = resolve_model_dir(cfg.model, seed=0)
        check_weights(self.model_dir, cfg.model)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir),
                                                           trust_remote_code=bool(cfg.model.trust_remote_code))
        except (OSError, ValueError, KeyError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"model.path={self.model_dir}: its tokenizer cannot be loaded ({first[:200]}); point "
                            "model.path at a complete HF-format model (tokenizer files included)") from None
        self.data, self.data_stats = data_mod.build(cfg, self.tokenizer, world_size=self.comm.world_size)
        # may lower the micro-batch / turn on checkpointing; plans for the longest sample (packed:
        # the widest packed micro-batch of the run's steps)
        self.governor.before_load(seq_len=self.data_stats.get("max_micro_tokens") or self.data_stats["max_padded_tokens"])
        # Peaks are per run: an earlier run in this process (a test, a benchmark) must not
        # leak its peak into ours; the load itself stays inside the peak. Objects an earlier
        # run left in reference cycles are collected now, not in the middle of this one.
        gc.collect()
        self.backend.reset_peak()
        self.info = self.backend.setup(cfg, self.model_dir)
        if self.governor.grad_checkpointing and not cfg.train.grad_checkpointing:
            self.backend.set_grad_checkpointing(True)
        self.governor.attach(self.backend)
        self.governor.apply_loss_chunk()  # a chunked loss the plan chose to fit the budget
        self.acct = Accountant(self.backend, sample_every=cfg.memory.sample_every, rank=self.comm.rank,
                               phase_every=int(getattr(cfg.memory, "phase_every", 10)))
        self.acct.run_facts = {"adaptations": self.events, "adapt": bool(cfg.memory.adapt),
                               "budget_set": cfg.memory.budget is not None}
        self.acct.sample(0, "load")

    def _event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        if self.comm.rank != 0:  # every rank decides the same (one collective); rank 0 says it
            return
        print(f"[governor] step {ev['step']}: {ev['trigger']} -> {ev['action']} "
              f"({json.dumps(ev['before'])} -> {json.dumps(ev['after'])})", file=sys.stderr)
        self.runlog.event(ev)

    # -- checkpoints -------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must share with the run that resumes it: backend, model, method,
        the seed (it draws the adapter's init, dropout and the order of samples) and the data
        source (read once, at the first call: a file edited later is another run's data)."""
        m = self.cfg.method
        if not hasattr(self, "_data_identity"):
            self._data_identity = data_identity(self.cfg.data)
        return {"backend": self.backend_name, "model": str(self.cfg.model.name), "model_path": str(self.model_dir),
                "method": str(m.name), "lora_rank": int(m.lora.rank), "lora_keys": list(self._lora_keys()),
                "seed": int(self.cfg.train.seed), "data": self._data_identity}

    def _lora_keys(self) -> tuple[str, ...]:
        """``method.lora.keys`` as the model resolves them (null: its default keys)."""
        from finetune.planner.describe import lora_keys
        from finetune.planner.model import model_desc

        return lora_keys(model_desc(self.cfg.model, self.model_dir), self.cfg.method.lora["keys"])

    def save_checkpoint(self, step: int, stop: _StopOnSignal | None = None) -> bool:
        """Write the checkpoint after ``step`` (temporary name, fsync, rename), then prune to
        ``train.keep_checkpoints``. A failed write leaves the earlier checkpoints as they were
        and, per ``train.on_save_error``, stops the run (UserError) or returns False."""
        if self.comm.world_size > 1:
            return self._save_checkpoint_ranks(step, stop)
        error = self._write_checkpoint(step, stop)
        if error is not None:
            return self._save_failed(step, checkpoints.checkpoint_path(self.run_dir, step), error)
        checkpoints.prune(self.run_dir, keep=int(self.cfg.train.keep_checkpoints))
        return True

    def _write_checkpoint(self, step: int, stop: _StopOnSignal | None) -> OSError | None:
        """One process's checkpoint after ``step``, whole or not at all; the error, if any."""
        try:
            with atomic_dir(checkpoints.checkpoint_path(self.run_dir, step)) as tmp, disk_errors(tmp):
                (tmp / "backend").mkdir()
                self.backend.save_state(tmp / "backend")
                faults.in_save(step, bool(stop is not None and stop.requested))
                atomic_write_json(tmp / checkpoints.STATE_FILE, self._trainer_state(step))
        except OSError as e:
            return e
        return None

    def _trainer_state(self, step: int) -> dict[str, Any]:
        return {"step": step, "micro_batch": self.governor.micro,
                "tokens_per_micro": self.governor.state.tokens_per_micro,
                "grad_checkpointing": self.governor.grad_checkpointing,
                "loss_chunk": self.governor.loss_chunk,
                "effective_batch": self.cfg.train.batch_size * self.cfg.train.grad_accum,
                "world_size": self.comm.world_size,
                "tokens": self.tokens, "samples": self.samples, **self._identity()}

    def _save_checkpoint_ranks(self, step: int, stop: _StopOnSignal | None) -> bool:
        """The checkpoint of a run of several ranks. ddp: rank 0 writes it (every rank's RNG
        in it). fsdp: every rank writes its shards into one temporary directory (torch's
        distributed checkpoint), then rank 0 adds the trainer state and renames it into place.
        Every rank learns whether the save worked (one all-reduce), so all stop or all go on."""
        path = checkpoints.checkpoint_path(self.run_dir, step)
        comm, rank = self.comm, self.comm.rank
        rank_states = comm.all_gather_object(self.backend.rank_state() if hasattr(self.backend, "rank_state")
                                             else None)
        error: OSError | None = None
        if getattr(self.backend, "sharded", False):
            tmp = path.with_name(f".{path.name}.shards.tmp")
            if rank == 0:
                try:
                    shutil.rmtree(tmp, ignore_errors=True)
                    (tmp / "backend").mkdir(parents=True)
                except OSError as e:
                    error = e
            if comm.all_reduce([1.0 if error else 0.0])[0] == 0:
                try:
                    with disk_errors(tmp):
                        self.backend.save_state(tmp / "backend", *self._rank_states(rank_states))
                except OSError as e:
                    error = e
                if comm.all_reduce([1.0 if error else 0.0])[0] == 0 and rank == 0:
                    try:
                        faults.in_save(step, bool(stop is not None and stop.requested))
                        atomic_write_json(tmp / checkpoints.STATE_FILE, self._trainer_state(step))
                        from finetune.io import fsync_tree

                        fsync_tree(tmp)
                        finalize_dir(tmp, path)
                    except OSError as e:
                        error = e
            if rank == 0 and error is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        elif rank == 0:
            try:
                with atomic_dir(path) as tmp, disk_errors(tmp):
                    (tmp / "backend").mkdir()
                    self.backend.save_state(tmp / "backend", *self._rank_states(rank_states))
                    faults.in_save(step, bool(stop is not None and stop.requested))
                    atomic_write_json(tmp / checkpoints.STATE_FILE, self._trainer_state(step))
            except OSError as e:
                error = e
        failed = comm.all_reduce([1.0 if error else 0.0])[0] > 0
        if failed:
            return self._save_failed(step, path, error or OSError(f"rank 0 could not write {path}"))
        if rank == 0:
            checkpoints.prune(self.run_dir, keep=int(self.cfg.train.keep_checkpoints))
        return True

    def _rank_states(self, rank_states: list[Any]) -> tuple[Any, ...]:
        # a backend that keeps per-rank state (torch's RNG) takes every rank's; MLX draws its
        # dropout keys from (seed, rank, micro-step) and needs none
        return (rank_states,) if hasattr(self.backend, "rank_state") else ()

    def _save_failed(self, step: int, path: Path, e: OSError) -> bool:
        """A checkpoint not written: say so; stop (UserError) or go on, per train.on_save_error."""
        prev = checkpoints.latest_checkpoint(self.run_dir)
        kept = f"the previous checkpoint {prev.name} is intact" if prev else "no earlier checkpoint exists"
        msg = (f"checkpoint at step {step} not saved ({e.strerror or e}); {kept}; free space or fix "
               f"permissions on {path.parent}")
        if self.cfg.train.on_save_error == "continue":
            log.warning("%s; training goes on (train.on_save_error=continue)", msg)
            self.runlog.event({"step": step, "trigger": "save_error", "action": "continue",
                               "before": None, "after": None, "error": str(e)})
            return False
        raise UserError(f"{msg}, then continue with train.resume=true hydra.run.dir={self.run_dir} "
                        "(or set train.on_save_error=continue)") from None

    def _adapter_failed(self, step: int, e: OSError) -> UserError:
        """The final adapter not written: keep the trained state as a checkpoint where one can
        be written (a resume then writes the adapter without training again), else say plainly
        which steps are lost."""
        d = self.run_dir
        why = f"adapter not saved to {d / 'adapter'} ({e.strerror or e})"
        fix = f"free space or fix permissions on {d}"
        if self.comm.world_size == 1:
            failed = self._write_checkpoint(step, None)
            if failed is None:
                checkpoints.prune(d, keep=int(self.cfg.train.keep_checkpoints))
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

    def runlog_failed(self, e: RunLogWriteError) -> UserError:
        """metrics.jsonl could not take a line: stop as a failed checkpoint does."""
        d = self.run_dir
        at = f" at step {e.step}" if e.step is not None else ""
        prev = checkpoints.latest_checkpoint(d)
        if prev is not None:
            return UserError(f"{e.filename} not written{at} ({e.strerror}); the checkpoint {prev.name} is intact; free "
                             f"space or fix permissions on {d}, then continue with train.resume=true hydra.run.dir={d}")
        return UserError(f"{e.filename} not written{at} ({e.strerror}); no checkpoint exists (train.save_every=0), so "
                         f"the steps so far are lost; free space or fix permissions on {d} and run again")

    def maybe_resume(self) -> int:
        if not self.cfg.train.resume:
            return 0
        ckpts = checkpoints.list_checkpoints(self.run_dir)
        if not ckpts:
            raise UserError(f"train.resume=true but {self.run_dir}/checkpoints holds no checkpoint; "
                            "point hydra.run.dir at the run to continue, or set train.save_every")
        eff = self.cfg.train.batch_size * self.cfg.train.grad_accum
        mine = self._identity()
        for ckpt in reversed(ckpts):  # newest first; a damaged one gives way to the one before
            try:
                state = checkpoints.read_state(ckpt)
                int(state["step"]), int(state["tokens"]), int(state["samples"]), int(state["effective_batch"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                print(f"checkpoint {ckpt.name} is damaged (trainer state: {e}); trying the one before", file=sys.stderr)
                continue
            for key in ("backend", "model_path", "method", "lora_rank", "lora_keys", "seed", "data"):
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
            try:
                self.backend.load_state(ckpt / "backend")
            except Exception as e:  # a truncated or missing tensor file, a wrong shape
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                print(f"checkpoint {ckpt.name} is damaged ({type(e).__name__}: {first[:200]}); trying the one before",
                      file=sys.stderr)
                continue
            self.governor.restore(state)
            self.tokens, self.samples = state["tokens"], state["samples"]
            if self.comm.rank != 0:
                pass
            elif ckpt != ckpts[-1]:
                print(f"resumed from {ckpt} (the previous good checkpoint) at step {state['step']}", file=sys.stderr)
            else:
                print(f"resumed from {ckpt} at step {state['step']}", file=sys.stderr)
            return int(state["step"])
        raise UserError(f"every checkpoint in {self.run_dir}/checkpoints is damaged; start a new run dir "
                        "(or remove train.resume=true)")

    # -- one step ----------------------------------------------------------------------------
    def _train_step(self, step: int) -> tuple[float, int, int, float | None]:
        """Run optimizer step ``step`` (1-based); redo it with a smaller micro-batch on OOM."""
        faults.abort_at(step, self.governor.micro)
        batch = self.data.train_batch(step - 1)  # the whole step's samples, every rank's
        mine = rank_slice(batch, self.comm.rank, self.comm.world_size)
        self._step_max_len = int(mine.input_ids.shape[1])  # the widest micro-batch, padded
        self.governor.step_longest = int(batch.lengths.max())  # the floor of tokens per packed micro-batch
        scale = 1.0 / batch.label_tokens  # of the whole step: the sum over ranks is one process's
        def hook(phase: str) -> None:
            self.acct.sample(step, phase)

        world, rank = self.comm.world_size, self.comm.rank
        while True:
            loss_sum, oom = 0.0, None
            try:
                for micro in self._micro_batches(mine):
                    loss_sum += self.backend.forward_backward(micro, scale, hook)
            except OutOfMemory as e:
                oom = e
            oom_ranks = [rank] if oom is not None else []
            if world > 1:
                # one agreement per step, before any gradient is communicated: which ranks ran
                # out of memory, whether any was asked to stop, and the step's loss
                flags = [0.0] * world
                flags[rank] = 1.0 if oom is not None else 0.0
                asked = self._stop is not None and self._stop.requested is not None
                agreed = self.comm.all_reduce(flags + [1.0 if asked else 0.0, loss_sum])
                oom_ranks = [r for r in range(world) if agreed[r] > 0]
                self._stop_agreed = agreed[world] > 0
                loss_sum = agreed[world + 1]
            if not oom_ranks:
                break
            self.backend.zero_grad()
            self.backend.release_cache()
            # lowers the micro-batch (the same on every rank) or raises UserError
            self.governor.on_oom(step, oom or OutOfMemory(f"out of memory on rank(s) {oom_ranks}"),
                                 ranks=oom_ranks if world > 1 else None,
                                 row_tokens=int(batch.input_ids.shape[1]))  # every rank's batch: one decision
        grad_norm = self.backend.optimizer_step(self._lr(step))
        return loss_sum / batch.label_tokens, batch.tokens, len(batch.lengths), grad_norm

    def _micro_batches(self, mine: Batch) -> list[Batch]:
        """This rank's share of the step, in the governor's current micro-batches: packed to
        ``tokens_per_micro`` tokens (train.packing), else ``micro_batch`` samples each."""
        tokens = self.governor.state.tokens_per_micro
        if not tokens:
            return mine.split(self.governor.micro)
        parts = pack(mine, tokens)
        self._step_max_len = max(p.tokens for p in parts)  # the widest row: what calibration plans
        return parts

    def evaluate(self) -> float | None:
        if self.cfg.train.eval_every <= 0:
            return None
        batches = self.data.val_batches(self.governor.micro, self.cfg.train.eval_batches)
        if not batches:
            return None
        total = sum(self.backend.eval_loss(b) for b in batches)
        return total / sum(b.label_tokens for b in batches)

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        self.tokens = self.samples = self.tokens_this_run = 0
        start = self.maybe_resume()
        # every check has passed: from here on the run writes its results into the run dir
        if self.lock is not None:
            self.lock.begun = True
            gone = checkpoints.remove_dead_temporaries(self.run_dir)  # a killed writer's, this run holding the lock
            if gone:
                print(f"removed {len(gone)} temporary file(s) a killed run left in {self.run_dir}: "
                      f"{', '.join(p.name for p in gone)}", file=sys.stderr)
        if start == 0 and self.comm.rank == 0 and cfg.train.get("overwrite"):
            checkpoints.clear_results(self.run_dir)  # the earlier run's results (claim refused them otherwise)
        # a fresh run starts metrics.jsonl empty; a resumed one drops the lines after its
        # checkpoint (the abandoned future). Either way the governor's decisions made before
        # loading follow, then one line per step.
        self.runlog.begin(start, progress=cfg.train.progress, total=cfg.train.steps)
        losses: list[float] = []
        val_loss = None
        step_seconds = 0.0
        t_run = time.perf_counter()
        stop = self._stop = _StopOnSignal()
        # read once: the config is an OmegaConf tree, whose every read resolves a node
        steps, eval_every, save_every = int(cfg.train.steps), int(cfg.train.eval_every), int(cfg.train.save_every or 0)
        for step in range(start + 1, steps + 1):
            # several ranks stop together, at the step they agreed on (_train_step's all-reduce)
            if (stop.requested if self.comm.world_size == 1 else self._stop_agreed):
                if not self.save_checkpoint(step - 1, stop):
                    stop.close()
                    raise SystemExit(stop.exit_code)
                if self.comm.rank == 0:
                    print(f"stopped by {stop.requested or 'a signal to another rank'} after step {step - 1}; "
                          f"checkpoint saved: continue with train.resume=true hydra.run.dir={self.run_dir}",
                          file=sys.stderr)
                stop.close()
                raise SystemExit(stop.exit_code)
            self.acct.start_step(step)
            t0 = time.perf_counter()
            loss, ntok, nsamp, gnorm = self._train_step(step)
            dt = time.perf_counter() - t0
            step_seconds += dt
            self.tokens += ntok
            self.tokens_this_run += ntok
            self.samples += nsamp
            losses.append(loss)
            sample = self.acct.sample(step, "optimizer")
            if step == 1 and sample is not None:
                self._calibrate(sample)
            self.governor.after_step(step, self._agreed_sample(step, sample))
            rec = {"step": step, "loss": loss, "lr": self._lr(step), "grad_norm": gnorm, "tokens": ntok,
                   "samples": nsamp, "micro_batch": self.governor.micro, "step_seconds": dt,
                   "tokens_per_sec": ntok / dt if dt > 0 else None}
            if eval_every > 0 and (step % eval_every == 0 or step == steps):
                val_loss = self.evaluate()
                rec["val_loss"] = val_loss
                self.acct.between_steps()  # its memory belongs in the next peak read
            rec.update(self.acct.metrics_fields() if sample is not None else {})
            self.runlog.step(rec, self.acct.progress_text)
            if save_every and step % save_every == 0 and step < steps:
                self.save_checkpoint(step, stop)
                self.acct.between_steps()
            faults.pause_after(step)
            faults.leak()
        stop.close()
        self.runlog.close_progress()
        wall = time.perf_counter() - t_run
        rank = self.comm.rank
        try:
            if rank == 0:
                with atomic_dir(self.run_dir / "adapter") as tmp, disk_errors(tmp):
                    faults.in_write("adapter")
                    self.backend.save_adapter(tmp)
            elif getattr(self.backend, "sharded", False):
                self.backend.save_adapter(None)  # gathers the shards for rank 0 (a collective)
        except OSError as e:
            raise self._adapter_failed(steps, e) from None
        if cfg.train.save_every:
            self.save_checkpoint(cfg.train.steps)
        summary = self._summary(losses, val_loss, wall, step_seconds)
        if self.comm.world_size > 1:
            self._gather_ranks(summary)
            if rank != 0:  # rank 0 writes and prints for every rank
                self.comm.barrier()  # leave the group together: no rank tears it down mid-traffic
                self.comm.close()
                return summary
        try:
            faults.in_write("summary")
            atomic_write_json(self.run_dir / "summary.json", summary)
        except OSError as e:
            raise UserError(f"summary.json not written to {self.run_dir} ({e.strerror or e}); the adapter in "
                            f"{self.run_dir / 'adapter'} is complete and metrics.jsonl holds every step: only the "
                            "summary and memory.png are missing") from None
        self.runlog.summary(summary)
        try:
            faults.in_write("memory.png")
            self.acct.write_plot(self.run_dir / "memory.png", budget=self.governor.budget_bytes)
        except Exception as e:  # a plot must never cost the run its results
            log.warning("memory.png not written: %s", e)
        print(self.acct.table(), file=sys.stderr)
        if self.comm.world_size > 1:
            from finetune.accounting.ranks import render_rank_table

            print(render_rank_table(summary["memory"]["per_rank"]), file=sys.stderr)
        for ex in summary["memory"].get("explanations", []):
            print(f"[memory] {ex['text']}", file=sys.stderr)
        self.runlog.close()
        self.comm.barrier()
        self.comm.close()
        print(f"run dir: {self.run_dir}", file=sys.stderr)
        return summary

    def _agreed_sample(self, step: int, sample: dict[str, Any] | None) -> dict[str, Any] | None:
        """What the governor decides on: this rank's sample in one process; under several, every
        rank's merged (the largest of each figure, fresh only when every rank's reading is), so
        every rank takes the same decision at the same step. A step the schedule does not sample
        (the same steps on every rank) needs no gather."""
        if self.comm.world_size == 1 or not self.acct.will_sample(step):
            return sample
        keys = ("step_peak_reserved", "step_peak_allocated", "peak_reserved", "peak_allocated", "allocated",
                "reserved", "swap_used", "psi_some_avg10", "inactive_split")
        mine = None if sample is None else {**{k: sample.get(k) for k in keys},
                                            "system_fresh": sample.get("system_fresh", True)}
        got = [g for g in self.comm.all_gather_object(mine) if g is not None]
        if not got:
            return None
        merged: dict[str, Any] = {"system_fresh": all(g["system_fresh"] for g in got)}
        for k in keys:
            vals = [g[k] for g in got if g.get(k) is not None]
            merged[k] = max(vals) if vals else None
        return merged

    def _gather_ranks(self, summary: dict[str, Any]) -> None:
        """Every rank's memory to rank 0: summary["ranks"], summary["memory"]["per_rank"] (rows
        and Overall) and explanations that name their rank."""
        from finetune.accounting import ranks

        mine = ranks.rank_report(self.comm.rank, self.info.device, summary["memory"], self.acct.samples)
        reports = self.comm.all_gather_object(mine)
        merged = ranks.merge(reports)
        summary["world_size"] = self.comm.world_size
        summary["strategy"] = str(self.cfg.backend.strategy)
        summary["ranks"] = merged["ranks"]
        summary["memory"]["per_rank"] = merged
        summary["memory"]["explanations"] = ranks.explanations(reports)

    def _calibrate(self, sample: dict[str, Any]) -> None:
        """After the first optimizer step: compare the plan to that step's sample (whose
        census the accountant already took; the summary keeps it as census_first_optimizer)."""
        try:
            from finetune import planner

            # the plan at the length step 1 really had, so the error measures the model, not
            # the gap between train.seq_len and the data
            self.plan = planner.plan(self.cfg, seq_len=self._step_max_len, state=self.governor.state)
            self.plan_error = planner.plan_error(self.plan, sample.get("census") or {}, sample)
        except Exception as e:  # calibration is a report, never a reason to stop training
            log.warning("plan calibration skipped: %s", e)
            self.plan, self.plan_error = None, None

    def _summary(self, losses: list[float], val_loss: float | None, wall: float,
                 step_seconds: float) -> dict[str, Any]:
        tail = losses[-min(10, len(losses)):] if losses else []
        return {
            "backend": self.backend_name,
            "device": self.info.device,
            "model": self.cfg.model.name,
            "model_path": str(self.info.model_path),
            "method": self.cfg.method.name,
            "optim": self.cfg.optim.name,
            "precision": self.cfg.precision.name,
            "dtype": self.info.dtype,
            "params_total": self.info.params_total,
            "params_trainable": self.info.params_trainable,
            "steps": self.cfg.train.steps,
            "steps_this_run": len(losses),
            "samples": self.samples,
            "tokens": self.tokens,
            # this process's steps only: a resumed run's earlier tokens took no time here
            "tokens_per_sec": self.tokens_this_run / step_seconds if step_seconds > 0 and losses else None,
            "wall_s": wall,
            "first_loss": losses[0] if losses else None,
            "final_train_loss": sum(tail) / len(tail) if tail else None,
            "last_step_loss": losses[-1] if losses else None,
            "final_val_loss": val_loss,
            "effective_batch": self.cfg.train.batch_size * self.cfg.train.grad_accum,
            "micro_batch": self.governor.micro,
            "data": self.data_stats,
            "memory": self.acct.summary(step_seconds),
            "plan_error": getattr(self, "plan_error", None),
            "adaptations": self.events,
            "budget_bytes": self.governor.budget_bytes,
        }


class _StopOnSignal:
    """SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C): finish the step in flight,
    checkpoint, exit 128 + the signal's number (143, 130), as a shell reports a signal.

    A second signal (either) exits at once: KeyboardInterrupt (130) for SIGINT, SystemExit
    (143) for SIGTERM, raised wherever the process is, so a checkpoint being written is
    abandoned under its temporary name and the last good one stays as it was. A signal the
    process was started ignoring (SIGINT in a background job) stays ignored.
    """

    def __init__(self) -> None:
        import signal
        import threading

        self.requested: str | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handler)

    @property
    def exit_code(self) -> int:
        import signal

        return 128 + int(signal.Signals[self.requested or "SIGTERM"])

    def close(self) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def _handler(self, signum: int, frame: Any) -> None:
        import signal

        name = signal.Signals(signum).name
        if self.requested is not None:
            print(f"second {name}: exiting now; the last good checkpoint is kept", file=sys.stderr)
            self.close()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.requested = name


def train(cfg: Any) -> dict[str, Any]:
    """Run a training job for a composed config; return the summary (also in summary.json)."""
    trainer = Trainer(cfg)
    try:
        try:
            trainer.connect()  # the backend, and the launcher's ranks if several were started
            trainer.claim()  # the lock and the checks that need no model
            with trainer.runlog:  # closed on every way out: finished, failed, stopped by a signal
                trainer.setup()
                return trainer.train()
        except RunLogWriteError as e:
            raise trainer.runlog_failed(e) from None
    except UserError:
        if trainer.comm.rank == 0:
            _remove_if_no_result(trainer)
        raise
    finally:
        if trainer.lock is not None:  # a refused command leaves the run dir as it was: no new lock file
            trainer.lock.release(remove=not trainer.lock.begun)


def data_identity(data: Any) -> dict[str, Any]:
    """The data a run trains on, as a resume compares it: its kind, what names it, the
    settings that pick its samples and, for a file, its size and modification time (an edited
    file is other data; its content hash would cost a full read on every resume)."""
    ident: dict[str, Any] = {"name": str(data.name), "max_samples": data.get("max_samples"),
                             "val_fraction": float(data.get("val_fraction") or 0.0)}
    if data.name == "synthetic":
        ident["num_samples"] = int(data.num_samples)
    elif data.name == "jsonl" and data.get("path"):
        path = Path(str(data.path)).expanduser()
        ident["path"] = str(path.resolve())
        try:
            st = path.stat()
            ident["size"], ident["mtime_ns"] = st.st_size, st.st_mtime_ns
        except OSError:
            ident["size"] = ident["mtime_ns"] = None
    elif data.name == "hf":
        ident.update(hf_name=data.get("hf_name"), hf_config=data.get("hf_config"), hf_split=data.get("hf_split"))
    return ident


def _differs(key: str, saved: Any, mine: Any) -> str:
    """``key=saved, this run has mine``, narrowed to the fields that differ for a dict."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        keys = [k for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]
        return "; ".join(f"{key}.{k}={saved.get(k)}, this run has {mine.get(k)}" for k in keys)
    return f"{key}={saved}, this run has {mine}"


def _remove_if_no_result(trainer: Trainer) -> None:
    """After a bad input: remove the run dir this process created when it holds no result
    (summary.json, adapter/, a checkpoint, a non-empty metrics.jsonl: a run that trained or
    adapted before it stopped keeps its record), so nothing half-made looks like a run."""
    d = trainer.run_dir
    if not trainer.created_run_dir or not d.is_dir():
        return
    if checkpoints.results_in(d):
        return
    m = d / "metrics.jsonl"
    if m.is_file() and m.stat().st_size > 0:  # steps ran or the governor acted: the record of why it stopped
        return
    shutil.rmtree(d, ignore_errors=True)
