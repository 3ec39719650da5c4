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
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn, cast


from finetune.run import files as checkpoints
from finetune.backends import OutOfMemory, resolve_backend_name
from finetune.backends.base import Batch, Comm, PairBackend, pack, pack_figures
from finetune.backends.runtimes import get_backend
from finetune.run.directory import several_ranks
from finetune.run.checkpoint import Checkpointer, data_identity, runlog_failed  # noqa: F401 (data_identity: its old home)
from finetune.data.batches import rank_slice
from finetune.data.pairs import PairSource, UnpairedSource, pair_counts
from finetune.objectives import PairSums
from finetune.errors import UserError
from finetune.run.faults import Faults, StopOnSignal
from finetune.io import atomic_dir, atomic_write_json, disk_errors
from finetune.redact import redact_tree
from finetune.run.log import RankRunLog, RunLog, RunLogWriteError
from finetune import data as data_mod, evaluate, planner, prompting
from finetune.accounting import Accountant, ranks
from finetune.run.governor import Governor
from finetune.model.source import check_weights, resolve_model_dir
from finetune.planner.setup import locate_model
from finetune.records import Plan, Sample
from finetune.spec import RunSpec, World
from finetune.units import fmt_bytes

log = logging.getLogger("finetune")


def lr_at(step: int, spec: RunSpec) -> float:
    """Learning rate for 1-based optimizer ``step``: linear warmup, then the schedule."""
    return schedule(spec)(step)


def schedule(spec: RunSpec) -> Callable[[int], float]:
    """``lr_at`` as one function of the step, the spec's four numbers bound once."""
    return functools.partial(_lr, base=spec.optim.lr, total=spec.train.steps,
                             warm=spec.train.warmup_steps, kind=spec.train.schedule)


def _lr(step: int, base: float, total: int, warm: int, kind: str) -> float:
    if warm and step <= warm:
        return base * step / warm
    if kind == "constant" or total <= warm:
        return base
    frac = (step - warm) / max(1, total - warm)
    if kind == "linear":
        return base * (1.0 - frac)
    return base * 0.5 * (1.0 + math.cos(math.pi * frac))  # cosine to 0 at the last step


