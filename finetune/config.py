"""Typed configuration schema.

The dataclasses here are the schema; the values live in YAML under ``conf/``. The top-level
``Config`` is registered in Hydra's ConfigStore as ``config_schema`` and ``conf/config.yaml``
lists it first in its defaults, so a misspelt key or a wrongly typed value fails at compose
time. Nothing here imports torch or mlx.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from finetune.errors import UserError

GROUPS = ("backend", "model", "method", "optim", "precision", "data", "train", "memory", "logger", "search")


@dataclass
class BackendConfig:
    name: str = field(default="auto", metadata={"help": "auto | cuda | mlx"})
    # cuda backend: "auto" picks cuda:0 when CUDA is visible, else cpu.
    device: str = "auto"
    # cuda backend: "auto" splits the model over every visible GPU (as qlora.py does); null
    # keeps it on one device.
    device_map: str | None = None
    # GPUs (or Macs) to plan for on a machine without them: with device_map=auto, one process's
    # layer split over N GPUs; without, N data-parallel ranks of backend.strategy (set to the
    # world size under torchrun / mlx.launch); null: the GPUs visible here, else 1.
    num_devices: int | None = None
    # cuda backend: "auto" (transformers' own choice for the model: sdpa, or eager where the
    # model's code needs it), "sdpa" (fused; no [B, H, T, T] scores kept), "eager" (keeps them),
    # or "flash_attention_2" (needs the flash-attn package and a CUDA GPU)
    attn_implementation: str = "auto"
    # several processes (torchrun / accelerate launch / SLURM on cuda, mlx.launch on mlx):
    # "ddp" replicates the model and sums gradients over ranks; "fsdp" (cuda) shards weights,
    # gradients and optimizer state over ranks (FSDP2 fully_shard). The planner plans per rank
    # for it when backend.num_devices > 1 without device_map=auto.
    strategy: str = "ddp"
    # cuda backend: PYTORCH_CUDA_ALLOC_CONF for the run, set before CUDA starts and planned (the
    # plan replays the step through a model of torch's caching allocator with it); null: the
    # environment's PYTORCH_CUDA_ALLOC_CONF, else "expandable_segments:True"; "" torch's default
    alloc_conf: str | None = None


@dataclass
class ModelConfig:
    """A model preset: where the weights are and the architecture numbers planning needs."""

    name: str = "tiny"
    # Hub id or local HF-format directory. null for `tiny`, which is built locally.
    path: str | None = None
    revision: str | None = None  # hub branch, tag or commit sha of model.path; null: main
    # The released config.json facts of a preset (HF key names, verbatim): planned from when the
    # hub's config.json is neither cached nor reachable. null for `tiny` (built from the fields below).
    config: Any = None
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
    # run the model repository's own Python (its modeling/tokenizer code): off unless set;
    # passed to every loader (tokenizer, config, weights)
    trust_remote_code: bool = False
    # weights from pickle files (pytorch_model.bin, *.pt) run code when loaded: refused unless
    # set; safetensors only by default
    allow_pickle: bool = False


@dataclass
class LoraConfig:
    rank: int = 8  # higher: more capacity, more trainable params and optimizer state
    alpha: float = 16.0  # scale = alpha / rank (PEFT's convention; mlx-lm takes the scale)
    dropout: float = 0.0
    # null: the model's query and value projections (q_proj, v_proj; Phi-3's fused qkv_proj);
    # a list of the model's own module names; or all-linear (every attention and MLP linear)
    keys: Any = None
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
    # adam/adamw on the cuda backend: torch's fused kernel (no workspace; HF Trainer's
    # adamw_torch_fused); false: torch's default path (foreach on a GPU: one more copy of every
    # trainable tensor during the step)
    fused: bool = True


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
    # tokenized data is cached on disk, keyed by the data file, the tokenizer and the settings
    # that change tokens, and reused by the next run and every sweep job; false: tokenize anew
    cache: bool = True
    cache_dir: str | None = None  # null: $FINETUNE_CACHE/tokens, else ~/.cache/finetune/tokens


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
    # a new run into a directory holding another run's checkpoints or result: false refuses
    # it (resume it, or choose a new hydra.run.dir); true deletes them when the run begins
    overwrite: bool = False
    # a checkpoint that cannot be written (disk full, permission): stop (exit 2, the previous
    # checkpoint kept) or continue training without it
    on_save_error: str = "stop"
    keep_checkpoints: int = 2  # newest N kept; the oldest goes only once the new one is complete
    progress: bool = True  # progress bar on stderr
    # chunked loss: logits computed and reduced this many tokens at a time inside the loss and
    # recomputed in backward, so the full [B, T, V] logits never exist; 0: off
    loss_chunk: int = 0
    # compile the step (mx.compile on mlx, torch.compile on cuda); off until it measures faster
    compile: bool = False
    # Pack samples end to end into micro-batches of train.tokens_per_micro tokens: no pad is
    # computed, positions restart at each sample and no token attends across a boundary (cuda:
    # transformers' position_ids path; mlx: a block-diagonal causal mask). The loss is the
    # unpacked one's; memory per micro-batch is set by tokens, not by the longest sample.
    packing: bool = False
    # tokens per packed micro-batch; null: train.batch_size * train.seq_len (what the unpacked
    # micro-batch holds at most). The governor lowers it under memory pressure.
    tokens_per_micro: int | None = None
    # a sample longer than tokens_per_micro (set below seq_len): truncate (its tail is dropped)
    # or split (into pieces of tokens_per_micro, each the next one's context-free start; every
    # target kept once)
    pack_overflow: str = "truncate"
    # pad each step's last packed micro-batch to tokens_per_micro too, each sample's segment up
    # to the data's longest sample (pads out of the loss; no sample's token sees one), so every
    # step has the same shape, attention and memory; the loss and gradients are unchanged, the
    # pads cost compute (backends/base.py pack_layout)
    pack_fill: bool = False


@dataclass
class MemoryConfig:
    sample_every: int = 1  # steps between memory samples
    # after step 2, forward/backward phase samples on every N-th sampled step only (1: all);
    # the optimizer-phase sample of every sampled step keeps the peaks exact
    phase_every: int = 10
    budget: str | None = None  # bytes, "40GiB", "90%" of the device; null: from the device
    adapt: bool = True  # let the governor change micro-batch / checkpointing / limits
    supervise: bool = False  # mlx: restart from the last checkpoint after an uncatchable OOM
    # mlx: bytes of freed buffers MLX keeps for reuse. "auto": after step 1, what that step
    # freed and will ask for again (its measured peak above the live bytes), so the footprint
    # stays near the peak; a size ("512MiB") fixes it; null leaves MLX's default (32 MiB).
    cache_limit: str | None = "auto"
    # release the allocator's cache (torch.cuda.empty_cache / mx.clear_cache) after every N-th
    # optimizer step (0: never): reserved falls back to what is live at each step's start, at
    # the cost of new device allocations every step (HF Trainer's torch_empty_cache_steps)
    empty_cache_every: int = 0
    # mlx: the Mac a plan's peak is judged against Metal's working set on: a JSON file of its
    # mx.device_info(), or FILE:NAME in a file of several (tests/data/mac_device_info.json);
    # null: this Mac's own, else memory.budget taken as the Mac's RAM
    device_info: str | None = None


@dataclass
class GenerateConfig:
    """mode=generate: load the base and a run's adapter and print a completion."""

    prompt: str | None = None  # the user's message, or the text to continue (see chat_template)
    adapter: str | None = None  # a run dir or adapter dir; null: the base alone
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    # true: the prompt goes through the tokenizer's chat template; false: as raw text; null: as
    # the adapter's run formatted its prompts (adapter/finetune.json), else the chat template
    # where the tokenizer has one
    chat_template: bool | None = None


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
    # Multirun: a failed job is recorded (failed.json) and the sweep goes on; true stops the
    # sweep at the first failed job. Either way the sweep exits 1 naming the failed jobs.
    fail_fast: bool = False
    # Multirun with a sweeper that optimizes (Optuna): what a job returns: tokens_per_sec
    # (maximize), val_loss or train_loss (minimize); a job whose plan exceeds memory.budget is
    # pruned before loading anything. null: jobs return their summary.
    objective: str | None = None
    mode: str = "train"  # train | plan | generate
    # Where the run writes; set from Hydra's run dir by the CLI, settable for tests.
    run_dir: str = MISSING
    extra: dict[str, Any] = field(default_factory=dict)


