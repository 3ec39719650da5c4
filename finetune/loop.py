"""The one training loop. Both backends run through it; a backend contributes numbers only.

Per optimizer step: take the step's effective batch (fixed by seed and step), split it into
micro-batches of the governor's current size, accumulate gradients with the loss scaled by
1 / (label tokens of the whole step), step the optimizer, sample memory, log one metrics line.
Because the scale is global to the step, the split does not change the math: an adapted run
trains the same samples in the same order to the same losses.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from finetune import checkpoints
from finetune.backends import OutOfMemory, get_backend, resolve_backend_name
from finetune.config import UserError, validate
from finetune.io import atomic_dir, atomic_write_json
from finetune.runlog import RunLog

log = logging.getLogger("finetune")


def lr_at(step: int, cfg: Any) -> float:
    """Learning rate for 1-based optimizer ``step``: linear warmup, then the schedule."""
    base, total, warm = cfg.optim.lr, cfg.train.steps, cfg.train.warmup_steps
    if warm and step <= warm:
        return base * step / warm
    if cfg.train.schedule == "constant" or total <= warm:
        return base
    frac = (step - warm) / max(1, total - warm)
    if cfg.train.schedule == "linear":
        return base * (1.0 - frac)
    return base * 0.5 * (1.0 + math.cos(math.pi * frac))  # cosine to 0 at the last step


class Trainer:
    """Owns one run: setup, the step loop, evaluation, checkpoints and the run directory."""

    def __init__(self, cfg: Any):
        validate(cfg)
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events: list[dict[str, Any]] = []
        # metrics.jsonl, the progress bar and the chosen loggers; a logger's missing package
        # stops the run here, before anything is downloaded or loaded
        chosen = cfg.get("logger")
        self.runlog = RunLog(self.run_dir, chosen, OmegaConf.to_container(cfg, resolve=True) if chosen else None)

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from finetune import data as data_mod
        from finetune.accounting import Accountant
        from finetune.governor import Governor
        from finetune.model_source import resolve_model_dir

        cfg = self.cfg
        self.backend_name, reason = resolve_backend_name(cfg.backend.name)
        print(reason, file=sys.stderr)
        self.governor = Governor(cfg, self.backend_name, self._event)
        # Before any download: stop if even the weights and state cannot fit the budget.
        self.governor.before_load(seq_len=8, only_check=True)
        self.model_dir = resolve_model_dir(cfg.model, seed=0)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.data, self.data_stats = data_mod.build(cfg, self.tokenizer)
        self.backend = get_backend(self.backend_name)
        # may lower the micro-batch / turn on checkpointing; plans for the longest sample
        self.governor.before_load(seq_len=self.data_stats["max_padded_tokens"])
        # Peaks are per run: an earlier run in this process (a test, a benchmark) must not
        # leak its peak into ours; the load itself stays inside the peak. Objects an earlier
        # run left in reference cycles are collected now, not in the middle of this one.
        gc.collect()
        self.backend.reset_peak()
        self.info = self.backend.setup(cfg, self.model_dir)
        if self.governor.grad_checkpointing and not cfg.train.grad_checkpointing:
            self.backend.set_grad_checkpointing(True)
        self.governor.attach(self.backend)
        self.acct = Accountant(self.backend, sample_every=cfg.memory.sample_every)
        self.acct.run_facts = {"adaptations": self.events, "adapt": bool(cfg.memory.adapt),
                               "budget_set": cfg.memory.budget is not None}
        self.acct.sample(0, "load")

    def _event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        print(f"[governor] step {ev['step']}: {ev['trigger']} -> {ev['action']} "
              f"({json.dumps(ev['before'])} -> {json.dumps(ev['after'])})", file=sys.stderr)
        self.runlog.event(ev)

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> None:
        with atomic_dir(checkpoints.checkpoint_path(self.run_dir, step)) as tmp:
            (tmp / "backend").mkdir()
            self.backend.save_state(tmp / "backend")
            atomic_write_json(tmp / "trainer_state.json", {
                "step": step, "micro_batch": self.governor.micro,
                "grad_checkpointing": self.governor.grad_checkpointing,
                "effective_batch": self.cfg.train.batch_size * self.cfg.train.grad_accum,
                "tokens": self.tokens, "samples": self.samples})
        checkpoints.prune(self.run_dir, keep=checkpoints.KEEP)

    def maybe_resume(self) -> int:
        if not self.cfg.train.resume:
            return 0
        latest = checkpoints.latest_state(self.run_dir)
        if latest is None:
            raise UserError(f"train.resume=true but {self.run_dir}/checkpoints holds no checkpoint; "
                            "point hydra.run.dir at the run to continue, or set train.save_every")
        ckpt, state = latest
        eff = self.cfg.train.batch_size * self.cfg.train.grad_accum
        if state["effective_batch"] != eff:
            raise UserError(f"checkpoint was trained with effective batch {state['effective_batch']}, this run has {eff}; "
                            "keep train.batch_size * train.grad_accum equal to resume")
        self.backend.load_state(ckpt / "backend")
        self.governor.restore(state)
        self.tokens, self.samples = state["tokens"], state["samples"]
        print(f"resumed from {ckpt} at step {state['step']}", file=sys.stderr)
        return int(state["step"])

    # -- one step ----------------------------------------------------------------------------
    def _train_step(self, step: int) -> tuple[float, int, int, float | None]:
        """Run optimizer step ``step`` (1-based); redo it with a smaller micro-batch on OOM."""
        _fault_injection(step, self.governor.micro)
        batch = self.data.train_batch(step - 1)
        self._step_max_len = int(batch.input_ids.shape[1])  # the widest micro-batch, padded
        scale = 1.0 / batch.label_tokens
        def hook(phase: str) -> None:
            self.acct.sample(step, phase)

        while True:
            try:
                loss_sum = 0.0
                for micro in batch.split(self.governor.micro):
                    loss_sum += self.backend.forward_backward(micro, scale, hook)
                break
            except OutOfMemory as e:
                self.backend.zero_grad()
                self.backend.release_cache()
                self.governor.on_oom(step, e)  # lowers the micro-batch or raises UserError
        grad_norm = self.backend.optimizer_step(lr_at(step, self.cfg))
        return loss_sum / batch.label_tokens, batch.tokens, len(batch.lengths), grad_norm

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
        # a fresh run starts metrics.jsonl empty; a resumed one drops the lines after its
        # checkpoint (the abandoned future). Either way the governor's decisions made before
        # loading follow, then one line per step.
        self.runlog.begin(start, progress=cfg.train.progress, total=cfg.train.steps)
        losses: list[float] = []
        val_loss = None
        step_seconds = 0.0
        t_run = time.perf_counter()
        stop = _StopOnSignal()
        for step in range(start + 1, cfg.train.steps + 1):
            if stop.requested:
                self.save_checkpoint(step - 1)
                print(f"stopped by {stop.requested} after step {step - 1}; checkpoint saved: continue with "
                      f"train.resume=true hydra.run.dir={self.run_dir}", file=sys.stderr)
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
            self.governor.after_step(step, sample)
            rec = {"step": step, "loss": loss, "lr": lr_at(step, cfg), "grad_norm": gnorm, "tokens": ntok,
                   "samples": nsamp, "micro_batch": self.governor.micro, "step_seconds": dt,
                   "tokens_per_sec": ntok / dt if dt > 0 else None}
            if cfg.train.eval_every > 0 and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                val_loss = self.evaluate()
                rec["val_loss"] = val_loss
            rec.update(self.acct.metrics_fields() if sample is not None else {})
            self.runlog.step(rec, self.acct.progress_text)
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < cfg.train.steps:
                self.save_checkpoint(step)
        stop.close()
        self.runlog.close_progress()
        wall = time.perf_counter() - t_run
        with atomic_dir(self.run_dir / "adapter") as tmp:
            self.backend.save_adapter(tmp)
        if cfg.train.save_every:
            self.save_checkpoint(cfg.train.steps)
        summary = self._summary(losses, val_loss, wall, step_seconds)
        atomic_write_json(self.run_dir / "summary.json", summary)
        self.runlog.summary(summary)
        try:
            self.acct.write_plot(self.run_dir / "memory.png", budget=self.governor.budget_bytes)
        except Exception as e:  # a plot must never cost the run its results
            log.warning("memory.png not written: %s", e)
        print(self.acct.table(), file=sys.stderr)
        for ex in summary["memory"].get("explanations", []):
            print(f"[memory] {ex['text']}", file=sys.stderr)
        self.runlog.close()
        print(f"run dir: {self.run_dir}", file=sys.stderr)
        return summary

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


def _fault_injection(step: int, micro: int) -> None:
    """Test-only stand-in for an allocation failure that kills the process (MLX on Metal
    aborts; nothing can catch it): FINETUNE_FAULT_ABORT=STEP:MICRO aborts at optimizer step
    STEP while the micro-batch is above MICRO. Used to test memory.supervise on any machine."""
    import os

    spec = os.environ.get("FINETUNE_FAULT_ABORT")
    if spec:
        at, above = (int(x) for x in spec.split(":"))
        if step >= at and micro > above:
            print(f"fault injection: abort at step {step} (micro-batch {micro} > {above})", file=sys.stderr)
            sys.stderr.flush()
            os.abort()


class _StopOnSignal:
    """SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C): finish the step in flight,
    checkpoint, exit 128 + the signal's number (143, 130), as a shell reports a signal.

    A second Ctrl-C interrupts at once (the previous handler is back after the first). A
    signal the process was started ignoring (SIGINT in a background job) stays ignored.
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

        self.requested = signal.Signals(signum).name
        if signum == signal.SIGINT and signum in self._previous:
            previous = self._previous.pop(signum)
            signal.signal(signum, signal.default_int_handler if previous is None else previous)


def train(cfg: Any) -> dict[str, Any]:
    """Run a training job for a composed config; return the summary (also in summary.json)."""
    trainer = Trainer(cfg)
    with trainer.runlog:  # closed on every way out: finished, failed, stopped by a signal
        trainer.setup()
        return trainer.train()
