"""Typed configuration schema.

The dataclasses here are the schema; the values live in YAML under ``conf/``. The top-level
``Config`` is registered in Hydra's ConfigStore as ``config_schema`` and ``conf/config.yaml``
lists it first in its defaults, so a misspelt key or a wrongly typed value fails at compose
time. Nothing here imports torch or mlx.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

GROUPS = ("backend", "model", "method", "optim", "precision", "data", "train", "memory", "logger", "search")


@dataclass
class BackendConfig:
    name: str = field(default="auto", metadata={"help": "auto | cuda | mlx"})
    # cuda backend: "auto" picks cuda:0 when CUDA is visible, else cpu.
    device: str = "auto"
    # cuda backend: "auto" splits the model over every visible GPU (as qlora.py does); null
    # keeps it on one device.
    device_map: str | None = None
    # cuda backend: GPUs to plan a device_map=auto split over (mode=plan on a machine without
    # them); null: the GPUs visible here, else 1.
    num_devices: int | None = None
    # cuda backend: "sdpa" (fused; no [B, H, T, T] scores kept), "eager" (keeps them), or
    # "flash_attention_2" (needs the flash-attn package and a CUDA GPU)
    attn_implementation: str = "sdpa"


@dataclass
class ModelConfig:
    """A model preset: where the weights are and the architecture numbers planning needs."""

    name: str = "tiny"
    # Hub id or local HF-format directory. null for `tiny`, which is built locally.
    path: str | None = None
    model_type: str = "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # null: hidden_size // num_heads
    intermediate_size: int = 128
    vocab_size: int = 512
    tie_embeddings: bool = True
    attn_bias: bool = True  # bias on q/k/v projections (Qwen2 has it, Llama does not)
    mlp_bias: bool = False
    max_position: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # The dtype the checkpoint stores (bfloat16 for today's hub models): precision=auto loads
    # it as stored. A local config.json's dtype/torch_dtype wins over this.
    dtype: str | None = None
    trust_remote_code: bool = False


@dataclass
class LoraConfig:
    rank: int = 8  # higher: more capacity, more trainable params and optimizer state
    alpha: float = 16.0  # scale = alpha / rank (PEFT's convention; mlx-lm takes the scale)
    dropout: float = 0.0
    keys: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    num_layers: int = -1  # adapters on the top N layers; -1 = all


@dataclass
class MethodConfig:
    name: str = "lora"  # lora | dora | qlora | full
    lora: LoraConfig = field(default_factory=LoraConfig)
    # qlora: base weights quantized to `quant_bits`. cuda: bitsandbytes NF4 (block 64);
    # mlx: affine quantization with `quant_group_size`.
    quant_bits: int = 4
    quant_type: str = "nf4"
    quant_group_size: int = 64
    double_quant: bool = True


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adamw_8bit | paged_adamw_8bit | paged_adamw | adafactor | sgd | adam
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.0  # sgd only
    max_grad_norm: float | None = 1.0  # null: no clipping


@dataclass
class PrecisionConfig:
    # auto (the checkpoint's stored dtype; LoRA/DoRA matrices fp32) | 32-true | bf16-mixed
    # (fp32 master weights, bf16 autocast) | bf16-true | 16-mixed
    name: str = "auto"


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic | jsonl | hf
    path: str | None = None  # jsonl: file path
    hf_name: str | None = None  # hf: hub data set id
    hf_config: str | None = None
    hf_split: str = "train"
    num_samples: int = 2000  # synthetic: how many samples to generate
    max_samples: int | None = None  # cap on samples read from jsonl/hf
    val_fraction: float = 0.05
    max_val_samples: int = 64
    mask_prompt: bool = True  # prompt tokens do not count in the loss


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    batch_size: int = 4  # micro-batch (samples per forward/backward)
    grad_accum: int = 1  # micro-batches per optimizer step; effective batch = product
    seq_len: int = 256  # max tokens per sample; longer ones are truncated (counted, warned)
    schedule: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 5
    eval_every: int = 25  # 0: no evaluation
    eval_batches: int = 4
    save_every: int = 0  # checkpoint cadence in steps; 0: only the final adapter
    seed: int = 0
    grad_checkpointing: bool = False
    # Pad each micro-batch so its model input is a multiple of this many tokens (capped at
    # seq_len): shapes repeat, so allocator caches reuse buffers instead of growing. 1: trim
    # to the longest sample. 0 (auto): 32 on an Apple GPU (as mlx-lm pads), 1 elsewhere
    # (benchmarks/mlx_footprint.py on CPU: padding cost 3-8% tokens/s and saved no memory
    # once memory.cache_limit=auto bounds the cache).
    pad_multiple: int = 0
    resume: bool = False  # continue from the latest checkpoint in the run dir
    progress: bool = True  # progress bar on stderr


@dataclass
class MemoryConfig:
    sample_every: int = 1  # steps between memory samples
    budget: str | None = None  # bytes, "40GiB", "90%" of the device; null: from the device
    adapt: bool = True  # let the governor change micro-batch / checkpointing / limits
    supervise: bool = False  # mlx: restart from the last checkpoint after an uncatchable OOM
    # mlx: bytes of freed buffers MLX keeps for reuse. "auto": after step 1, what that step
    # freed and will ask for again (its measured peak above the live bytes), so the footprint
    # stays near the peak; a size ("512MiB") fixes it; null leaves MLX's default (32 MiB).
    cache_limit: str | None = "auto"


@dataclass
class GenerateConfig:
    """mode=generate: load the base and a run's adapter and print a completion."""

    prompt: str | None = None  # the user's message (the chat template applies where the model has one)
    adapter: str | None = None  # a run dir or adapter dir; null: the base alone
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy


