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


def key(default: Any = None, meaning: str = "", *, factory: Any = None) -> Any:
    """A schema field with its one-line meaning in ``metadata["help"]``: ``finetune --help``, the
    shell completion and the README's key table read it from here (finetune.keyhelp)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": meaning})
    return field(default=default, metadata={"help": meaning})


@dataclass
class BackendConfig:
    """which framework runs the job, and on what device"""

    name: str = key("auto", "the backend (backend=...): auto is mlx on Apple Silicon, cuda where a CUDA "
                    "device is visible, else cuda on CPU")
    device: str = key("auto", "cuda backend: the torch device; auto: cuda:0 where CUDA is visible, else cpu")
    device_map: str | None = key(None, "cuda backend: auto splits the model over every visible GPU (as qlora.py "
                                 "does); null keeps it on one device")
    # set to the world size under torchrun / mlx.launch
    num_devices: int | None = key(None, "GPUs (or Macs) to plan for: device_map=auto's layer split, else "
                                  "backend.strategy's ranks; null: those visible here, else 1")
    # auto: sdpa, or eager where the model's code needs it (Gemma-2, gpt-oss)
    attn_implementation: str = key("auto", "cuda backend: attention kernel: auto (transformers' choice), sdpa "
                                   "(fused), eager (keeps [B, H, T, T] scores), flash_attention_2")
    # FSDP2 fully_shard; the planner plans per rank for it when backend.num_devices > 1 without device_map=auto
    strategy: str = key("ddp", "several processes: ddp replicates the model and sums gradients; fsdp (cuda) "
                        "shards weights, grads and optimizer state")
    # set before CUDA starts; the plan replays the step through a model of torch's caching allocator with it
    alloc_conf: str | None = key(None, "cuda backend: the run's PYTORCH_CUDA_ALLOC_CONF, planned; null: the "
                                 'environment\'s, else expandable_segments:True; "": torch\'s default')


@dataclass
class ModelConfig:
    """a model preset: where the weights are, and its config.json facts"""

    name: str = key("tiny", "the preset (model=...)")
    path: str | None = key(None, "hub id or local HF-format directory of the weights; null for tiny (built here)")
    revision: str | None = key(None, "hub branch, tag or commit sha of model.path; null: main")
    # HF key names, verbatim: a hub preset's released config.json, tiny's own (what it is built from)
    config: Any = key(None, "the model's config.json facts: a preset's released ones, planned from when the hub's "
                      "file is neither cached nor reachable; tiny's, which it is built from. "
                      "model.config.KEY=VALUE sets one: tiny is built with it, a hub preset is planned with it, a "
                      "checkpoint on disk refuses one its config.json contradicts")
    # bfloat16 for today's hub models
    dtype: str | None = key(None, "the dtype the checkpoint stores, which precision=auto loads; a local "
                            "config.json's dtype/torch_dtype wins")
    # passed to every loader (tokenizer, config, weights)
    trust_remote_code: bool = key(False, "run the model repository's own Python (modeling, tokenizer): only for "
                                  "a source you trust")
    allow_pickle: bool = key(False, "load pickle weights (*.bin, *.pt), which run code when loaded; false: "
                             "safetensors only")


@dataclass
class LoraConfig:
    """LoRA/DoRA adapters (method=lora, dora, qlora)"""

    rank: int = key(8, "adapter rank: more capacity, more trainable parameters and optimizer state")
    alpha: float = key(16.0, "scale = alpha / rank (PEFT's convention; mlx-lm takes the scale)")
    dropout: float = key(0.0, "dropout on the adapter's input")
    keys: Any = key(None, "modules to adapt: null (q_proj, v_proj; Phi-3's qkv_proj), a list of the model's own "
                    "names, all-linear, experts (MoE)")
    num_layers: int = key(-1, "adapt the top N layers; -1: all")


@dataclass
class MethodConfig:
    """how the model is adapted: LoRA, DoRA, QLoRA, or all weights"""

    name: str = key("lora", "the method (method=...)")
    lora: LoraConfig = key(meaning="LoRA/DoRA adapters", factory=LoraConfig)
    # cuda: bitsandbytes NF4 (block 64); mlx: affine quantization with quant_group_size
    quant_bits: int = key(4, "qlora: bits of the quantized base weights")
    quant_type: str = key("nf4", "qlora on cuda: bitsandbytes' 4-bit type (nf4 or fp4)")
    quant_group_size: int = key(64, "qlora on mlx: weights per affine quantization group")
    double_quant: bool = key(True, "qlora on cuda: quantize the quantization constants too")


@dataclass
class OptimConfig:
    """the optimizer and its settings"""

    name: str = key("adamw", "the optimizer (optim=...)")
    lr: float = key(1e-3, "peak learning rate (after warmup)")
    weight_decay: float = key(0.0, "weight decay")
    betas: list[float] = key(meaning="Adam's moment decay rates [beta1, beta2]", factory=lambda: [0.9, 0.999])
    eps: float = key(1e-8, "Adam's epsilon (added to the denominator)")
    momentum: float = key(0.0, "sgd: momentum; 0: plain SGD")
    max_grad_norm: float | None = key(1.0, "clip the gradients' global norm to this; null: no clipping")
    # HF Trainer's adamw_torch_fused; foreach (torch's default on a GPU) holds one more copy of
    # every trainable tensor during the step
    fused: bool = key(True, "adam/adamw on cuda: torch's fused kernel (no step workspace); false: torch's default")


@dataclass
class PrecisionConfig:
    """the dtypes weights and compute run in"""

    name: str = key("auto", "precision=...: auto (the checkpoint's dtype; LoRA/DoRA fp32), 32-true, bf16-mixed "
                    "(fp32 master, bf16 autocast), bf16-true, 16-mixed")


@dataclass
class DataConfig:
    """where the samples come from and how they are read"""

    name: str = key("synthetic", "the data source (data=...)")
    path: str | None = key(None, "jsonl: the file of records")
    hf_name: str | None = key(None, "hf: the hub data set id (owner/name)")
    hf_config: str | None = key(None, "hf: the data set's configuration (subset)")
    hf_split: str = key("train", "hf: the split to read")
    num_samples: int = key(2000, "synthetic: how many samples to generate")
    max_samples: int | None = key(None, "jsonl/hf: cap on the records read; null: all")
    val_fraction: float = key(0.05, "share of the samples held out for validation")
    max_val_samples: int = key(64, "cap on the validation samples")
    mask_prompt: bool = key(True, "prompt tokens carry no loss (only the answer is learned)")
    # keyed by the data file, the tokenizer and the settings that change tokens
    cache: bool = key(True, "reuse tokenized data cached on disk by the last run or sweep job; false: tokenize anew")
    cache_dir: str | None = key(None, "the token cache; null: $FINETUNE_CACHE/tokens, else ~/.cache/finetune/tokens")


@dataclass
class TrainConfig:
    """steps, batches and the schedule"""

    steps: int = key(400, "optimizer steps")
    batch_size: int = key(4, "micro-batch: samples per forward/backward (memory scales with it)")
    grad_accum: int = key(1, "micro-batches per optimizer step; effective batch = batch_size * grad_accum")
    seq_len: int = key(256, "max tokens per sample; longer ones are truncated (counted, warned)")
    schedule: str = key("cosine", "learning-rate schedule after warmup")
    warmup_steps: int = key(5, "steps of linear warmup to optim.lr")
    eval_every: int = key(25, "steps between validation passes; 0: none")
    eval_batches: int = key(4, "validation micro-batches per pass")
    save_every: int = key(0, "steps between checkpoints (for train.resume); 0: only the final adapter")
    seed: int = key(0, "random seed (data order, initialization, dropout)")
    grad_checkpointing: bool = key(False, "recompute activations in backward: less memory, more compute")
    # shapes repeat, so allocator caches reuse buffers instead of growing (capped at seq_len).
    # benchmarks/mlx_footprint.py on CPU: padding cost 3-8% tokens/s and saved no memory once
    # memory.cache_limit=auto bounds the cache
    pad_multiple: int = key(0, "pad micro-batches to a multiple of N tokens; 1: trim to the longest; 0: auto (32 "
                            "on an Apple GPU, as mlx-lm, else 1)")
    resume: bool = key(False, "continue from the latest checkpoint in the run dir")
    overwrite: bool = key(False, "a new run into a dir holding another run's checkpoints or result: false refuses "
                          "it; true deletes them")
    on_save_error: str = key("stop", "a checkpoint that cannot be written (disk full): stop (exit 2, the previous "
                             "kept) or continue without it")
    keep_checkpoints: int = key(2, "newest N checkpoints kept; the oldest goes once the new one is complete")
    progress: bool = key(True, "progress bar on stderr")
    loss_chunk: int = key(0, "chunked loss: logits this many tokens at a time, recomputed in backward (never the "
                          "full [B, T, V]); 0: off")
    compile: bool = key(False, "compile the step (mx.compile on mlx, torch.compile on cuda); off until it measures "
                        "faster")
    # cuda: transformers' position_ids path; mlx: a block-diagonal causal mask. Memory per
    # micro-batch is set by tokens, not by the longest sample
    packing: bool = key(False, "pack samples end to end into micro-batches of tokens_per_micro tokens: no pads, no "
                        "attention across samples, the same loss")
    tokens_per_micro: int | None = key(None, "tokens per packed micro-batch (the governor lowers it under memory "
                                       "pressure); null: batch_size * seq_len")
    pack_overflow: str = key("truncate", "a sample longer than tokens_per_micro: truncate its tail, or split it "
                             "into pieces (every target kept once)")
    # pads out of the loss, no sample's token sees one (backends/base.py pack_layout); the cost
    # is compute on the pads
    pack_fill: bool = key(False, "pad each step's last packed micro-batch to tokens_per_micro too: every step has "
                          "the same shape and memory")


@dataclass
class MemoryConfig:
    """memory sampling, the budget, and what the governor may change"""

    sample_every: int = key(1, "steps between memory samples; 0: off")
    # the optimizer-phase sample of every sampled step keeps the peaks exact
    phase_every: int = key(10, "after step 2, forward/backward samples on every N-th sampled step only; 1: all")
    budget: str | None = key(None, "memory per device: bytes, a size (40GiB) or a share (90%); null: the device's "
                             "own")
    adapt: bool = key(True, "let the governor lower the micro-batch, checkpoint, chunk the loss or set limits")
    supervise: bool = key(False, "mlx: restart from the last checkpoint after an uncatchable OOM")
    # auto: after step 1, what that step freed and will ask for again (its measured peak above
    # the live bytes), so the footprint stays near the peak
    cache_limit: str | None = key("auto", "mlx: freed bytes kept for reuse: auto (what step 1 freed), a size "
                                  "(512MiB), null (MLX's 32 MiB)")
    # reserved falls back to what is live at each step's start, at the cost of new device
    # allocations every step (HF Trainer's torch_empty_cache_steps)
    empty_cache_every: int = key(0, "release the allocator's cache after every N-th optimizer step; 0: never")
    # tests/data/mac_device_info.json holds several; null: memory.budget taken as the Mac's RAM off a Mac
    device_info: str | None = key(None, "mlx plan: a Mac's mx.device_info() JSON (FILE or FILE:NAME) to judge the "
                                  "peak against; null: this Mac's")


@dataclass
class GenerateConfig:
    """mode=generate: load the base and a run's adapter and print a completion."""

    prompt: str | None = key(None, "the user's message, or the text to continue (see generate.chat_template)")
    adapter: str | None = key(None, "a run dir or adapter dir; null: the base model alone")
    max_new_tokens: int = key(64, "tokens to generate at most")
    temperature: float = key(0.0, "sampling temperature; 0: greedy")
    chat_template: bool | None = key(None, "true: the prompt goes through the tokenizer's chat template; false: raw "
                                     "text; null: as the adapter's run formatted its prompts (adapter/finetune.json), "
                                     "else the chat template where the tokenizer has one")


