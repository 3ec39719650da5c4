"""The run spec: the composed config resolved once, frozen and typed (issue 22).

``finetune.resolver.resolve(cfg, world)`` builds a ``RunSpec`` from the composed config and runs
every check on it; everything downstream (planner, memory models, runtimes, loop, governor)
reads the spec, never the config. The groups mirror the config groups (``conf/``); their values
and defaults come from the schema (``finetune/config.py``), so no field here has a default of
its own: a default stated twice drifts. Lists arrive as tuples; free-form nodes (a preset's
``model.config``, the loggers' settings, ``extra``) as plain dicts, read-only by convention.

Low in the house (it imports only the model description's types): the planner and the backends
read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from finetune.modeldesc import ModelHandle


@dataclass(frozen=True)
class BackendSpec:
    name: str  # as configured: auto | cuda | mlx
    resolved: str  # the concrete backend (auto resolved on this machine): cuda | mlx
    device: str
    device_map: str | None
    num_devices: int | None  # as configured (world.num_devices: what the run plans for)
    attn_implementation: str
    strategy: str
    alloc_conf: str | None  # backend.alloc_conf: PYTORCH_CUDA_ALLOC_CONF as configured (null: the environment's)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str | None
    revision: str | None
    config: dict[str, Any] | None  # config.json facts (HF key names): a preset's released ones, tiny's built ones
    dtype: str | None
    trust_remote_code: bool
    allow_pickle: bool


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    keys: str | tuple[str, ...] | None  # null: the model's q/v projections; all-linear; module names
    num_layers: int  # -1: every layer


@dataclass(frozen=True)
class QuantSpec:
    """method.quant_*: what qlora quantizes the base weights to."""

    bits: int
    type: str
    group_size: int
    double_quant: bool


@dataclass(frozen=True)
class MethodSpec:
    name: str  # lora | dora | qlora | full
    lora: LoraSpec
    quant: QuantSpec


@dataclass(frozen=True)
class OptimSpec:
    name: str
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    momentum: float
    max_grad_norm: float | None
    fused: bool  # adam/adamw: torch's fused kernel where it runs (cuda backend)


@dataclass(frozen=True)
class PrecisionSpec:
    name: str


@dataclass(frozen=True)
class DataSpec:
    name: str
    path: str | None
    hf_name: str | None
    hf_config: str | None
    hf_split: str
    num_samples: int
    max_samples: int | None
    val_fraction: float
    max_val_samples: int
    mask_prompt: bool
    cache: bool
    cache_dir: str | None


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    batch_size: int
    grad_accum: int
    seq_len: int
    schedule: str
    warmup_steps: int
    eval_every: int
    eval_batches: int
    save_every: int
    seed: int
    grad_checkpointing: bool
    pad_multiple: int
    resume: bool
    overwrite: bool
    on_save_error: str
    keep_checkpoints: int
    progress: bool
    loss_chunk: int
    compile: bool
    packing: bool
    tokens_per_micro: int | None
    pack_overflow: str
    pack_fill: bool

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step and rank: batch_size x grad_accum, fixed for the run (the
        one place it is computed from the config; RunState carries it from there)."""
        return self.batch_size * self.grad_accum

    @property
    def packed_tokens(self) -> int:
        """Tokens per packed micro-batch as configured: ``tokens_per_micro``, null resolved to
        ``batch_size * seq_len`` (the most an unpacked micro-batch holds); 0 when not packing."""
        if not self.packing:
            return 0
        return int(self.tokens_per_micro or self.batch_size * self.seq_len)


@dataclass(frozen=True)
class MemorySpec:
    sample_every: int
    phase_every: int
    budget: str | None
    adapt: bool
    supervise: bool
    cache_limit: str | None
    empty_cache_every: int
    device_info: str | None  # mlx: a recorded mx.device_info() to judge the peak against Metal's working set


@dataclass(frozen=True)
class GenerateSpec:
    prompt: str | None  # generate.prompt, else the top-level short form prompt=
    adapter: str | None
    max_new_tokens: int
    temperature: float
    chat_template: bool | None  # None: as the adapter's run formatted its prompts (finetune/prompting.py)


@dataclass(frozen=True)
class SweepSpec:
    isolate_jobs: bool
    fail_fast: bool
    objective: str | None


@dataclass(frozen=True)
class PathsSpec:
    run_dir: Path


@dataclass(frozen=True)
class World:
    """The processes of the run: this one's rank, how many, and the devices the plan is for."""

    rank: int = 0
    world_size: int = 1
    # accelerators this process sees (None: not asked; the memory model asks the machine)
    local_devices: int | None = None
    # devices the run plans for: backend.num_devices, or the world size under a launcher
    # (without device_map=auto); None: the machine's (resolved by the memory model)
    num_devices: int | None = None


@dataclass(frozen=True)
class RunSpec:
    mode: str  # train | plan | generate
    backend: BackendSpec
    model: ModelSpec
    method: MethodSpec
    optim: OptimSpec
    precision: PrecisionSpec
    data: DataSpec
    train: TrainSpec
    memory: MemorySpec
    loggers: dict[str, dict[str, Any]]  # chosen logger -> its settings (the logger group)
    generate: GenerateSpec
    sweep: SweepSpec
    paths: PathsSpec
    world: World
    extra: dict[str, Any]
    # the composed config as a plain dict (interpolations resolved): what loggers record as the
    # run's hyperparameters; never read for a setting
    record: dict[str, Any]
    # the model described once (mode=plan and mode=train; finetune.planner.model.describe_model),
    # located at its directory once the run has one; None where nothing described it
    model_handle: ModelHandle | None = None

    def joined(self, world: World, run_dir: Path | None = None) -> RunSpec:
        """This spec for the ranks a launcher started: ``world`` (rank, size), the run dir the
        ranks agreed on, and the devices planned for (the world size, unless device_map=auto
        splits one process over GPUs). A new spec: nothing is written into this one."""
        n = self.world.num_devices
        if world.world_size > 1 and self.backend.device_map != "auto":
            n = world.world_size
        return replace(self, world=replace(world, num_devices=n),
                       paths=replace(self.paths, run_dir=Path(run_dir) if run_dir is not None else self.paths.run_dir))