@dataclass
class Config:
    backend: BackendConfig = field(default_factory=BackendConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    # Loggers beside metrics.jsonl (always written): each chosen option of the `logger` group
    # (logger=[tensorboard,mlflow]) adds its settings under its name, e.g. logger.tensorboard.
    logger: dict[str, Any] = field(default_factory=dict)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    # mode=generate prompt="...": the same as generate.prompt (the short form users type)
    prompt: str | None = None
    # Multirun: each job in a fresh process (its own memory baseline; see finetune/sweep.py).
    isolate_jobs: bool = True
    # Multirun with a sweeper that optimizes (Optuna): what a job returns: tokens_per_sec
    # (maximize), val_loss or train_loss (minimize); a job whose plan exceeds memory.budget is
    # pruned before loading anything. null: jobs return their summary.
    objective: str | None = None
    mode: str = "train"  # train | plan | generate
    # Where the run writes; set from Hydra's run dir by the CLI, settable for tests.
    run_dir: str = MISSING
    extra: dict[str, Any] = field(default_factory=dict)


VALID = {
    "backend.name": ("auto", "cuda", "mlx"),
    "data.name": ("synthetic", "jsonl", "hf"),
    "train.schedule": ("constant", "linear", "cosine"),
    "mode": ("train", "plan", "generate"),
}
# Checked against the chosen backend's capabilities (finetune/backends/<name>/capabilities.py),
# never against a list restated here.
BACKEND_KEYS = ("method.name", "optim.name", "precision.name", "backend.attn_implementation")


def _value(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def check_backend_support(backend: str, cfg: Any) -> None:
    """Raise UserError if ``backend`` cannot run a choice in ``cfg``, naming what it can run
    (and, where another backend runs it, why this one does not)."""
    from finetune.backends import BACKENDS, capabilities

    caps = capabilities(backend)
    for dotted in BACKEND_KEYS:
        value = _value(cfg, dotted)
        allowed = caps.choices(dotted)
        if value in allowed:
            continue
        group = dotted.removesuffix(".name")
        elsewhere = [b for b in BACKENDS if b != backend and value in capabilities(b).choices(dotted)]
        if elsewhere and dotted in caps.why_not:
            raise UserError(f"{group}={value} {caps.why_not[dotted]}; {backend} supports: {', '.join(allowed)}")
        if elsewhere:
            raise UserError(f"{group}={value} is not run by backend={backend} (backend={elsewhere[0]} runs it); "
                            f"{backend} supports: {', '.join(allowed)}")
        raise UserError(f"{dotted}={value} is not valid; choose one of: {', '.join(allowed)}")


class UserError(Exception):
    """A bad input: printed as one line naming the fix, exit code 2, no traceback."""


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="config_schema", node=Config)


def compose(run_dir: Any, *overrides: str) -> Any:
    """The config `finetune OVERRIDES...` would run, composed outside the CLI (tests, scripts
    that drive finetune.cli.run in-process), with its run dir set to ``run_dir``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="finetune.conf", version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = str(run_dir)
    OmegaConf.set_struct(cfg, True)
    GlobalHydra.instance().clear()
    return cfg


def validate(cfg: Any) -> None:
    """Check enumerated choices (the backend's against its capabilities) and ranges; raise
    UserError naming the fix."""
    from finetune.backends import concrete_name

    for dotted, choices in VALID.items():
        node = _value(cfg, dotted)
        if node not in choices:
            raise UserError(f"{dotted}={node} is not valid; choose one of: {', '.join(choices)}")
    check_backend_support(concrete_name(str(cfg.backend.name)), cfg)
    t = cfg.train
    for name in ("steps", "batch_size", "grad_accum", "seq_len"):
        if getattr(t, name) < 1:
            raise UserError(f"train.{name}={getattr(t, name)} must be >= 1")
    if t.seq_len < 8:
        raise UserError(f"train.seq_len={t.seq_len} is too short; use at least 8")
    if cfg.method.lora.rank < 1:
        raise UserError(f"method.lora.rank={cfg.method.lora.rank} must be >= 1")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise UserError(f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)")
    if cfg.data.name == "jsonl" and not cfg.data.path:
        raise UserError("data=jsonl needs a file: add data.path=/path/to/train.jsonl")
    if cfg.data.name == "hf" and not cfg.data.hf_name:
        raise UserError("data=hf needs a data set: add data.hf_name=<hub id>")
    if cfg.backend.num_devices is not None and cfg.backend.num_devices < 1:
        raise UserError(f"backend.num_devices={cfg.backend.num_devices} must be >= 1 (or null: the GPUs visible)")
    if cfg.train.pad_multiple < 0:
        raise UserError(f"train.pad_multiple={cfg.train.pad_multiple} must be >= 0 (1: no padding; 0: auto)")
    if cfg.memory.sample_every < 0:
        raise UserError("memory.sample_every must be >= 0 (0 turns sampling off)")