# mode -> what a command with it does (finetune --help lists them; the resolver checks mode against them)
MODES = {
    "train": "train, writing the adapter (or weights), metrics.jsonl, summary.json and the memory account",
    "plan": "predict memory per category for the load, step 1 and the steady state (plan.json); loads no weights",
    "generate": 'print a completion of prompt="..." from the base and a run\'s adapter (generate.adapter=RUN_DIR); '
                "no run dir",
}


@dataclass
class Config:
    """the mode, the loggers, a sweep's settings and keys of your own"""

    backend: BackendConfig = key(meaning="which framework runs the job", factory=BackendConfig)
    model: ModelConfig = key(meaning="the model", factory=ModelConfig)
    method: MethodConfig = key(meaning="how the model is adapted", factory=MethodConfig)
    optim: OptimConfig = key(meaning="the optimizer", factory=OptimConfig)
    precision: PrecisionConfig = key(meaning="dtypes", factory=PrecisionConfig)
    data: DataConfig = key(meaning="the samples", factory=DataConfig)
    train: TrainConfig = key(meaning="the training loop", factory=TrainConfig)
    memory: MemoryConfig = key(meaning="memory accounting and the governor", factory=MemoryConfig)
    # each chosen option of the `logger` group (logger=[tensorboard,mlflow]) adds its settings
    # under its name, e.g. logger.tensorboard; its keys are its YAML's (conf/logger/)
    logger: dict[str, Any] = key(meaning="loggers beside metrics.jsonl (always written), chosen with logger=[...]; "
                                 "each one's keys sit under its name (logger.wandb.mode)", factory=dict)
    generate: GenerateConfig = key(meaning="mode=generate", factory=GenerateConfig)
    prompt: str | None = key(None, "mode=generate: the same as generate.prompt (the short form)")
    # see finetune/sweep.py
    isolate_jobs: bool = key(True, "multirun: each job in a fresh process (its own memory baseline)")
    # either way the sweep exits 1 naming the failed jobs
    fail_fast: bool = key(False, "multirun: stop the sweep at the first failed job; false: record it (failed.json) "
                          "and go on")
    # a job whose plan exceeds memory.budget is pruned before loading anything
    objective: str | None = key(None, "multirun with Optuna: what a job returns (maximized or minimized); null: "
                                "its summary")
    mode: str = key("train", "what the command does (finetune --help lists the modes)")
    # set from Hydra's run dir by the CLI, settable for tests
    run_dir: str = key(MISSING, "where the run writes (hydra.run.dir sets it)")
    extra: dict[str, Any] = key(meaning="keys of your own (+extra.NAME=VALUE), recorded with the run", factory=dict)