# backend.name is checked against the registry (finetune.backends.BACKENDS), never restated here
VALID = {
    "data.name": ("synthetic", "jsonl", "hf"),
    "train.schedule": ("constant", "linear", "cosine"),
    "train.on_save_error": ("stop", "continue"),
    "train.pack_overflow": ("truncate", "split"),
    "mode": ("train", "plan", "generate"),
}
# Checked against the chosen backend's capabilities (finetune/backends/<name>/capabilities.py),
# never against a list restated here.
BACKEND_KEYS = ("method.name", "optim.name", "precision.name", "backend.attn_implementation", "backend.strategy")


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
    chosen, _ = choose_data_group(list(overrides))  # as the CLI chooses it (finetune.cli.main)
    with initialize_config_module(config_module="finetune.conf", version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="config", overrides=chosen)
        except Exception as e:  # the one line the CLI prints for the same overrides
            line = config_error_line(e)
            if line is None:
                raise
            GlobalHydra.instance().clear()
            raise UserError(line) from e
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = str(run_dir)
    OmegaConf.set_struct(cfg, True)
    GlobalHydra.instance().clear()
    return cfg


# Every numeric key of the schema and its range: (low, high, low inclusive, high inclusive,
# None allowed). tests/test_bad_input.py sweeps this table with a value outside each range.
INF = float("inf")
RANGES: dict[str, tuple[float, float, bool, bool, bool]] = {
    "backend.num_devices": (1, INF, True, False, True),
    "model.hidden_size": (1, INF, True, False, False),
    "model.num_layers": (1, INF, True, False, False),
    "model.num_heads": (1, INF, True, False, False),
    "model.num_kv_heads": (1, INF, True, False, False),
    "model.head_dim": (1, INF, True, False, True),
    "model.intermediate_size": (1, INF, True, False, False),
    "model.vocab_size": (1, INF, True, False, False),
    "model.max_position": (1, INF, True, False, False),
    "model.rope_theta": (0, INF, False, False, False),
    "model.rms_norm_eps": (0, 1, False, False, False),
    "method.lora.rank": (1, INF, True, False, False),
    "method.lora.alpha": (0, INF, False, False, False),
    "method.lora.dropout": (0, 1, True, False, False),
    "method.quant_bits": (2, 8, True, True, False),
    "method.quant_group_size": (1, INF, True, False, False),
    "optim.lr": (0, INF, False, False, False),
    "optim.weight_decay": (0, INF, True, False, False),
    "optim.betas.0": (0, 1, True, False, False),
    "optim.betas.1": (0, 1, True, False, False),
    "optim.eps": (0, 1, False, False, False),
    "optim.momentum": (0, 1, True, False, False),
    "optim.max_grad_norm": (0, INF, False, False, True),
    "data.num_samples": (1, INF, True, False, False),
    "data.max_samples": (1, INF, True, False, True),
    "data.val_fraction": (0, 1, True, False, False),
    "data.max_val_samples": (0, INF, True, False, False),
    "train.steps": (1, INF, True, False, False),
    "train.loss_chunk": (0, INF, True, False, False),
    "train.batch_size": (1, INF, True, False, False),
    "train.grad_accum": (1, INF, True, False, False),
    "train.seq_len": (8, INF, True, False, False),
    "train.warmup_steps": (0, INF, True, False, False),
    "train.eval_every": (0, INF, True, False, False),
    "train.eval_batches": (0, INF, True, False, False),
    "train.save_every": (0, INF, True, False, False),
    "train.seed": (0, 2**32 - 1, True, True, False),
    "train.pad_multiple": (0, INF, True, False, False),
    "train.keep_checkpoints": (1, INF, True, False, False),
    "train.tokens_per_micro": (2, INF, True, False, True),
    "memory.sample_every": (0, INF, True, False, False),
    "memory.phase_every": (1, INF, True, False, False),
    "memory.empty_cache_every": (0, INF, True, False, False),
    "generate.max_new_tokens": (1, INF, True, False, False),
    "generate.temperature": (0, INF, True, False, False),
}
# why a bound is there, where it is not plain arithmetic
RANGE_HINTS = {
    "train.seq_len": "shorter leaves no room for a prompt and its answer",
    "train.seed": "seeds are 32-bit",
    "method.lora.num_layers": "-1 adapts every layer",
    "memory.sample_every": "0 turns sampling off",
    "train.eval_every": "0 turns evaluation off",
    "train.save_every": "0 saves only the final adapter",
    "train.pad_multiple": "1: no padding; 0: auto",
    "method.lora.dropout": "a probability",
    "data.val_fraction": "a fraction of the data",
}


