"""The governor: given the plan, the samples and the budget, what do we change?

Every change keeps the math: the micro-batch only ever moves to a smaller divisor of the
effective batch (gradient accumulation rises to match), or, packed (train.packing), to fewer
tokens per micro-batch (the same samples in the same order, packed into more micro-batches), the chunked loss computes the same
cross-entropy a chunk of tokens at a time (equal within float rounding), gradient
checkpointing recomputes rather than approximates, and releasing cached blocks changes no
number. Each action is an
event ``{step, trigger, action, before, after}`` handed to ``emit``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from finetune import planner
from finetune.accounting import fmt_bytes
from finetune.backends import capabilities, device_memory, memory_model, run_device
from finetune.budget import parse_budget
from finetune.errors import UserError
from finetune.planner import fit  # fit.LOSS_CHUNK_LEVER read at each use (tests set it)
from finetune.spec import RunSpec
from finetune.run.state import RunState

log = logging.getLogger("finetune")

SWAP_GROWTH_BYTES = 256 << 20  # swap grown this much since the run started: we are paging
PSI_SOME_AVG10 = 20.0  # % of the last 10 s some task stalled on memory (Linux PSI)
FRAGMENTED_FRACTION = 0.25  # inactive split blocks / reserved
FRAGMENTED_MIN_BYTES = 512 << 20


def smaller_divisor(n: int, below: int) -> int | None:
    """Largest divisor of ``n`` that is at most ``below // 2`` (halve, staying exact)."""
    for d in range(below // 2, 0, -1):
        if n % d == 0:
            return d
    return None


def _measured_peak(sample: Mapping[str, Any]) -> int | None:
    """The step's peak as the allocator saw it; None where no allocator is measured (the cuda
    backend on the CPU). Not RSS: it counts the interpreter and the frameworks' own libraries
    (about 0.5 GB before any tensor), which neither the plan nor memory.budget prices, so a
    budget met by the tensors would read as exceeded on every step."""
    for key in ("step_peak_reserved", "step_peak_allocated", "peak_reserved", "peak_allocated"):
        v = sample.get(key)
        if v is not None:
            return int(v)
    return None


class Governor:
    def __init__(self, spec: RunSpec, backend_name: str, emit: Callable[[dict[str, Any]], None]):
        self.spec, self.backend_name, self.emit = spec, backend_name, emit
        self.state = RunState.from_spec(spec, backend_name)  # the governor owns the run's live state
        self.adapt = spec.memory.adapt
        self.backend: Any = None
        # the most of a micro-batch's positions that are targets, once the data is known
        # (finetune.data.build head_fraction): the plans price the head on those only
        self.head_fraction: float | None = None
        self.pair_span: float | None = None  # packed: the data's attention pairs per position (data.build)
        self.row_targets: int | None = None  # packed: the most targets of a packed micro-batch (data.build)
        self.longest: int | None = None  # packed: the data's longest sample, tokens (data.build max_tokens)

        total = device_memory(backend_name, run_device(backend_name, spec.backend.device)).total_bytes
        if spec.memory.budget is not None:
            self.budget_bytes = parse_budget(spec.memory.budget, total)
        else:
            self.budget_bytes = total
        self._swap_base: int | None = None
        self._swap_acted_at: int | None = None
        self._cache_limit_pending = False  # memory.cache_limit=auto: set after the first measured step
        self._chunk_refused = False  # the backend said it cannot chunk this run's loss
        # the longest sample of the step (the loop sets it): a packed micro-batch holds at least
        # one whole sample, so tokens per micro-batch below it lower no peak
        self.step_longest: int | None = None

    @property
    def effective(self) -> int:
        """Samples per optimizer step, fixed for the run."""
        return self.state.effective_batch

    @property
    def micro(self) -> int:
        return self.state.micro_batch

    @micro.setter
    def micro(self, value: int) -> None:
        self.state.micro_batch = int(value)

    @property
    def loss_chunk(self) -> int:
        """train.loss_chunk as the run has it now (0: the whole logits)."""
        return self.state.loss_chunk

    def _enable_loss_chunk(self, step: int, trigger: str, **detail: Any) -> bool:
        """Turn the chunked loss on in the backend (``LOSS_CHUNK_LEVER`` tokens); False where
        it is on already or the backend cannot chunk this run's loss (it says why once)."""
        if self.state.loss_chunk or self.backend is None or self._chunk_refused:
            return False
        if self.spec.objective.preference:
            return False  # a preference step's log-probs read no loss_chunk (finetune/planner/preference.py)
        why = self.backend.set_loss_chunk(fit.LOSS_CHUNK_LEVER)
        if why:
            self._chunk_refused = True
            log.info("the loss stays whole: %s", why)
            return False
        self.state.loss_chunk = fit.LOSS_CHUNK_LEVER
        self._act(step, trigger, "enable_loss_chunk", {"loss_chunk": 0}, {"loss_chunk": fit.LOSS_CHUNK_LEVER}, **detail)
        return True

    @property
    def grad_checkpointing(self) -> bool:
        return self.state.grad_checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, value: bool) -> None:
        self.state.grad_checkpointing = bool(value)

    def _act(self, step: int, trigger: str, action: str, before: dict[str, Any], after: dict[str, Any],
             **detail: Any) -> None:
        """Record an action as an event; one that changed nothing (every value of ``after`` as
        it was ``before``: MLX's cache limit set to the size it had) is no event at all."""
        if all(k in before and before[k] == v for k, v in after.items()):
            return
        self.emit({"step": step, "trigger": trigger, "action": action, "before": before, "after": after, **detail})

    def _lower_micro(self, step: int, trigger: str, **detail: Any) -> bool:
        if self.state.tokens_per_micro:
            return self._lower_tokens(step, trigger, **detail)
        new = smaller_divisor(self.effective, self.micro)
        if new is None or new >= self.micro:
            return False
        before = {"batch_size": self.micro, "grad_accum": self.effective // self.micro}
        self.micro = new
        self._act(step, trigger, "lower_micro_batch", before, {"batch_size": new, "grad_accum": self.effective // new},
                  **detail)
        return True

    def _lower_tokens(self, step: int, trigger: str, **detail: Any) -> bool:
        """Packed: halve the tokens per micro-batch, never below the step's longest sample (a
        micro-batch holds whole samples: below that the largest one stays as it is)."""
        old = self.state.tokens_per_micro
        new = max(old // 2, self.step_longest or 1)
        if new >= old:
            return False
        self.state.tokens_per_micro = new
        self._act(step, trigger, "lower_tokens_per_micro", {"tokens_per_micro": old}, {"tokens_per_micro": new},
                  **detail)
        return True

    # -- before any weight is loaded ---------------------------------------------------------
    def before_load(self, seq_len: int | None = None, only_check: bool = False,
                    head_fraction: float | None = None, pair_span: float | None = None,
                    row_targets: int | None = None, longest: int | None = None,
                    pairs: int | None = None, pair_positions: int | None = None) -> None:
        """Fit the plan to the budget: the loss in chunks, a smaller micro-batch, then
        checkpointing; else stop (``planner.fit_to_budget``). A chunked loss decided here is
        handed to the backend by ``apply_loss_chunk`` once the model is loaded.

        Args:
            seq_len: the longest sample the run will see (the plan's activations scale with it).
            only_check: stop if it cannot fit, change nothing (used before any download, with
                the shortest length, so only a model whose weights and state alone are too
                big stops there).
            head_fraction: the data's share of target positions at most (kept for later plans).
            pair_span: packed, the data's most attention pairs per position (kept likewise).
            row_targets: packed, the most targets of one packed micro-batch (kept likewise).
            longest: packed, the data's longest sample in tokens (kept likewise).
            pairs, pair_positions: a preference run's pairs and the most positions a pair takes
                with its prompt once (finetune/data/pairs.py; planner.plan takes them).
        """
        if head_fraction is not None:
            self.head_fraction = head_fraction
        if pair_span is not None:
            self.pair_span = pair_span
        if row_targets is not None:
            self.row_targets = row_targets
        if longest is not None:
            self.longest = longest
        if not self.budget_bytes:
            return
        import sys

        try:
            res = planner.fit_to_budget(self.spec, self.budget_bytes, seq_len=seq_len, state=self.state,
                                        head_fraction=self.head_fraction, pair_span=self.pair_span,
                                        row_targets=self.row_targets, longest=self.longest,
                                        pairs=pairs, pair_positions=pair_positions)
        except UserError:
            raise
        except Exception as e:  # a model the planner cannot read: adapt while training only
            log.warning("no memory plan before loading (%s); the governor acts on measurements only", e)
            return
        if res.fits and not res.events:
            return
        budget = self.spec.memory.budget or f"{fmt_bytes(self.budget_bytes)} (the device's)"
        if not res.fits:
            print(planner.format_table(res.plan), file=sys.stderr)
            msg = (f"the plan does not fit memory.budget={budget} even at micro-batch 1 with gradient checkpointing "
                   f"(peak {fmt_bytes(res.plan['peak_bytes'])}); would fit: "
                   f"{', '.join(res.suggestions) or 'a larger budget'} (details: finetune mode=plan ...)")
            if self.adapt:
                raise UserError(msg)
            log.warning("%s; memory.adapt=false, so the run goes ahead", msg)
            return
        if only_check:
            return
        if not self.adapt:
            log.warning("the plan exceeds memory.budget=%s at micro-batch %d; memory.adapt=false, so nothing changes",
                        budget, self.micro)
            return
        for ev in res.events:
            self.emit({"step": 0, **ev})
        self.micro = res.batch_size
        self.grad_checkpointing = res.grad_checkpointing
        self.state.activation_offload = res.activation_offload or self.state.activation_offload
        self.state.cpu_offload = res.cpu_offload or self.state.cpu_offload
        self.state.loss_chunk = res.loss_chunk
        if self.state.tokens_per_micro:
            self.state.tokens_per_micro = res.tokens_per_micro

    def apply_loss_chunk(self) -> None:
        """After setup (or on resume): a chunked loss the plan chose before loading, or the
        checkpoint's, goes to the backend. Where the backend cannot chunk this model's loss,
        the run goes on with the whole logits, the event says so, and the measured peak and
        OOM reactions take over."""
        want = self.state.loss_chunk
        if not want or want == self.spec.train.loss_chunk:
            return  # nothing chosen, or the user's own setting (the backend applied it at setup)
        why = self.backend.set_loss_chunk(want)
        if why:
            self._chunk_refused = True
            self.state.loss_chunk = 0
            self._act(0, "backend", "disable_loss_chunk", {"loss_chunk": want}, {"loss_chunk": 0}, reason=why)
            log.warning("train.loss_chunk=%d was chosen (to fit memory.budget, or by the checkpoint resumed), but %s; "
                        "the loss stays whole", want, why)

    def attach(self, backend: Any) -> None:
        """Apply the framework's limits from the budget (``Backend.set_memory_limits``) and the
        cache limit (``memory.cache_limit``: a size now, ``auto`` once step 1 is measured)."""
        self.backend = backend
        self.caps = capabilities(self.backend_name)
        if not self.adapt:
            return
        if self.budget_bytes:
            got = backend.set_memory_limits(self.budget_bytes)  # {} where the framework has none
            if got:  # {name: new, name_prev: old}
                self._act(0, "budget", self.caps.limits_event,
                          {k[:-5]: v for k, v in got.items() if k.endswith("_prev")},
                          {k: v for k, v in got.items() if not k.endswith("_prev")})
        want = self.spec.memory.cache_limit
        if want is None or not self.caps.cache_limit:
            return
        if str(want) == "auto":
            self._cache_limit_pending = True
            return

        limit = parse_budget(want, self.budget_bytes, "memory.cache_limit")
        prev = backend.set_cache_limit(limit)
        self._act(0, "memory.cache_limit", self.caps.cache_limit_event, {"cache_limit": prev}, {"cache_limit": limit})

    def _derive_cache_limit(self, step: int, sample: Mapping[str, Any]) -> None:
        """memory.cache_limit=auto: cap the allocator's cache at what one step frees and asks for again,
        its measured peak above the bytes still live after it. A cache that size serves the
        next step of the same shape entirely from reuse; a larger one (the old default: a
        quarter of the budget) only holds buffers of shapes that do not come back."""
        peak, live = sample.get("step_peak_allocated"), sample.get("allocated")
        if peak is None or live is None:
            return
        self._cache_limit_pending = False
        limit = max(self.caps.min_cache_limit_bytes, int(peak) - int(live))
        if self.budget_bytes:
            limit = min(limit, self.budget_bytes)
        prev = self.backend.set_cache_limit(limit)
        self._act(step, "measured_step_peak", self.caps.cache_limit_event,
                  {"cache_limit": prev, "step_peak_allocated": int(peak), "allocated": int(live)},
                  {"cache_limit": limit})

    def restore(self, state: dict[str, Any]) -> None:
        # a supervisor restart may have lowered train.batch_size below the checkpoint's micro
        self.micro = min(int(state.get("micro_batch", self.micro)), self.micro)
        if state.get("tokens_per_micro") and self.state.tokens_per_micro:
            self.state.tokens_per_micro = min(int(state["tokens_per_micro"]), self.state.tokens_per_micro)
        if state.get("loss_chunk") and not self.state.loss_chunk and self.backend is not None:
            self.state.loss_chunk = int(state["loss_chunk"])  # the checkpointed run chunked its loss
            self.apply_loss_chunk()
        if state.get("grad_checkpointing") and not self.grad_checkpointing and self.backend is not None:
            self.backend.set_grad_checkpointing(True)
        self.grad_checkpointing = bool(state.get("grad_checkpointing", self.grad_checkpointing))
        if state.get("activation_offload") and not self.state.activation_offload and self.backend is not None:
            self.state.activation_offload = self.backend.set_activation_offload(True) is None

    # -- while training ----------------------------------------------------------------------
    def on_oom(self, step: int, exc: Exception, ranks: list[int] | None = None, row_tokens: int | None = None) -> None:
        """An allocation failed mid-step: change one thing so the loop redoes the step. First
        a smaller micro-batch (the exact lever: which allocation failed is not known); at
        micro-batch 1 the chunked loss (no [T, V] logits); then gradient checkpointing.
        Under several ranks every rank calls this at the same step (``ranks``: those that ran
        out, recorded in the event), so all change the same thing. ``row_tokens``: the step's
        widest row (padded); the chunked loss is tried only where a micro-batch holds more
        targets than one chunk, so that it changes something."""
        detail = {"ranks": ranks} if ranks else {}
        if not self.adapt:
            raise UserError(f"out of memory at step {step} with micro-batch {self.micro} and memory.adapt=false; "
                            "set memory.adapt=true or lower train.batch_size (raise train.grad_accum to keep the batch)")
        if not self._lower_micro(step, "oom", **detail):
            wide = row_tokens is None or self.micro * (row_tokens - 1) > fit.LOSS_CHUNK_LEVER
            if wide and self._enable_loss_chunk(step, "oom", **detail):
                return
            if not self.grad_checkpointing:
                self.grad_checkpointing = True
                self.backend.set_grad_checkpointing(True)
                self._act(step, "oom", "enable_grad_checkpointing", {"grad_checkpointing": False},
                          {"grad_checkpointing": True}, **detail)
                return
            raise UserError(f"out of memory at step {step} even at micro-batch 1 with gradient checkpointing; "
                            "try method=qlora, fewer method.lora.num_layers, a lower train.seq_len, or a larger device "
                            "(finetune mode=plan shows what fits)")

    def after_step(self, step: int, sample: Mapping[str, Any] | None) -> None:
        """React to measured peak above budget, swap growth, memory pressure, fragmentation."""
        if sample is None:
            return
        if self._cache_limit_pending and self.backend is not None:
            self._derive_cache_limit(step, sample)
        peak = _measured_peak(sample)
        if self.budget_bytes and peak is not None and peak > self.budget_bytes and self.spec.memory.budget is not None:
            if not self.adapt or not self._lower_micro(step, "peak_above_budget"):
                log.warning("step %d: measured peak %d B is above memory.budget %d B", step, peak, self.budget_bytes)
        # swap and pressure only from a sample that read them: between readings a sample
        # repeats the last one (Accountant io_budget), which must not be acted on twice
        fresh = sample.get("system_fresh", True)
        swap = sample.get("swap_used") if fresh else None
        if swap is not None:
            if self._swap_base is None:
                self._swap_base = int(swap)
            grown = int(swap) - self._swap_base
            if grown > SWAP_GROWTH_BYTES and (self._swap_acted_at is None or step - self._swap_acted_at > 5):
                self._swap_acted_at = step
                if self.adapt and self.backend is not None:
                    self.backend.release_cache()
                if not self.adapt or not self._lower_micro(step, "swap_growth"):
                    log.warning("step %d: system swap grew %d B since the run started; steps will be slow", step, grown)
                self._swap_base = int(swap)
        psi = sample.get("psi_some_avg10") if fresh else None
        if psi is not None and psi > PSI_SOME_AVG10 and self.adapt and (self._swap_acted_at is None or step - self._swap_acted_at > 5):
            self._swap_acted_at = step
            self._lower_micro(step, "memory_pressure")
        split, reserved = sample.get("inactive_split"), sample.get("reserved")
        if split and reserved and split > FRAGMENTED_MIN_BYTES and split > FRAGMENTED_FRACTION * reserved and self.adapt:
            self.backend.release_cache()
            self._act(step, "fragmentation", "release_cache", {"inactive_split": split, "reserved": reserved},
                      {"reserved": None})