# backend.name is checked against the registry (finetune.backends.BACKENDS), never restated here
VALID = {
    "data.name": ("synthetic", "jsonl", "hf"),
    "train.schedule": ("constant", "linear", "cosine"),
    "train.on_save_error": ("stop", "continue"),
    "train.pack_overflow": ("truncate", "split"),
    "mode": tuple(MODES),
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
# config.json facts of model.config checked where the config has them (a preset's, tiny's, a
# user's override): what the 14 architecture keys beside config: had (issue 32), in HF's names
CONFIG_FACT_RANGES: dict[str, tuple[float, float, bool, bool, bool]] = {
    "model.config.hidden_size": (1, INF, True, False, False),
    "model.config.num_hidden_layers": (1, INF, True, False, False),
    "model.config.num_attention_heads": (1, INF, True, False, False),
    "model.config.num_key_value_heads": (1, INF, True, False, False),
    "model.config.head_dim": (1, INF, True, False, True),
    "model.config.intermediate_size": (1, INF, True, False, False),
    "model.config.vocab_size": (1, INF, True, False, False),
    "model.config.max_position_embeddings": (1, INF, True, False, False),
    "model.config.rope_theta": (0, INF, False, False, False),
    "model.config.rms_norm_eps": (0, 1, False, False, False),
}
# The keys a preset stated beside config: until issue 32, and where the fact is now: a user
# typing the old key is told the new one
MOVED_KEYS = {f"model.{old}": f"model.config.{new}" for old, new in (
    ("model_type", "model_type"), ("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
    ("intermediate_size", "intermediate_size"), ("vocab_size", "vocab_size"),
    ("tie_embeddings", "tie_word_embeddings"), ("attn_bias", "attention_bias"), ("mlp_bias", "mlp_bias"),
    ("max_position", "max_position_embeddings"), ("rope_theta", "rope_theta"), ("rms_norm_eps", "rms_norm_eps"))}
# keys whose valid values are no one interval (checked by the resolver's check_ranges)
RANGE_TEXT = {"method.lora.num_layers": ">= 1 or -1"}
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


def range_text(dotted: str) -> str | None:
    """The valid values of numeric key ``dotted`` as a user reads them (">= 1", "in [0, 1)"),
    from RANGES (or RANGE_TEXT); None for a key without a range."""
    if dotted in RANGE_TEXT:
        return RANGE_TEXT[dotted]
    if dotted not in RANGES and dotted not in CONFIG_FACT_RANGES:
        return None
    lo, hi, lo_in, hi_in, _ = RANGES.get(dotted) or CONFIG_FACT_RANGES[dotted]
    def num(x: float) -> str:  # 2**32 - 1 in full, not 4.29497e+09
        return str(int(x)) if float(x).is_integer() else f"{x:g}"

    if hi == INF:
        return f">= {num(lo)}" if lo_in else f"> {num(lo)}"
    return f"in {'[' if lo_in else '('}{num(lo)}, {num(hi)}{']' if hi_in else ')'}"


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

    if full in MOVED_KEYS:  # a preset's architecture key of old: now its config.json fact
        return f"did you mean: {MOVED_KEYS[full]}"
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


def group_options(group: str) -> list[str]:
    """Options of a config group, from the YAML files installed with the package."""
    from importlib import resources

    root = resources.files("finetune.conf") / group
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


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