# Free-form nodes: their keys are the user's (extra) or each logger option's own YAML.
_OPEN = ("extra",)


def schema_keys(node_type: Any) -> dict[str, Any]:
    import dataclasses
    import typing

    hints = typing.get_type_hints(node_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(node_type)}


def nearest_keys(key: str, valid: list[str]) -> str:
    import difflib

    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    shown = near or valid[:8]
    return f"{'did you mean' if near else 'valid keys'}: {', '.join(shown)}"


def schema_paths(node_type: Any = None, prefix: str = "") -> list[str]:
    """Every key of the schema as its full dotted path (``optim.lr``, ``method.lora.rank``),
    the nodes that hold others included."""
    import dataclasses

    out = []
    for name, t in schema_keys(node_type or Config).items():
        out.append(prefix + name)
        if dataclasses.is_dataclass(t):
            out += schema_paths(t, f"{prefix}{name}.")
    return out


def nearest_config_keys(full: str) -> str:
    """The schema's keys nearest an unknown ``full`` key, as full paths a user can type: the
    last part of the key against the last part of every path in the schema, so ``lr`` finds
    ``optim.lr`` and ``train.stepz`` finds ``train.steps`` (a path under the same parent ranks
    first among equals); else the keys of the nearest node that exists."""
    import difflib

    parent, _, last = full.rpartition(".")
    paths = schema_paths()
    near = [p for p in paths if p.rpartition(".")[2] == last]  # the right name under another parent
    if not near:
        scored = sorted(((difflib.SequenceMatcher(None, last, p.rpartition(".")[2]).ratio()
                          + (0.1 if p.rpartition(".")[0] == parent else 0.0), p) for p in paths), key=lambda x: -x[0])
        best = scored[0][0] if scored else 0.0
        near = [p for score, p in scored if score >= 0.65 and score >= best - 0.08][:3]
    if near:
        return f"did you mean: {', '.join(near)}"
    siblings = [p for p in paths if p.rpartition(".")[0] == parent] or [p for p in paths if "." not in p]
    return f"valid keys: {', '.join(siblings[:8])}"


