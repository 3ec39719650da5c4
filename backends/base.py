"""The Backend protocol: what the one training loop asks of a framework.

A backend owns a model, its adapters and its optimizer on one framework (torch or mlx). It
never owns the loop, the metrics schema or logging: it contributes numbers, not semantics.
This module imports neither torch nor mlx.

Loss convention (both backends, so an adapted run equals an unadapted one): for a batch the
backend computes the *sum* of per-token cross-entropy over target positions whose mask is 1
(targets are ``input_ids[:, 1:]``, mask ``loss_mask[:, 1:]``), multiplies it by
``loss_scale`` (the loop passes 1 / label tokens of the whole optimizer step) before
backward, and returns the unscaled sum. Gradients accumulate across calls until
``optimizer_step``.

Packed micro-batches (``train.packing``, ``pack``) keep the convention: one row holds several
samples end to end, ``position_ids`` restart at 0 at each sample, and each sample's first
token has mask 0 (it is no sample's target: the position before it belongs to another
sample). The backend lets no token attend across a sample boundary, so the sum is the sum
of the same samples unpacked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from finetune.budget import DeviceMemory
from finetune.model.types import Linear, ModelDesc
from finetune.model.inventory import Setup, Tensor
from finetune.prompting import Prompt
from finetune.spec import RunSpec
from finetune.records import Census, MemoryReading, PlanData

PhaseHook = Callable[[str], None]
"""Called by a backend inside forward_backward with "forward" (after the forward pass, before
backward) and "backward" (after backward), where the framework lets the two be separated."""


@dataclass
class Batch:
    """A padded micro-batch. Arrays are numpy; the backend moves them to its device."""

    input_ids: np.ndarray  # [B, T] int32, right-padded with pad_id
    loss_mask: np.ndarray  # [B, T] int8: 1 where the token is a target that counts in the loss
    lengths: np.ndarray  # [B] int32 real (unpadded) lengths
    indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # dataset ids
    # Micro-batches are padded so the model's input length (T - 1: targets are ids[:, 1:]) is
    # a multiple of ``pad_multiple``, never beyond ``max_len``: shapes repeat from step to
    # step, so the framework's buffer cache reuses them instead of growing (see
    # padded_length). 1 trims each micro-batch to its own longest sample.
    pad_multiple: int = 1
    max_len: int | None = None
    # Packed (``pack``): [1, N] int32 positions, restarting at 0 at each sample; the backend
    # keeps attention within a sample. None: each row is one sample, from position 0.
    position_ids: np.ndarray | None = None

    @property
    def samples(self) -> int:
        """Samples in the batch: its rows, or packed the samples of its row (those whose
        dataset ids it carries; without ids, the starts among its first ``lengths`` columns,
        where an unfilled row's samples lead it and its pads follow)."""
        if self.position_ids is None:
            return len(self.lengths)
        if len(self.indices):
            return len(self.indices)
        return int((self.position_ids[0, : int(self.lengths[0])] == 0).sum())

    @property
    def tokens(self) -> int:
        """Real (non-pad) tokens in the batch."""
        return int(self.lengths.sum())

    @property
    def label_tokens(self) -> int:
        """Target positions that count in the loss."""
        return int(self.loss_mask[:, 1:].sum())

    def split(self, micro: int) -> list[Batch]:
        """Split into consecutive micro-batches of at most ``micro`` samples, each cut to its
        own longest sample padded as ``padded_length`` says (pad columns count in no loss)."""
        out = []
        for i in range(0, len(self.lengths), micro):
            lens = self.lengths[i : i + micro]
            t = min(padded_length(int(lens.max()), self.pad_multiple, self.max_len), self.input_ids.shape[1])
            out.append(
                Batch(
                    self.input_ids[i : i + micro, :t],
                    self.loss_mask[i : i + micro, :t],
                    lens,
                    self.indices[i : i + micro] if len(self.indices) else self.indices,
                    self.pad_multiple,
                    self.max_len,
                )
            )
        return out


@dataclass(frozen=True)
class PackedRow:
    """One micro-batch ``pack`` makes: samples ``first`` to ``end`` (exclusive) of the step, end
    to end (``used`` tokens of theirs); ``extend``: pads that follow each of them inside its own
    segment (``train.pack_fill``; empty otherwise), then ``pads``: the lengths of the row's
    pad segments (each a segment of its own, positions from 0). No pad is a target."""

    first: int
    end: int
    used: int
    pads: tuple[int, ...] = ()
    extend: tuple[int, ...] = ()

    @property
    def width(self) -> int:
        """Columns of the row: its samples' tokens and its pads."""
        return self.used + sum(self.extend) + sum(self.pads)

    def segments(self, lengths: list[int]) -> list[int]:
        """Tokens of each segment attention runs over alone: its samples (``lengths``: the
        step's) with the pads that follow them, then its pad segments."""
        own = lengths[self.first:self.end]
        return [n + e for n, e in zip(own, self.extend or (0,) * len(own))] + list(self.pads)

    def pair_span(self, lengths: list[int]) -> float:
        """(query, key) pairs per column of attention run one segment at a time: the squares of
        its segments over its width."""
        return sum(n * n for n in self.segments(lengths)) / max(self.width, 1)


def pack_layout(lengths: Any, tokens_per_micro: int, fill: bool = False, segment: int | None = None) -> list[PackedRow]:
    """The micro-batches ``pack`` makes of samples of ``lengths`` (in order), without building
    them: what the data pipeline reads to plan every step's rows (``finetune.data``).

    A sample goes into the current micro-batch while it fits, else starts the next one; a
    sample longer than ``tokens_per_micro`` gets one of its own, whole. Every micro-batch but
    the step's last is filled to ``tokens_per_micro`` with pads: fewer columns than the sample
    that did not fit, a segment of their own.

    ``fill`` (``train.pack_fill``) fills the last one too, and lays every row's pads out so
    that each row's attention is the fullest one's: each sample's segment is followed by pads
    up to ``segment`` tokens (the data's longest sample; default the step's), in order, and
    what is left makes pad segments of ``segment`` tokens. A pad after a sample sees it, but no
    token of the sample sees a pad (attention is causal), so the loss is unchanged."""
    lens = [int(n) for n in lengths]
    piece = max(1, int(segment) if segment else max(lens, default=1))
    out: list[PackedRow] = []
    start, used = 0, 0
    for i, n in enumerate(lens + [0]):
        last = i == len(lens)
        if last or (i > start and used + n > tokens_per_micro):
            gap = max(0, tokens_per_micro - used) if (fill or not last) else 0
            extend: list[int] = []
            if fill:
                for m in lens[start:i]:
                    extend.append(min(gap, max(0, piece - m)))
                    gap -= extend[-1]
            pads = (piece,) * (gap // piece) + ((gap % piece,) if gap % piece else ())
            out.append(PackedRow(start, i, used, pads, tuple(extend)))
            start, used = i, 0
        used += n
    return out


@dataclass(frozen=True)
class PackedFigures:
    """What the micro-batches ``pack`` makes hold at most: the figures a plan prices a packed
    run with (``pack_figures``; over several steps and ranks, ``merge``)."""

    widest: int  # columns of the widest micro-batch
    targets: int  # target positions of the micro-batch that holds the most (the output head's rows)
    pair_span: float  # (query, key) pairs per position of the micro-batch with the most (PackedRow.pair_span)
    longest: int  # tokens of the longest segment attention runs over alone (a sample with its pads, or pads)
    pad_tokens: int  # pad columns of them all (what pack computes and no loss counts)

    def merge(self, other: PackedFigures) -> PackedFigures:
        """The figures of both sets of micro-batches together."""
        return PackedFigures(max(self.widest, other.widest), max(self.targets, other.targets),
                             max(self.pair_span, other.pair_span), max(self.longest, other.longest),
                             self.pad_tokens + other.pad_tokens)


def pack_figures(lengths: Any, targets: Any, tokens_per_micro: int, fill: bool = False,
                 segment: int | None = None) -> PackedFigures:
    """The figures of the micro-batches ``pack`` makes of samples of ``lengths`` (in order, as
    ``pack_layout`` lays them out), read from the samples' lengths and target counts without
    building them: ``targets[i]`` is sample i's label tokens past its first (which ``pack``
    masks: the position before it belongs to another sample)."""
    lens = [int(n) for n in lengths]
    widest = most = longest = pads = 0
    span = 0.0
    for r in pack_layout(lens, tokens_per_micro, fill, segment):
        widest = max(widest, r.width)
        most = max(most, int(np.sum(targets[r.first:r.end], dtype=np.int64)))
        span = max(span, r.pair_span(lens))
        longest = max(longest, max(r.segments(lens), default=0))
        pads += r.width - r.used
    return PackedFigures(widest, most, span, longest, pads)


def pack(batch: Batch, tokens_per_micro: int, pad_id: int = 0, fill: bool = False,
         segment: int | None = None) -> list[Batch]:
    """The samples of ``batch`` (a padded step, rows in the sampler's order) end to end in
    micro-batches of ``tokens_per_micro`` tokens, in the same order, as ``pack_layout`` lays
    them out (a sample longer than ``tokens_per_micro`` gets a micro-batch of its own, whole:
    cutting it would change the loss; the data pipeline cuts samples once, at the configured
    value: ``train.pack_overflow``).

    Each micro-batch is one row [1, N]. Every one but the step's last is filled to exactly
    ``tokens_per_micro`` columns: the few columns its next sample did not fit into are pads,
    a segment of their own (positions from 0, no loss), so no real token attends to them or
    they to it. The last holds what is left, unpadded, unless ``fill`` pads it too
    (``train.pack_fill``, ``segment``: see ``pack_layout``): then every micro-batch of every
    step has the same shape and attention pairs, and the step's memory with them. Each
    sample's first token is masked out of the loss (it is column 0 of its sample), so the
    label tokens and the loss sum equal the unpacked batch's, filled or not."""
    out: list[Batch] = []
    lengths = [int(n) for n in batch.lengths]
    for row in pack_layout(lengths, tokens_per_micro, fill, segment):
        ids: list[np.ndarray] = []
        mask: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        for k, r in enumerate(range(row.first, row.end)):
            n, e = lengths[r], row.extend[k] if row.extend else 0
            m = batch.loss_mask[r, :n].copy()
            m[:1] = 0  # no sample's target: the position before it belongs to another sample
            ids += [batch.input_ids[r, :n].astype(np.int32, copy=False), np.full(e, pad_id, np.int32)]
            mask += [m, np.zeros(e, m.dtype)]
            pos.append(np.arange(n + e, dtype=np.int32))
        for n in row.pads:
            ids.append(np.full(n, pad_id, np.int32))
            mask.append(np.zeros(n, batch.loss_mask.dtype))
            pos.append(np.arange(n, dtype=np.int32))
        out.append(Batch(np.concatenate(ids)[None], np.concatenate(mask)[None], np.array([row.used], np.int32),
                         batch.indices[row.first:row.end] if len(batch.indices) else batch.indices,
                         position_ids=np.concatenate(pos)[None]))
    return out


def padded_length(longest: int, multiple: int, max_len: int | None = None) -> int:
    """Columns of a micro-batch whose longest sample has ``longest`` tokens: the model input
    (``longest - 1`` tokens) rounded up to a multiple of ``multiple``, plus the last target,
    capped at ``max_len`` (never below ``longest``). mlx-lm pads the same way (to 1 + a
    multiple of 32, ``tuner/trainer.py iterate_batches``)."""
    if multiple <= 1 or longest <= 1:
        return longest
    t = 1 + multiple * -(-(longest - 1) // multiple)
    return max(longest, min(t, max_len)) if max_len else t


@dataclass(frozen=True)
class Capabilities:
    """What one backend can run, torch- and mlx-free (``backends/<name>/capabilities.py``).

    The config validates against it at compose time, the planner and the governor ask it
    instead of comparing the backend's name, and the runtime looks its choices up in it.
    """

    name: str
    methods: tuple[str, ...]
    optimizers: tuple[str, ...]
    precisions: dict[str, tuple[str | None, str | None]]  # name: (weight dtype or None = stored, autocast)
    attn_implementations: tuple[str, ...]
    why_not: dict[str, str]  # "optim.name": why a choice other backends run is not run here
    nvml: bool  # the device has a driver view (NVML) to reconcile with the allocator
    cache_limit: bool  # the allocator's cache can be capped (the governor sets it)
    strategies: tuple[str, ...] = ("ddp",)  # how several processes share one run (backend.strategy)
    # What shared code would otherwise infer from the backend's name:
    min_cache_limit_bytes: int = 0  # memory.cache_limit=auto never caps the cache below this
    # train.pad_multiple=0 (auto), by run device (budget.run_device); 1 where a device is absent
    default_pad_multiple: dict[str, int] = field(default_factory=dict)
    chunked_loss_with_compile: bool = True  # train.loss_chunk and the target-row head survive train.compile
    packed_block_mask: bool = False  # a packed row's attention is a [1, 1, T, T] bool block mask
    # train.activation_offload: why it does not apply here (None: it runs)
    no_activation_offload: str | None = None
    no_cpu_offload: str | None = None  # backend.cpu_offload: why it does not apply here (None: it runs)
    pre_quantized: bool = False  # trains on a pre-quantized checkpoint (config.json 'quantization') as stored
    gpu_device: str | None = None  # the run device whose optimizer state may page and whose layers may split
    adapter_format: str = "peft"  # the adapter format its library loads (finetune.export's names)
    limits_event: str = "set_memory_limits"  # the governor's event when it applies the budget's limits
    cache_limit_event: str = "set_cache_limit"  # the governor's event when it caps the cache
    # the module its runtime imports (found before the runtime is loaded) and the line that installs it
    framework: str = ""
    install: str = ""

    def choices(self, key: str) -> tuple[str, ...]:
        return {"method.name": self.methods, "optim.name": self.optimizers,
                "precision.name": tuple(self.precisions),
                "backend.attn_implementation": self.attn_implementations,
                "backend.strategy": self.strategies}[key]


@dataclass
class ModelInfo:
    """What a backend reports after setup()."""

    params_total: int  # every parameter of the model (adapters included), counted by element
    params_trainable: int  # parameters the optimizer updates
    device: str  # e.g. "cuda:0", "cpu", "mlx:gpu", "mlx:cpu"
    dtype: str  # weight dtype of the base model, e.g. "float32", "bfloat16", "nf4"
    model_path: str  # resolved local directory of the base model
    extra: dict[str, Any] = field(default_factory=dict)


class OutOfMemory(Exception):
    """Raised by a backend when the framework reports an allocation failure it survived
    (e.g. torch.cuda.OutOfMemoryError). The loop's governor may retry with a smaller
    micro-batch."""


@dataclass(frozen=True)
class Agreement:
    """What every rank learns from one ``Comm.agree``."""

    raised: tuple[bool, ...]  # per flag, in order: whether any rank raised it
    ranks: tuple[int, ...]  # the ranks whose ``per_rank`` flag was set, ascending
    total: float  # ``total`` summed over ranks


class Comm:
    """The ranks of one run, as the loop sees them: framework-free collectives on small values.

    This one is the single process (world size 1; every collective returns its input). A
    backend started under a launcher (torchrun, ``accelerate launch``, SLURM, ``mlx.launch``)
    returns its own subclass from ``Backend.connect``, built on its framework's process group
    (torch.distributed over nccl/gloo, mx.distributed over ring/MPI). Every rank must call
    each collective in the same order; the loop does (one agreement per optimizer step, one
    gather per sampled step, one at the end).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    description: str = "one process"

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Elementwise ``op`` ("sum" | "max") of ``values`` over ranks (float64; the same
        length on every rank)."""
        return [float(v) for v in values]

    def agree(self, *flags: bool, per_rank: bool | None = None, total: float = 0.0) -> Agreement:
        """What the ranks decide together, in one all-reduce: for each of ``flags``, whether any
        rank raised it (stop, a failed write); with ``per_rank``, which ranks raised that one
        (out of memory); ``total`` summed over ranks (the step's loss). Every rank passes the
        same flags, and ``per_rank`` on every rank or on none."""
        slots = [0.0] * self.world_size if per_rank is not None else []
        if per_rank:
            slots[self.rank] = 1.0
        got = self.all_reduce([*slots, *(1.0 if f else 0.0 for f in flags), total])
        n = len(slots)
        return Agreement(raised=tuple(v > 0 for v in got[n:n + len(flags)]),
                         ranks=tuple(r for r in range(n) if got[r] > 0), total=got[-1])

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, at index = rank, on every rank."""
        return [obj]

    def barrier(self) -> None:
        """Wait until every rank is here."""

    def close(self) -> None:
        """Leave the process group (end of run)."""


@runtime_checkable
class Backend(Protocol):
    name: str  # "cuda" | "mlx"

    def connect(self, spec: RunSpec) -> Comm:
        """Join the launcher's process group when started by one (its environment says so),
        before setup(); return the ranks' Comm (``Comm()`` for one process). ``spec`` is the
        resolved run (its ``backend`` group: device, strategy, device_map). Under several
        ranks the backend keeps it: ``optimizer_step`` sums gradients over ranks first, and
        ``save_adapter``/``save_state`` write on rank 0 (or, sharded, on every rank into the
        one directory the loop names on each)."""
        ...

    def setup(self, spec: RunSpec, model_dir: Path) -> ModelInfo:
        """Load the base model from the HF-format ``model_dir``, apply the method (lora, dora,
        qlora, full), precision and gradient checkpointing, build the optimizer. ``spec`` is
        the resolved, checked run (``finetune.resolver.resolve``): the enumerated choices are
        already the backend's. Raise finetune.errors.UserError, naming the fix, for what it still
        cannot run: what only this machine, its libraries or the model directory show."""
        ...

    def forward_backward(self, batch: Batch, loss_scale: float, on_phase: PhaseHook | None = None) -> float:
        """Accumulate gradients of ``loss_sum * loss_scale``; return loss_sum (float).
        Raise OutOfMemory on a survivable allocation failure; every gradient accumulated since the
        last optimizer_step is then dropped and the loop redoes the whole step."""
        ...

    def optimizer_step(self, lr: float) -> float | None:
        """Clip (optim.max_grad_norm), step with learning rate ``lr``, zero the gradients.
        Return the pre-clip gradient norm, or None if not computed."""
        ...

    def zero_grad(self) -> None:
        """Drop accumulated gradients (the loop redoes a step after an OutOfMemory)."""
        ...

    def eval_loss(self, batch: Batch) -> float:
        """Sum of per-token loss over the batch's target positions, no gradients."""
        ...

    def save_adapter(self, path: Path | None) -> None:
        """Write the trained adapter (PEFT format on cuda, mlx-lm format on mlx) or, for
        method=full, the full weights (HF format on cuda, mlx-lm safetensors on mlx) into the
        existing empty directory ``path``. None: a rank other than 0, which writes nothing
        (a sharded run's ranks still take part in gathering the weights for rank 0)."""
        ...

    def save_state(self, path: Path) -> None:
        """Write everything needed to resume (trainable weights, optimizer state, framework
        RNG) into the existing empty directory ``path``."""
        ...

    def load_state(self, path: Path) -> None:
        """Restore what save_state wrote (after setup())."""
        ...

    def memory(self) -> MemoryReading:
        """Allocator figures in bytes, None where unmeasurable. Keys: allocated, reserved,
        peak_allocated, peak_reserved (since the last reset_peak), device_total, and any
        backend-specific extras (cuda: inactive_split, alloc_retries, num_ooms, per-device
        lists; mlx: mlx_active, mlx_cache, mlx_peak, mlx_memory_limit, mlx_cache_limit,
        mlx_wired_limit, mlx_recommended_working_set)."""
        ...

    def reset_peak(self) -> None:
        """Reset the allocator's peak counters. A backend may also offer ``peaks()``: the
        allocated/reserved/peak_allocated/peak_reserved subset of memory(), cheaper to read;
        the accountant reads it (else memory()) just before each reset."""
        ...

    def census(self) -> Census:
        """Bytes by category (finetune.records.CENSUS_KEYS, every one), from the live objects:
        frozen_weights, trainable_weights, grads, optimizer_state (allocator-held),
        optimizer_state_paged (outside the allocator, e.g. bitsandbytes paged/unified memory),
        quant_buffers."""
        ...

    def release_cache(self) -> None:
        """Return cached, unused allocator blocks to the system (torch empty_cache /
        mx.clear_cache)."""
        ...

    def set_memory_limits(self, budget_bytes: int) -> dict[str, Any]:
        """Apply a memory budget where the framework lets us (mlx: memory/cache/wired limits;
        cuda: per-process memory fraction). Return what was set, for the event log."""
        ...

    def generate(self, model_dir: Path, adapter: Path | None, prompt: Prompt, max_new_tokens: int, temperature: float,
                 seed: int, trust_remote_code: bool = False, allow_pickle: bool = False) -> str:
        """``mode=generate``: the completion of ``prompt`` (its text through the tokenizer's chat
        template where ``prompt.chat``, else as raw text) by the base in ``model_dir`` plus
        ``adapter`` (in ``Capabilities.adapter_format``), greedy at ``temperature`` 0, else sampled
        with ``seed``; it ends at the first of ``finetune.prompting.end_token_ids`` and holds no
        special token. Needs no setup(): it loads its own model with the framework's library."""
        ...

    def eval_model(self, model_dir: Path, adapter: Path | None, batch_size: int, trust_remote_code: bool = False,
                   allow_pickle: bool = False) -> Any:
        """``mode=eval``: an lm-evaluation-harness model (``lm_eval.api.model.LM``) on the base in
        ``model_dir`` plus ``adapter`` (in ``Capabilities.adapter_format``; None: the base),
        scoring ``batch_size`` sequences at a time. Needs no setup(), as ``generate``."""
        ...

    def set_cache_limit(self, limit_bytes: int) -> int:
        """Cap the bytes of freed buffers the allocator keeps for reuse; return the previous cap.
        The governor calls it only where ``Capabilities.cache_limit`` says the cap exists."""
        ...

    def set_grad_checkpointing(self, enabled: bool) -> None:
        """Turn activation recomputation on or off for the following steps."""
        ...

    def set_activation_offload(self, enabled: bool) -> str | None:
        """Move what the forward saves for backward to host memory in the following steps
        (``train.activation_offload``; the governor's lever). None when applied, else why not."""
        ...

    def offloaded_bytes(self) -> int | None:
        """Bytes the activation offload moved to the host and back since the last call (a
        step's transfer volume); None where it is off or does not apply."""
        ...

    def set_loss_chunk(self, tokens: int) -> str | None:
        """Compute the following steps' loss ``tokens`` target tokens at a time (the governor's
        lever; ``train.loss_chunk``). Returns None when applied, else why this run's loss
        cannot be chunked (a compiled loss, FSDP shards, a model whose logits are not its head
        applied to its hidden states), leaving the loss as it was."""
        ...


@runtime_checkable
class MemoryModel(Protocol):
    """A backend's memory model (``finetune/backends/<name>/memory.py``, a module; the registry's
    ``memory_model(name)`` loads it): what its framework holds for each tensor, optimizer state,
    activation and device, torch/mlx-free so ``mode=plan`` stays light. The planner
    (``finetune/planner``) prices the model description (``finetune.model.types``) and the
    resolved ``Setup`` (``finetune.model.inventory``) with exactly these names; every figure is an int
    of bytes."""

    # what the plan shows as the attention implementation (None: the config's
    # backend.attn_implementation, as transformers picks it)
    ATTENTION_LABEL: str | None
    # whether the step's backward workspace already holds the logits region (else the
    # planner adds only what exceeds the logits)
    WORKSPACE_WITH_LOGITS: bool

    # ---- the device and the run's shape ----------------------------------------------------
    def run_device(self, device: str = "auto") -> str:
        """The device a run would use for ``backend.device`` ("cuda", "cpu", "mlx:gpu", ...)."""
        ...

    def device_memory(self, device: str) -> DeviceMemory:
        """Memory of one device of the run."""
        ...

    def resolve_device(self, spec: RunSpec, mode: str, method: str) -> tuple[str, int, list[str]]:
        """(device, devices the model is split over, notes), with the runtime's refusals."""
        ...

    def ranks(self, spec: RunSpec) -> tuple[int, str]:
        """(data-parallel ranks, strategy) the plan is for, with the strategy's refusals."""
        ...

    # ---- what the backend's library refuses, before pricing --------------------------------
    def pre_quantized(self, spec: RunSpec, quant: dict[str, Any] | None) -> None:
        """Refuse a pre-quantized checkpoint the library cannot load (UserError)."""
        ...

    def check_lora_keys(self, keys: tuple[str, ...]) -> None:
        """Refuse LoRA targets the library cannot adapt (UserError)."""
        ...

    def check_model(self, hf: dict[str, Any], seq_len: int) -> None:
        """Refuse a family the library cannot load faithfully (UserError)."""
        ...

    def shard_loadable(self, arch: Any, hf: dict[str, Any], s: Any) -> bool:
        """Whether the model and setup ``s`` allow each sharded rank to load only its shard."""
        ...

    # ---- weights and adapters --------------------------------------------------------------
    def quant_of(self, s: Setup, role: str, in_f: int) -> str | None:
        """How a weight of ``role`` with ``in_f`` inputs is quantized (None: not)."""
        ...

    def quant_label(self, s: Setup) -> str | None:
        """plan.json's ``dtypes.quantized``."""
        ...

    def expert_adapters(self, lin: Linear, rank: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name suffix, shape) of each adapter tensor on a stacked expert parameter."""
        ...

    def weight_bytes(self, t: Tensor, s: Setup) -> tuple[int, int]:
        """(data bytes, quantization constants' bytes) of one parameter."""
        ...

    def rounding_bytes(self, nbytes: int, s: Setup) -> int:
        """What the allocator adds to one allocation of ``nbytes``."""
        ...

    # ---- optimizer state, gradients, activations -------------------------------------------
    def optimizer_state_bytes(self, optim: str, shape: tuple[int, ...], dtype_bytes: int, on_gpu: bool,
                              momentum: float = 0.0, host_step: bool = False) -> tuple[int, int]:
        """(allocator-held bytes, paged bytes) of one trainable tensor's optimizer state."""
        ...

    def optimizer_shared_bytes(self, s: Setup, trainable: list[Tensor]) -> int:
        """Optimizer state shared by all tensors (e.g. quantization maps)."""
        ...

    def optimizer_transient(self, s: Setup, trainable: list[Tensor]) -> int:
        """Bytes the optimizer step allocates and frees."""
        ...

    def grads_during_forward_backward(self, s: Setup, fb: int, grads: int, overlap: float) -> int:
        """The forward+backward peak with gradients growing while activations are freed."""
        ...

    def activation_pieces(self, arch: ModelDesc, s: Setup, backward_layers: int) -> dict[str, Any]:
        """The step's activations by piece (saved layers, head, workspace...)."""
        ...

    def packed_attention(self, s: Setup, arch: ModelDesc) -> str:
        """The attention path that keeps packed samples apart, in words (the one the runtime
        says it takes for this model)."""
        ...

    # a preference step (finetune/planner/preference.py): whether its log-probs take every
    # position's whole logits (no target-only head, no train.loss_chunk), where a precomputed
    # reference's table is held ("host" | "device"), and one micro-batch's no-grad reference
    # forward at the rows of ``s`` (bytes: layer, head, transient; forward_end: the step's head
    # region while it runs; with_logits: what it adds to the loss's backward peak)
    PAIR_HEAD_WHOLE: bool
    REFERENCE_TABLE_WHERE: str

    def reference_pass(self, arch: ModelDesc, s: Setup) -> dict[str, int]:
        """The reference's no-grad forward of one micro-batch of ``s``'s rows, by piece."""
        ...

    # ---- the device and several ranks ------------------------------------------------------
    def device_overhead(self, s: Setup) -> int:
        """Bytes the framework holds on the device outside its allocator (context, handles)."""
        ...

    def rank_tensors(self, tensors: list[Tensor], s: Setup) -> list[Tensor]:
        """The inventory as one rank holds it (FSDP shards)."""
        ...

    def collective_buffers(self, tensors: list[Tensor], s: Setup) -> dict[str, dict[str, Any]]:
        """The collectives' buffers per rank, by name."""
        ...

    # ---- the phases: reserved, the device level, the host -------------------------------------
    def alloc_conf(self, spec: RunSpec) -> str | None:
        """The allocator configuration the run uses (cuda: PYTORCH_CUDA_ALLOC_CONF), refused in
        one line where the framework would not parse it; None: the framework's default."""
        ...

    def device_phases(self, arch: ModelDesc, s: Setup, held: list[Tensor], assign: dict[str, int],
                      buffers: dict[str, dict[str, Any]], devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Per device (``devices``: the priced figures, allocated per phase): ``phases`` (load,
        step1, steady: allocated, reserved, device and host bytes), ``non_allocator`` (what the
        device shows beyond reserved, by name), ``step2_reserved_leap_bytes`` and ``alloc_conf``."""
        ...

    # ---- what the plan says ----------------------------------------------------------------
    def notes(self, s: Setup) -> list[str]:
        """The backend's notes for the plan."""
        ...

    def qlora_lever(self, arch: ModelDesc, s: Setup) -> dict[str, Any] | None:
        """The Setup changes of trying method=qlora instead (None: not a lever here)."""
        ...

    def device_checks(self, spec: RunSpec, s: Setup, peak_bytes: int, budget_bytes: int | None,
                      levers_under: Callable[[int], list[dict[str, Any]]] | None) -> tuple[PlanData, bool]:
        """(keys plan.json gains from what the device limits beyond the budget, whether the peak
        passes what the machine has: ``fits`` is then false). mlx: ``metal``, the peak against
        Metal's working set; ``levers_under(limit)`` gives the planner's own changes that bring the
        peak under ``limit`` bytes (None: not searched)."""
        ...

    def device_report(self, plan: Any) -> tuple[str, list[str]]:
        """(text the table's head adds after ``fits``, lines under the budget) for those keys."""
        ...


class PairBackend(Protocol):
    """What a backend adds to run a preference objective (objective=dpo|orpo|simpo;
    backends/cuda/preference.py): a micro-batch of whole pairs, interleaved (even rows chosen,
    odd rows rejected: finetune/data/pairs.py), and its share of the step's loss
    (finetune/objectives.py ``scaled_loss``)."""

    def forward_backward_pairs(self, batch: Batch, per_pair: float, per_chosen_token: float,
                               on_phase: PhaseHook | None = None) -> Any: ...

    def eval_pairs(self, batch: Batch, per_pair: float, per_chosen_token: float) -> Any: ...

    def precompute_reference(self, batches: list[Batch], samples: int) -> int: ...

    # objective=kto: rows of single labelled records, and the step's KL reference point
    def kto_kl(self, kl_rows: Batch, rows: int) -> float: ...

    def forward_backward_unpaired(self, batch: Batch, per_record: float, kl: float,
                                  on_phase: PhaseHook | None = None) -> Any: ...

    def eval_unpaired(self, batch: Batch, per_record: float, kl: float) -> Any: ...