def done_line(summary: Mapping[str, Any]) -> str:
    """The run's last console line, what a newcomer looks for: did it learn, how fast, how big.
    ``done: 200 steps | train loss 6.40 -> 4.28 | val loss 4.16 | 3,100 tokens/s | peak 7.05 MiB
    allocated, 26.1 MiB reserved`` (the train loss: the first step's, then the mean of the
    last 10; the peak: the device's where an allocator is measured, else the process's RSS)."""
    def loss(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    parts = [f"done: {summary.get('steps_this_run', 0)} steps"
             + (f" (to step {summary['steps']})" if summary.get("steps") != summary.get("steps_this_run") else ""),
             f"train loss {loss(summary.get('first_loss'))} -> {loss(summary.get('final_train_loss'))}",
             f"val loss {loss(summary.get('final_val_loss'))}"]
    tps = summary.get("tokens_per_sec")
    parts.append(f"{tps:,.0f} tokens/s" if tps else "tokens/s n/a")
    peaks = (summary.get("memory") or {}).get("peaks") or {}
    if peaks.get("allocated_bytes") is not None:
        resv = peaks.get("reserved_bytes")
        parts.append(f"peak {fmt_bytes(peaks['allocated_bytes'])} allocated"
                     + (f", {fmt_bytes(resv)} reserved" if resv is not None else ""))
    else:
        parts.append(f"peak {fmt_bytes(peaks.get('rss_bytes'))} RSS (no allocator on this device)")
    return " | ".join(parts)


class Trainer:
    """Owns one run: its collaborators (setup), the step loop and the run's end. Checkpoints go
    through a Checkpointer (finetune/run/checkpoint.py), the run dir's files through
    finetune/run/files.py, signals and test-only faults through finetune/run/faults.py."""

    def __init__(self, spec: RunSpec):
        self.spec = spec  # resolved and checked (finetune.resolver) before anything is written; joined in connect()
        self.run_dir = self.spec.paths.run_dir
        self.created_run_dir = checkpoints.make_run_dir(self.run_dir)
        self.events: list[dict[str, Any]] = []
        # metrics.jsonl, the progress bar and the chosen loggers; a logger's missing package
        # stops the run here, before anything is downloaded or loaded. Their copy of the
        # config has every token and key masked (finetune/redact.py).
        chosen = self.spec.loggers
        self.runlog = RunLog(self.run_dir, chosen, redact_tree(self.spec.record) if chosen else None)
        self.comm = Comm()  # one process until connect() joins a launcher's ranks
        self.lock: Any = None  # the run dir's lock (finetune.io.DirLock), taken by claim()
        self.faults = Faults.from_env()  # the test-only faults, read once for the whole run
        self.stop: StopOnSignal | None = None  # installed when the steps begin
        self._stop_agreed = False  # under several ranks: a signal reached some rank (agreed per step)
        self._lr = schedule(self.spec)  # optimizer step -> learning rate

    # -- ranks -------------------------------------------------------------------------------
    def connect(self) -> None:
        """Pick the backend and join the launcher's process group, if one started us (torchrun,
        ``accelerate launch``, SLURM, ``mlx.launch``). Under several ranks rank 0's run dir is
        the run's (Hydra names each rank's by its own clock), rank 0 alone writes the run log,
        and the planner plans per rank for ``backend.num_devices`` = the world size."""
        self.backend_name, self._backend_reason = resolve_backend_name(self.spec.backend.name)
        self.backend = get_backend(self.backend_name)
        self.comm = self.backend.connect(self.spec)
        if self.comm.world_size <= 1:
            return
        shared = Path(self.comm.all_gather_object(str(self.run_dir))[0])
        if shared != self.run_dir:
            checkpoints.drop_rank_run_dir(self.run_dir, created=self.created_run_dir)
            self.run_dir, self.created_run_dir = shared, False
        # the planner plans per rank for the world size (a new spec: nothing written into the config)
        self.spec = self.spec.joined(World(rank=self.comm.rank, world_size=self.comm.world_size), run_dir=shared)
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
        t = self.spec.train
        refused: UserError | None = None
        try:
            if self.comm.rank == 0:
                self.lock = checkpoints.lock_run_dir(self.run_dir)
            checkpoints.check_claim(self.run_dir, resume=bool(t.resume), overwrite=t.overwrite,
                                    steps=t.steps)
        except UserError as e:
            refused = e
        if self.comm.agree(refused is not None).raised[0] and refused is None:
            raise UserError("another rank refused the run dir (rank 0 says why)")
        if refused is not None:
            raise refused

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        """Plan against the budget, load the tokenizer, the data and the model, and build the
        run's governor, accountant and checkpointer."""
        if not hasattr(self, "backend"):
            self.connect()
        if self.comm.rank == 0:
            print(self._backend_reason + (f"; {self.comm.world_size} ranks ({self.spec.backend.strategy})"
                                          if self.comm.world_size > 1 else ""), file=sys.stderr)
        obj = self.spec.objective
        if obj.preference and not hasattr(self.backend, "forward_backward_unpaired" if obj.unpaired
                                          else "forward_backward_pairs"):
            raise UserError(f"objective={obj.name} runs on backend=cuda and backend=mlx for now; use one of them "
                            "(cuda runs on the CPU too) or objective=sft")
        self.governor = Governor(self.spec, self.backend_name, self._event)
        # Before any download: stop if even the weights and state cannot fit the budget.
        self.governor.before_load(seq_len=8, only_check=True)
        self.model_dir = resolve_model_dir(self.spec.model, seed=0)
        check_weights(self.model_dir, self.spec.model)
        # the run's one model handle, at its directory: what the governor, the runtime, the
        # checkpointer and calibration read from here on (described again only where the
        # directory's config.json is not the one described: a hub checkpoint downloaded now)
        handle = locate_model(self.spec.model_handle, self.spec.model, self.model_dir)
        self.spec = self.governor.spec = replace(self.spec, model_handle=handle)
        for note in handle.desc.notes:  # a family priced approximately, ...
            log.warning("plan: %s", note)
        self.tokenizer = self._load_tokenizer()
        self.data, self.data_stats = data_mod.build(self.spec, self.tokenizer)
        if self.comm.rank == 0:  # the data really used, before anything trains on it
            print(data_mod.describe(self.spec, self.data_stats), file=sys.stderr)
        # may lower the micro-batch / turn on checkpointing; plans for the longest sample (packed:
        # the widest packed micro-batch of the run's steps)
        packed = self.spec.train.packing
        self.governor.before_load(seq_len=self.data_stats.get("max_micro_tokens") or self.data_stats["max_padded_tokens"],
                                  head_fraction=self.data_stats.get("head_fraction"),
                                  pair_span=self.data_stats.get("pair_span"),
                                  row_targets=self.data_stats.get("max_micro_targets"),
                                  longest=self.data_stats["max_tokens"] if packed else None,
                                  pairs=self.data_stats.get("pairs"),  # a preference run's (finetune/data/pairs.py)
                                  pair_positions=self.data_stats.get("pair_positions"))
        # Peaks are per run: an earlier run in this process (a test, a benchmark) must not
        # leak its peak into ours; the load itself stays inside the peak. Objects an earlier
        # run left in reference cycles are collected now, not in the middle of this one.
        gc.collect()
        self.backend.reset_peak()
        # the backend is built as the governor's state says (checkpointing it turned on to fit
        # the budget included), never flipped once built
        state = self.governor.state
        built = replace(self.spec, train=replace(self.spec.train, grad_checkpointing=state.grad_checkpointing,
                                                 activation_offload=state.activation_offload),
                        backend=replace(self.spec.backend, cpu_offload=state.cpu_offload or self.spec.backend.cpu_offload))
        self.info = self.backend.setup(built, self.model_dir)
        self.governor.attach(self.backend)
        # a chunked loss the plan chose to fit the budget: a lever on the built model, whose
        # output head must be checked first (where it cannot chunk, the run goes on whole)
        self.governor.apply_loss_chunk()
        mem = self.spec.memory
        self.acct = Accountant(self.backend, sample_every=mem.sample_every, rank=self.comm.rank,
                               phase_every=mem.phase_every)
        self.acct.run_facts = {"adaptations": self.events, "adapt": mem.adapt, "budget_set": mem.budget is not None}
        if obj.paired:  # method=full's reference: every sample's log-prob, once, before step 1
            pairs = cast(PairSource, self.data)
            self.ref_table_bytes = cast(PairBackend, self.backend).precompute_reference(
                pairs.all_batches(self.governor.micro), len(pairs.samples.ids))
        self.pair_metrics: dict[str, Any] = {}
        self.acct.sample(0, "load")
        self.ckpt = Checkpointer(self.spec, self.run_dir, self.backend, self.backend_name, self.model_dir, self.comm,
                                 self.governor, self.runlog, self.faults)

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.model_dir),
                                                 trust_remote_code=self.spec.model.trust_remote_code)
        except (OSError, ValueError, KeyError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"model.path={self.model_dir}: its tokenizer cannot be loaded ({first[:200]}); point "
                            "model.path at a complete HF-format model (tokenizer files included)") from None

    def _event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        if self.comm.rank != 0:  # every rank decides the same (one collective); rank 0 says it
            return
        print(f"[governor] step {ev['step']}: {ev['trigger']} -> {ev['action']} "
              f"({json.dumps(ev['before'])} -> {json.dumps(ev['after'])})"
              + (f": {ev['reason']}" if ev.get("reason") else ""), file=sys.stderr)
        self.runlog.event(ev)

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run the steps from the start (or the resumed checkpoint) to train.steps, then write
        the adapter, the last checkpoint and the summary; return the summary."""
        start = self._begin()
        losses: list[float] = []
        val_loss, step_seconds, t_run = None, 0.0, time.perf_counter()
        stop = self.stop = StopOnSignal()
        t = self.spec.train
        steps, eval_every, save_every = t.steps, t.eval_every, t.save_every
        for step in range(start + 1, steps + 1):
            # several ranks stop together, at the step they agreed on (_train_step's agreement)
            if (stop.requested if self.comm.world_size == 1 else self._stop_agreed):
                self._stop_after(step - 1, stop)
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
                   "tokens_per_sec": ntok / dt if dt > 0 else None, **(self.pair_metrics.get("train") or {})}
            moved = self.backend.offloaded_bytes()  # train.activation_offload: the step's transfer volume
            if moved is not None:
                rec["offload_moved_bytes"] = moved
            if eval_every > 0 and (step % eval_every == 0 or step == steps):
                val_loss = self.evaluate()
                rec["val_loss"] = val_loss
                rec.update(self.pair_metrics.get("eval") or {})
                self.acct.between_steps()  # its memory belongs in the next peak read
            rec.update(self.acct.metrics_fields() if sample is not None else {})
            self.runlog.step(rec, self.acct.progress_text)
            if save_every and step % save_every == 0 and step < steps:
                self.ckpt.save(step, self.tokens, self.samples, signalled=stop.requested is not None)
                self.acct.between_steps()
            self.faults.pause_at(step)
            self.faults.leak()
        stop.close()
        self.runlog.close_progress()
        wall = time.perf_counter() - t_run
        self._save_results(steps)
        return self._finish(self._summary(losses, val_loss, wall, step_seconds))

    def _begin(self) -> int:
        """Resume (or not), take the run dir over and open the run log; the step to go on from."""
        t = self.spec.train
        self.tokens_this_run = 0
        start, self.tokens, self.samples = self.ckpt.resume()
        # every check has passed: from here on the run writes its results into the run dir
        checkpoints.take_over(self.run_dir, self.lock,
                              clear=start == 0 and self.comm.rank == 0 and t.overwrite)
        # metrics.jsonl: a fresh run's starts empty, a resumed one's loses the lines after its checkpoint
        # (the abandoned future); then the governor's decisions made before loading, one line per step
        self.runlog.begin(start, progress=t.progress, total=t.steps)
        return start

    def _stop_after(self, step: int, stop: StopOnSignal) -> NoReturn:
        """A signal asked this process (or, agreed, another rank) to stop: checkpoint ``step``,
        say how to continue, exit 128 + the signal's number."""
        if self.ckpt.save(step, self.tokens, self.samples, signalled=stop.requested is not None) \
                and self.comm.rank == 0:
            print(f"stopped by {stop.requested or 'a signal to another rank'} after step {step}; "
                  f"checkpoint saved: continue with train.resume=true hydra.run.dir={self.run_dir}",
                  file=sys.stderr)
        stop.close()
        raise SystemExit(stop.exit_code)

    # -- one step ----------------------------------------------------------------------------
    def _train_step(self, step: int) -> tuple[float, int, int, float | None]:
        """Run optimizer step ``step`` (1-based); redo it with a smaller micro-batch on OOM."""
        self.faults.abort_at(step, self.governor.micro)
        if self.spec.objective.unpaired:
            return self._unpaired_step(step)
        if self.spec.objective.preference:
            return self._pair_step(step)
        batch = self.data.train_batch(step - 1)  # the whole step's samples, every rank's
        mine = rank_slice(batch, self.comm.rank, self.comm.world_size)
        self._step_max_len = int(mine.input_ids.shape[1])  # the widest micro-batch, padded
        self._step_rows: dict[str, Any] | None = None  # packed: the step's own rows (_micro_batches)
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
                asked = self.stop is not None and self.stop.requested is not None
                agreed = self.comm.agree(asked, per_rank=oom is not None, total=loss_sum)
                oom_ranks, self._stop_agreed, loss_sum = list(agreed.ranks), agreed.raised[0], agreed.total
            if not oom_ranks:
                break
            self.backend.zero_grad()
            self.backend.release_cache()
            # lowers the micro-batch (the same on every rank) or raises UserError
            self.governor.on_oom(step, oom or OutOfMemory(f"out of memory on rank(s) {oom_ranks}"),
                                 ranks=oom_ranks if world > 1 else None,
                                 row_tokens=int(batch.input_ids.shape[1]))  # every rank's batch: one decision
        grad_norm = self.backend.optimizer_step(self._lr(step))
        every = self.spec.memory.empty_cache_every
        if every and step % every == 0:  # memory.empty_cache_every: the cache back to the device
            self.backend.release_cache()
        return loss_sum / batch.label_tokens, batch.tokens, len(batch.lengths), grad_norm

    def _unpaired_step(self, step: int) -> tuple[float, int, int, float | None]:
        """Optimizer step ``step`` of KTO (finetune/objectives.py ``kto_terms``): its reference
        point z0 first, once, over the whole step's records (their mismatched KL rows, no grad),
        then the step's records in micro-batches of ``micro`` rows, each scaled by 1 / the
        step's records at that z0: any split gives the same loss. Redone on OOM with fewer rows
        a micro-batch. Returns (loss, tokens, records, grad norm)."""
        batch = self.data.train_batch(step - 1)
        records = len(batch.lengths)
        backend = cast(PairBackend, self.backend)
        kl_rows = cast(UnpairedSource, self.data).kl_batch(batch)

        def accumulate(hook: Callable[[str], None]) -> PairSums:
            kl, sums = backend.kto_kl(kl_rows, self.governor.micro), PairSums()
            for micro in batch.split(self.governor.micro):
                sums = sums.add(backend.forward_backward_unpaired(micro, 1.0 / records, kl, hook))
            return sums

        return self._governed_step(step, batch, records, accumulate)

    def _governed_step(self, step: int, batch: Batch, count: int,
                       accumulate: Callable[[Callable[[str], None]], PairSums]) -> tuple[float, int, int, float | None]:
        """A preference step's shared frame: ``accumulate`` (given the accountant's phase hook)
        runs the step's micro-batches at the governor's current size and returns their sums;
        on OOM the gradients are dropped, the governor lowers the size and the step is redone;
        then the optimizer steps. Returns (loss, tokens, ``count``, grad norm)."""
        self._step_max_len = int(batch.input_ids.shape[1])
        self._step_rows = None

        def hook(phase: str) -> None:
            self.acct.sample(step, phase)

        while True:
            try:
                sums = accumulate(hook)
                break
            except OutOfMemory as e:
                self.backend.zero_grad()
                self.backend.release_cache()
                self.governor.on_oom(step, e, row_tokens=int(batch.input_ids.shape[1]))
        grad_norm = self.backend.optimizer_step(self._lr(step))
        self.pair_metrics["train"] = sums.metrics()
        return sums.loss, batch.tokens, count, grad_norm

    def _evaluate_unpaired(self) -> float | None:
        """Validation of KTO: the mean record loss over the validation records, each batch at
        its own z0 (TRL's eval), and TRL's eval_ metrics."""
        batches = self.data.val_batches(self.governor.micro, self.spec.train.eval_batches)
        if not batches:
            return None
        records = sum(len(b.lengths) for b in batches)
        backend, src = cast(PairBackend, self.backend), cast(UnpairedSource, self.data)
        sums = PairSums()
        for b in batches:
            kl = backend.kto_kl(src.kl_batch(b), self.governor.micro)
            sums = sums.add(backend.eval_unpaired(b, 1.0 / records, kl))
        self.pair_metrics["eval"] = sums.metrics("eval_")
        return sums.loss

    def _pair_step(self, step: int) -> tuple[float, int, int, float | None]:
        """Optimizer step ``step`` of a preference objective (finetune/objectives.py): the step's
        pairs in micro-batches of ``micro`` whole pairs (2 * micro rows), each scaled by the
        step's 1 / pairs (and ORPO's 1 / chosen target tokens), so any split gives the same loss;
        redone with fewer pairs a micro-batch on OOM. Returns (loss, tokens, pairs, grad norm)."""
        batch = self.data.train_batch(step - 1)
        pairs, chosen_tokens = pair_counts(batch)
        backend = cast(PairBackend, self.backend)

        def accumulate(hook: Callable[[str], None]) -> PairSums:
            sums = PairSums()
            for micro in batch.split(2 * self.governor.micro):
                sums = sums.add(backend.forward_backward_pairs(micro, 1.0 / pairs, 1.0 / max(1, chosen_tokens), hook))
            return sums

        return self._governed_step(step, batch, pairs, accumulate)

    def _evaluate_pairs(self) -> float | None:
        """Validation of a preference objective: the mean pair loss over the validation pairs
        (as the step's), and TRL's eval_ metrics (eval_rewards/accuracies, ...)."""
        batches = self.data.val_batches(self.governor.micro, self.spec.train.eval_batches)
        if not batches:
            return None
        counts = [pair_counts(b) for b in batches]
        pairs, chosen = sum(c[0] for c in counts), sum(c[1] for c in counts)
        sums = PairSums()
        for b in batches:
            sums = sums.add(cast(PairBackend, self.backend).eval_pairs(b, 1.0 / pairs, 1.0 / max(1, chosen)))
        self.pair_metrics["eval"] = sums.metrics("eval_")
        return sums.loss

    def _micro_batches(self, mine: Batch) -> list[Batch]:
        """This rank's share of the step, in the governor's current micro-batches: packed to
        ``tokens_per_micro`` tokens (train.packing), else ``micro_batch`` samples each."""
        tokens = self.governor.state.tokens_per_micro
        if not tokens:
            return mine.split(self.governor.micro)
        fill, segment = self.spec.train.pack_fill, self.data.longest
        parts = pack(mine, tokens, self.data.pad_id, fill=fill, segment=segment)
        # the step's own rows, what the calibration plan prices with them: the widest row, the
        # most targets of a row, the most attention pairs per position, the longest segment (a
        # sample or pads); a sample's targets are its mask past its first token (collate pads with 0)
        rows = pack_figures(mine.lengths, mine.loss_mask[:, 1:].sum(axis=1), tokens, fill, segment)
        self._step_max_len = rows.widest
        self._step_rows = {"row_targets": rows.targets, "pair_span": rows.pair_span, "longest": rows.longest}
        return parts

    def _agreed_sample(self, step: int, sample: Sample | None) -> Mapping[str, Any] | None:
        """What the governor decides on: this rank's sample in one process; under several, every
        rank's merged (the largest of each figure, fresh only when every rank's reading is), so
        every rank takes the same decision at the same step. A step the schedule does not sample
        (the same steps on every rank) needs no gather."""
        if self.comm.world_size == 1 or not self.acct.will_sample(step):
            return sample

        return ranks.merge_governor_views(self.comm.all_gather_object(ranks.governor_view(sample)))

    def _calibrate(self, sample: Sample) -> None:
        """After the first optimizer step: compare the plan to that step's sample (whose
        census the accountant already took; the summary keeps it as census_first_optimizer)."""
        try:
            # the plan at the length step 1 really had, so the error measures the model, not
            # the gap between train.seq_len and the data
            self.plan: Plan | None = planner.plan(self.spec, seq_len=self._step_max_len, state=self.governor.state,
                                                  head_fraction=self.governor.head_fraction,
                                                  pairs=self.data_stats.get("pairs"),  # a reference table's size
                                                  pair_positions=self.data_stats.get("pair_positions"),
                                                  **(self._step_rows or {"pair_span": self.governor.pair_span}))
            self.plan_error: dict[str, Any] | None = planner.plan_error(self.plan, sample.get("census"), sample)
        except Exception as e:  # calibration is a report, never a reason to stop training
            log.warning("plan calibration skipped: %s", e)
            self.plan, self.plan_error = None, None

    def evaluate(self) -> float | None:
        if self.spec.train.eval_every <= 0:
            return None
        if self.spec.objective.unpaired:
            return self._evaluate_unpaired()
        if self.spec.objective.preference:
            return self._evaluate_pairs()
        batches = self.data.val_batches(self.governor.micro, self.spec.train.eval_batches)
        if not batches:
            return None
        total = sum(self.backend.eval_loss(b) for b in batches)
        return total / sum(b.label_tokens for b in batches)

    # -- the end of the run --------------------------------------------------------------------
    def _save_results(self, steps: int) -> None:
        """The adapter (rank 0; a sharded run's ranks gather it for rank 0) and, with
        train.save_every, the last checkpoint."""
        try:
            if self.comm.rank == 0:
                with atomic_dir(self.run_dir / "adapter") as tmp, disk_errors(tmp):
                    self.faults.in_write("adapter")
                    self.backend.save_adapter(tmp)
                    # how its prompts were formatted, beside the adapter: mode=generate reads it,
                    # wherever the adapter is copied or converted to (finetune/prompting.py)
                    formats = self.data_stats["formats"]
                    prompting.write_record(tmp, prompting.prompt_format(formats), formats)
            elif getattr(self.backend, "sharded", False):
                self.backend.save_adapter(None)  # gathers the shards for rank 0 (a collective)
        except OSError as e:
            raise self.ckpt.adapter_failed(steps, e, self.tokens, self.samples) from None
        if self.spec.train.save_every:
            self.ckpt.save(self.spec.train.steps, self.tokens, self.samples)

    def _finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Every rank's memory to rank 0, which writes summary.json and memory.png and prints
        the tables; then the ranks leave together."""
        if self.comm.world_size > 1:
            # every rank's memory to rank 0: summary["ranks"], memory.per_rank (rows and
            # Overall) and explanations that name their rank
            mine = ranks.rank_report(self.comm.rank, self.info.device, summary["memory"], self.acct.samples)
            ranks.merge_into(summary, self.comm.all_gather_object(mine), self.comm.world_size,
                             self.spec.backend.strategy)
            if self.comm.rank != 0:  # rank 0 writes and prints for every rank
                self.comm.barrier()  # leave the group together: no rank tears it down mid-traffic
                self.comm.close()
                return summary
        self._write_summary(summary)
        print(self.acct.table(), file=sys.stderr)
        if self.comm.world_size > 1:
            print(ranks.render_rank_table(summary["memory"]["per_rank"]), file=sys.stderr)
        for ex in summary["memory"].get("explanations", []):
            print(f"[memory] {ex['text']}", file=sys.stderr)
        if line := planner.format_run_plan_error(summary.get("plan_error_run")):
            print(line, file=sys.stderr)
        self.runlog.close()
        self.comm.barrier()
        self.comm.close()
        print(f"run dir: {self.run_dir}", file=sys.stderr)
        print(done_line(summary), file=sys.stderr)
        return summary

    def release_model(self) -> None:
        """After the run is written: drop the backend and everything holding it (the model, its
        optimizer state, the governor's and the accountant's handles), so that what comes next
        (eval.tasks) starts from the memory a fresh process would have, less the imports."""
        for name in ("backend", "governor", "acct", "ckpt", "data"):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()

    def _write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json (a failure says what is kept), the loggers' summary, memory.png."""
        try:
            self.faults.in_write("summary")
            atomic_write_json(self.run_dir / "summary.json", summary)
        except OSError as e:
            raise UserError(f"summary.json not written to {self.run_dir} ({e.strerror or e}); the adapter in "
                            f"{self.run_dir / 'adapter'} is complete and metrics.jsonl holds every step: only the "
                            "summary and memory.png are missing") from None
        self.runlog.summary(summary)
        try:
            self.faults.in_write("memory.png")
            self.acct.write_plot(self.run_dir / "memory.png", budget=self.governor.budget_bytes)
        except Exception as e:  # a plot must never cost the run its results
            log.warning("memory.png not written: %s", e)

    def _summary(self, losses: list[float], val_loss: float | None, wall: float,
                 step_seconds: float) -> dict[str, Any]:
        """summary.json: what ran (backend, model, method, sizes), how far and how fast, the
        losses, the batch, the data, memory (the accountant's), and the governor's actions."""
        spec, info, tail = self.spec, self.info, losses[-min(10, len(losses)):] if losses else []
        return {
            "backend": self.backend_name, "device": info.device, "model": spec.model.name,
            "model_path": str(info.model_path), "method": spec.method.name, "optim": spec.optim.name,
            "precision": spec.precision.name, "dtype": info.dtype,
            "params_total": info.params_total, "params_trainable": info.params_trainable,
            "steps": spec.train.steps, "steps_this_run": len(losses), "samples": self.samples, "tokens": self.tokens,
            # this process's steps only: a resumed run's earlier tokens took no time here
            "tokens_per_sec": self.tokens_this_run / step_seconds if step_seconds > 0 and losses else None,
            "wall_s": wall,
            "first_loss": losses[0] if losses else None,
            "final_train_loss": sum(tail) / len(tail) if tail else None,
            "last_step_loss": losses[-1] if losses else None,
            "final_val_loss": val_loss,
            "effective_batch": spec.train.effective_batch, "micro_batch": self.governor.micro,
            "data": self.data_stats,
            # chat | raw | question/answer: the shape mode=generate gives a prompt (also adapter/finetune.json)
            "prompt_format": prompting.prompt_format(self.data_stats["formats"]),
            "memory": (mem := self.acct.summary(step_seconds)),
            "plan_error": getattr(self, "plan_error", None),
            # the run's peaks against the plan's steady state, in the four metrics
            "plan_error_run": planner.run_plan_error(getattr(self, "plan", None), mem.get("peaks") or {}),
            "adaptations": self.events,
            "budget_bytes": self.governor.budget_bytes,
            # a preference objective's last step's and validation's metrics, TRL's names
            **({"objective": spec.objective.name, "pair_metrics": self.pair_metrics,
                "reference_table_bytes": getattr(self, "ref_table_bytes", 0)} if spec.objective.preference else {}),
        }