def data_group_keys(name: str) -> set[str] | None:
    """The ``data.*`` keys data group ``name`` reads: those its YAML under conf/data/ sets
    (None: no such option)."""
    from importlib import resources

    import yaml

    path = resources.files("finetune.conf") / "data" / f"{name}.yaml"
    if not path.is_file():
        return None
    return set((yaml.safe_load(path.read_text()) or {}).keys())


# A hub data set id: owner/name (hf.co/datasets/<owner>/<name>), as `datasets.load_dataset` takes it
_HUB_DATASET_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def data_group_of_path(value: str) -> str:
    """The data group a ``data.path`` value names: ``hf`` for what can only be a hub data set
    id (owner/name, no such local file, no .json/.jsonl suffix) where the hf group exists, else
    ``jsonl`` (a file, or a path whose absence data=jsonl reports)."""
    path = Path(value).expanduser()
    try:
        exists = path.exists()
    except OSError:  # a name too long for the file system: not a file here
        exists = False
    if exists or {".json", ".jsonl"} & set(path.suffixes) or not _HUB_DATASET_ID.match(value):
        return "jsonl"
    return "hf" if data_group_keys("hf") is not None else "jsonl"


def choose_data_group(overrides: list[str]) -> tuple[list[str], str | None]:
    """The overrides with the data group that reads ``data.path`` added where none was chosen,
    and the line that says so (None: nothing added).

    ``finetune data.path=train.jsonl`` trains on that file (``data=jsonl``); a hub data set id
    (``data.path=openai/gsm8k``) becomes ``data=hf data.hf_name=openai/gsm8k``, and
    ``data.hf_name=...`` alone ``data=hf``. An explicit ``data=`` is left as it is: a key it
    does not read is refused by the resolver (``check_data_keys``), naming the group to
    choose. A sweep of paths gets a group only where every value names the same one."""
    given: dict[str, tuple[int, str]] = {}
    for i, arg in enumerate(overrides):
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "data":
            return overrides, None
        given.setdefault(key, (i, value))
    if "data.path" in given:
        i, value = given["data.path"]
        values = [v.strip().strip("'\"") for v in value.split(",")]
        if "(" in value or any(v in ("", "null") for v in values):  # a sweep function, or no path
            return overrides, None
        groups = {data_group_of_path(v) for v in values}
        if len(groups) != 1:
            return overrides, None
        # the group goes right after the key (Hydra's own options, --cfg job, may follow the overrides)
        if groups == {"hf"}:
            hub = overrides[i].replace("data.path=", "data.hf_name=", 1)
            return [*overrides[:i], hub, "data=hf", *overrides[i + 1:]], (
                f"data.path={value} is a hub data set id, not a local file: training on data=hf "
                f"data.hf_name={value} (type those to say so)")
        return [*overrides[:i + 1], "data=jsonl", *overrides[i + 1:]], (
            f"data.path={value}: training on that file's records, data=jsonl (type data=jsonl to say so)")
    if "data.hf_name" in given and given["data.hf_name"][1] not in ("", "null"):
        i, value = given["data.hf_name"]
        return [*overrides[:i + 1], "data=hf", *overrides[i + 1:]], (
            f"data.hf_name={value}: training on that hub data set, data=hf (type data=hf to say so)")
    return overrides, None