def train(spec: RunSpec) -> dict[str, Any]:
    """Run a training job for a resolved spec; return the summary (also in summary.json)."""
    trainer = Trainer(spec)
    try:
        try:
            if several_ranks():  # the ranks agree on one run dir first: rank 0's is claimed
                trainer.connect()  # the backend, and the launcher's ranks
                trainer.claim()  # the lock and the checks that need no model, agreed by every rank
            else:  # one process: its checks need no framework, so a refused run imports none
                trainer.claim()
                trainer.connect()
            if spec.eval.tasks:  # an unknown task or an unreachable data set: refused before training
                evaluate.check_tasks(spec)
            with trainer.runlog:  # closed on every way out: finished, failed, stopped by a signal
                trainer.setup()
                summary = trainer.train()
            if spec.eval.tasks and trainer.comm.rank == 0:  # the final adapter, into the same run dir
                trainer.release_model()  # the evaluation loads the base again: one model in memory at a time
                summary = evaluate.after_training(trainer.spec, trainer.run_dir, summary)
            return summary
        except RunLogWriteError as e:
            raise runlog_failed(trainer.run_dir, e) from None
    except UserError:
        if trainer.comm.rank == 0:
            checkpoints.remove_if_no_result(trainer.run_dir, created=trainer.created_run_dir)
        raise
    finally:
        if trainer.lock is not None:  # a refused command leaves the run dir as it was: no new lock file
            trainer.lock.release(remove=not trainer.lock.begun)