def logger_keys(name: str) -> set[str] | None:
    from importlib import resources

    import yaml

    path = resources.files("finetune.conf") / "logger" / f"{name}.yaml"
    if not path.is_file():
        return None
    doc = yaml.safe_load(path.read_text()) or {}
    return set((doc.get(name) or {}).keys())


def config_error_line(exc: BaseException) -> str | None:
    """One line naming the fix for a Hydra/OmegaConf composition error (an unknown key, a
    string where a number belongs, an unparsable override); None for anything else."""
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        OmegaConfBaseException,
        ValidationError,
    )

    try:
        from hydra.errors import HydraException
    except ImportError:  # pragma: no cover
        HydraException = ()  # type: ignore[assignment,misc]
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        full = str(getattr(cause, "full_key", "") or getattr(cause, "key", "") or "")
        parent, _, key = full.rpartition(".")
        if parent.startswith("logger."):  # a logger's keys are its option's YAML
            valid = sorted(logger_keys(parent.split(".")[-1]) or [])
            return f"{full} is not a config key" + (f"; {nearest_keys(key, valid)}" if valid else "")
        return f"{full} is not a config key; {nearest_config_keys(full)}"
    if isinstance(cause, ValidationError):
        full = str(getattr(cause, "full_key", "") or "")
        msg = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        want = "a value of the schema's type"
        try:
            node_type = Config
            for part in full.split("."):
                node_type = schema_keys(node_type)[part]
            wanted: dict[type | None, str] = {int: "a whole number", float: "a number", bool: "true or false"}
            args = getattr(node_type, "__args__", ())
            want = wanted.get(next((t for t in (bool, int, float) if t in (node_type, *args)), None), want)
            if type(None) in args:  # a key that may be null says so
                want = f"{want.replace(' or ', ', ')} or null"
        except (KeyError, TypeError):
            pass
        return f"{full}: {msg}; give {full} {want}"
    if isinstance(exc, (HydraException, OmegaConfBaseException)):
        first = str(exc).strip().splitlines()
        text = " ".join(ln.strip() for ln in first) if first else type(exc).__name__
        return f"{text[:300]} (see finetune --help for the keys and groups)"
    return None
