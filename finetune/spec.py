"""The schema and the run spec, one tree (issues 22, 32).

Each config key is one field here, stated once: its default, its one-line meaning, and what the
resolver checks (range, choices), in the field's metadata (``key``). From this tree come

- the ``RunSpec`` the resolver builds (``finetune.resolver.resolve``): frozen, typed, every check
  done; everything downstream (planner, memory models, runtimes, loop, governor) reads it, never
  the config. Lists arrive as tuples; free-form nodes (a preset's ``model.config``, the loggers'
  settings, ``extra``) as plain dicts, read-only by convention;
- the schema Hydra composes into (``finetune.config.Config``: a mutable twin of this tree, made
  from it, since OmegaConf cannot merge overrides into a frozen dataclass), and the tables its
  checks read (``finetune.config``: choices, ranges);
- ``finetune --help``, the shell completion and the README's key table (``finetune.keyhelp``).

A new key is one field in its group here, plus its line in the README's table
(``python -m finetune.keyhelp README.md`` writes it). A field's place in the config is its place
in the tree, except where its metadata says otherwise: a ``flat`` group keeps its keys in its
parent's node (``method.quant_bits`` is ``spec.method.quant.bits``, ``isolate_jobs`` is
``spec.sweep.isolate_jobs``), ``name`` gives a key's config name, and a ``derived`` field is no
key (the resolver sets it).

Low in the house (it imports only the model description's types): the planner and the backends
read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MISSING = "???"  # omegaconf.MISSING: a value the CLI fills in (run_dir, from Hydra's run dir)
INF = float("inf")
# choices=CAPABILITIES: the key's valid values are the chosen backend's
# (finetune/backends/<name>/capabilities.py), never a list restated here
CAPABILITIES = "capabilities"


def key(default: Any = None, meaning: str = "", *, factory: Any = None, ge: float | None = None,
        gt: float | None = None, le: float | None = None, lt: float | None = None, also: int | None = None,
        hint: str | None = None, choices: tuple[str, ...] | str | None = None, name: str | None = None) -> Any:
    """A config key: its default (``factory`` for a dict), its one-line meaning, and what the
    resolver checks.

    Args:
        ge, gt, le, lt: the range of a number (>=, >, <=, <); null passes where the type allows
            it. A tuple's range holds for each of its values.
        also: one value outside the range that is valid too (``method.lora.num_layers``: -1).
        hint: why a bound is there, said beside it where it is not plain arithmetic.
        choices: the values the key takes, or CAPABILITIES: the chosen backend's.
        name: the key's name in the config, where the spec calls it otherwise.
    """
    md: dict[str, Any] = {"help": meaning}
    if (ge, gt, le, lt) != (None, None, None, None):
        lo = ge if ge is not None else gt if gt is not None else -INF
        hi = le if le is not None else lt if lt is not None else INF
        md["range"] = (lo, hi, ge is not None, le is not None)
    for k, v in (("also", also), ("hint", hint), ("choices", choices), ("name", name)):
        if v is not None:
            md[k] = v
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    return field(default=default, metadata=md)


def group(node: type, meaning: str, *, flat: bool = False) -> Any:
    """A node of keys (a group); ``flat``: its keys sit in its parent's node of the config."""
    return field(default_factory=node, metadata={"help": meaning, "flat": flat})


def derived(meaning: str, default: Any = None, *, factory: Any = None) -> Any:
    """A field of the spec that is no config key: the resolver sets it."""
    md = {"help": meaning, "derived": True}
    return field(default_factory=factory, metadata=md) if factory is not None else field(default=default, metadata=md)


# mode -> what a command with it does (finetune --help lists them; the resolver checks mode against them)
MODES = {
    "train": "train, writing the adapter (or weights), metrics.jsonl, summary.json and the memory account",
    "plan": "predict memory per category for the load, step 1 and the steady state (plan.json); loads no weights",
    "generate": 'print a completion of prompt="..." from the base and a run\'s adapter (generate.adapter=RUN_DIR); '
                "no run dir",
    "eval": "lm-evaluation-harness on the base and a run's adapter (eval.adapter=RUN_DIR), side by side: eval.json "
            "and eval.md",
}

from finetune.model.types import ModelHandle


@dataclass(frozen=True)
class BackendSpec:
    """which framework runs the job, and on what device"""

    # backend.name is checked against the registry (finetune.backends.BACKENDS), never restated here
    name: str = key("auto", "the backend (backend=...): auto is mlx on Apple Silicon, cuda where a CUDA "
                    "device is visible, else cuda on CPU")
    device: str = key("auto", "cuda backend: the torch device; auto: cuda:0 where CUDA is visible, else cpu")
    device_map: str | None = key(None, "cuda backend: auto splits the model over every visible GPU (as qlora.py "
                                 "does); null keeps it on one device")
    # set to the world size under torchrun / mlx.launch; as configured (world.num_devices: what the
    # run plans for)
    num_devices: int | None = key(None, "GPUs (or Macs) to plan for: device_map=auto's layer split, else "
                                  "backend.strategy's ranks; null: those visible here, else 1", ge=1)
    # auto: sdpa, or eager where the model's code needs it (Gemma-2, gpt-oss)
    attn_implementation: str = key("auto", "cuda backend: attention kernel: auto (transformers' choice), sdpa "
                                   "(fused), eager (keeps [B, H, T, T] scores), flash_attention_2",
                                   choices=CAPABILITIES)
    # FSDP2 fully_shard; the planner plans per rank for it when backend.num_devices > 1 without device_map=auto
    strategy: str = key("ddp", "several processes: ddp replicates the model and sums gradients; fsdp (cuda) "
                        "shards weights, grads and optimizer state", choices=CAPABILITIES)
    # FSDP2 CPUOffloadPolicy: the shards live on the host, gathered to the GPU layer by layer; planned
    # on the device and on the host (backends/cuda/host_offload.py)
    cpu_offload: bool = key(False, "cuda backend with backend.strategy=fsdp (over ranks, or one process): parameters, "
                            "gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy), the optimizer "
                            "stepping on the CPU")
    # set before CUDA starts; the plan replays the step through a model of torch's caching allocator with it
    alloc_conf: str | None = key(None, "cuda backend: the run's PYTORCH_CUDA_ALLOC_CONF, planned; null: the "
                                 'environment\'s, else expandable_segments:True; "": torch\'s default')
    resolved: str = derived("the concrete backend (auto resolved on this machine): cuda | mlx", "")


@dataclass(frozen=True)
class ModelSpec:
    """a model preset: where the weights are, and its config.json facts"""

    name: str = key("tiny", "the preset (model=...)")
    path: str | None = key(None, "hub id or local HF-format directory of the weights; null for tiny (built here)")
    revision: str | None = key(None, "hub branch, tag or commit sha of model.path; null: main")
    # HF key names, verbatim: a hub preset's released config.json, tiny's own (what it is built from)
    config: dict[str, Any] | None = key(None, "the model's config.json facts: a preset's released ones, planned from "
                                        "when the hub's file is neither cached nor reachable; tiny's, which it is "
                                        "built from. model.config.KEY=VALUE sets one: tiny is built with it, a hub "
                                        "preset is planned with it, a checkpoint on disk refuses one its config.json "
                                        "contradicts")
    # bfloat16 for today's hub models
    dtype: str | None = key(None, "the dtype the checkpoint stores, which precision=auto loads; a local "
                            "config.json's dtype/torch_dtype wins")
    # passed to every loader (tokenizer, config, weights)
    trust_remote_code: bool = key(False, "run the model repository's own Python (modeling, tokenizer): only for "
                                  "a source you trust")
    allow_pickle: bool = key(False, "load pickle weights (*.bin, *.pt), which run code when loaded; false: "
                             "safetensors only")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA/DoRA adapters (method=lora, dora, qlora)"""

    rank: int = key(8, "adapter rank: more capacity, more trainable parameters and optimizer state", ge=1)
    alpha: float = key(16.0, "scale = alpha / rank (PEFT's convention; mlx-lm takes the scale)", gt=0)
    dropout: float = key(0.0, "dropout on the adapter's input", ge=0, lt=1, hint="a probability")
    # null: the model's q/v projections; all-linear; module names
    keys: str | tuple[str, ...] | None = key(None, "modules to adapt: null (q_proj, v_proj; Phi-3's qkv_proj), a "
                                             "list of the model's own names, all-linear, experts (MoE)")
    num_layers: int = key(-1, "adapt the top N layers; -1: all", ge=1, also=-1, hint="-1 adapts every layer")


@dataclass(frozen=True)
class QuantSpec:
    """method.quant_*: what qlora quantizes the base weights to."""

    # cuda: bitsandbytes NF4 (block 64); mlx: affine quantization with quant_group_size
    bits: int = key(4, "qlora: bits of the quantized base weights", ge=2, le=8, name="quant_bits")
    type: str = key("nf4", "qlora on cuda: bitsandbytes' 4-bit type (nf4 or fp4)", name="quant_type")
    group_size: int = key(64, "qlora on mlx: weights per affine quantization group", ge=1, name="quant_group_size")
    double_quant: bool = key(True, "qlora on cuda: quantize the quantization constants too")


@dataclass(frozen=True)
class MethodSpec:
    """how the model is adapted: LoRA, DoRA, QLoRA, or all weights"""

    name: str = key("lora", "the method (method=...)", choices=CAPABILITIES)  # lora | dora | qlora | full
    lora: LoraSpec = group(LoraSpec, "LoRA/DoRA adapters")
    quant: QuantSpec = group(QuantSpec, "qlora: the base weights' quantization", flat=True)


@dataclass(frozen=True)
class OptimSpec:
    """the optimizer and its settings"""

    name: str = key("adamw", "the optimizer (optim=...)", choices=CAPABILITIES)
    lr: float = key(1e-3, "peak learning rate (after warmup)", gt=0)
    weight_decay: float = key(0.0, "weight decay", ge=0)
    betas: tuple[float, float] = key((0.9, 0.999), "Adam's moment decay rates [beta1, beta2]", ge=0, lt=1)
    eps: float = key(1e-8, "Adam's epsilon (added to the denominator)", gt=0, lt=1)
    momentum: float = key(0.0, "sgd: momentum; 0: plain SGD", ge=0, lt=1)
    max_grad_norm: float | None = key(1.0, "clip the gradients' global norm to this; null: no clipping", gt=0)
    # HF Trainer's adamw_torch_fused; foreach (torch's default on a GPU) holds one more copy of
    # every trainable tensor during the step
    fused: bool = key(True, "adam/adamw on cuda: torch's fused kernel (no step workspace); false: torch's default")


@dataclass(frozen=True)
class PrecisionSpec:
    """the dtypes weights and compute run in"""

    name: str = key("auto", "precision=...: auto (the checkpoint's dtype; LoRA/DoRA fp32), 32-true, bf16-mixed "
                    "(fp32 master, bf16 autocast), bf16-true, 16-mixed", choices=CAPABILITIES)


@dataclass(frozen=True)
class DataSpec:
    """where the samples come from and how they are read"""

    name: str = key("synthetic", "the data source (data=...)", choices=("synthetic", "jsonl", "hf"))
    path: str | None = key(None, "jsonl: the file of records")
    hf_name: str | None = key(None, "hf: the hub data set id (owner/name)")
    hf_config: str | None = key(None, "hf: the data set's configuration (subset)")
    hf_split: str = key("train", "hf: the split to read")
    num_samples: int = key(2000, "synthetic: how many samples to generate", ge=1)
    max_samples: int | None = key(None, "jsonl/hf: cap on the records read; null: all", ge=1)
    val_fraction: float = key(0.05, "share of the samples held out for validation", ge=0, lt=1,
                              hint="a fraction of the data")
    max_val_samples: int = key(64, "cap on the validation samples", ge=0)
    mask_prompt: bool = key(True, "prompt tokens carry no loss (only the answer is learned)")
    # keyed by the data file, the tokenizer and the settings that change tokens
    cache: bool = key(True, "reuse tokenized data cached on disk by the last run or sweep job; false: tokenize anew")
    cache_dir: str | None = key(None, "the token cache; null: $FINETUNE_CACHE/tokens, else ~/.cache/finetune/tokens")


@dataclass(frozen=True)
class ObjectiveSpec:
    """the training objective: SFT's loss, or a preference loss over (chosen, rejected) pairs"""

    # finetune/objectives.py holds each loss, with its paper and TRL's code cited
    name: str = key("sft", "the objective (objective=...): sft (next-token loss), dpo, orpo, simpo (pairs: "
                    "prompt/chosen/rejected records), kto (unpaired prompt/completion/label records)",
                    choices=("sft", "dpo", "orpo", "simpo", "kto"))
    # sigmoid: DPO (Rafailov et al. 2023) with cDPO's label smoothing; ipo: Azar et al. 2023; hinge: SLiC
    loss_type: str = key("sigmoid", "dpo: the pair loss: sigmoid (DPO), ipo, hinge", choices=("sigmoid", "ipo", "hinge"))
    beta: float = key(0.1, "dpo, kto: the KL weight (reward scale); orpo: the odds-ratio weight (lambda); simpo: "
                      "the reward scale", gt=0)
    label_smoothing: float = key(0.0, "dpo sigmoid: the share of pairs assumed mislabelled (cDPO)", ge=0, lt=0.5,
                                 hint="at 0.5 the labels carry no information")
    gamma: float = key(0.5, "simpo: the target reward margin (TRL's simpo_gamma)", ge=0)
    # method=full: the base is what trains, so its log-probs are taken once before step 1 (TRL's
    # precompute_ref_log_probs); LoRA/DoRA/QLoRA: the base with the adapters off, every step
    reference: str = key("auto", "dpo: the reference: auto (adapters off under LoRA/DoRA/QLoRA, log-probs "
                         "precomputed before training under method=full), precompute (always precomputed)",
                         choices=("auto", "precompute"))
    # KTO (Ethayarajh et al. 2024) eq. 8: weigh the classes so that desirable_weight * desirables over
    # undesirable_weight * undesirables lies in [1, 4/3] (TRL's KTOConfig; it warns outside that range)
    desirable_weight: float = key(1.0, "kto: the weight of a desirable (label true) record's loss (lambda_D)", gt=0)
    undesirable_weight: float = key(1.0, "kto: the weight of an undesirable (label false) record's loss "
                                    "(lambda_U)", gt=0)

    @property
    def preference(self) -> bool:
        """Trains on preferences (every objective but sft): pairs, or KTO's labelled records."""
        return self.name != "sft"

    @property
    def paired(self) -> bool:
        """Trains on (chosen, rejected) pairs: dpo, orpo, simpo."""
        return self.preference and not self.unpaired

    @property
    def unpaired(self) -> bool:
        """Trains on unpaired records labelled desirable or not (KTO)."""
        return self.name == "kto"

    @property
    def needs_reference(self) -> bool:
        """DPO and KTO compare to a reference model; ORPO and SimPO need none."""
        return self.name in ("dpo", "kto")


@dataclass(frozen=True)
class TrainSpec:
    """steps, batches and the schedule"""

    steps: int = key(400, "optimizer steps", ge=1)
    batch_size: int = key(4, "micro-batch: samples per forward/backward (memory scales with it)", ge=1)
    grad_accum: int = key(1, "micro-batches per optimizer step; effective batch = batch_size * grad_accum", ge=1)
    seq_len: int = key(256, "max tokens per sample; longer ones are truncated (counted, warned)", ge=8,
                       hint="shorter leaves no room for a prompt and its answer")
    schedule: str = key("cosine", "learning-rate schedule after warmup", choices=("constant", "linear", "cosine"))
    warmup_steps: int = key(5, "steps of linear warmup to optim.lr", ge=0)
    eval_every: int = key(25, "steps between validation passes; 0: none", ge=0, hint="0 turns evaluation off")
    eval_batches: int = key(4, "validation micro-batches per pass", ge=0)
    save_every: int = key(0, "steps between checkpoints (for train.resume); 0: only the final adapter", ge=0,
                          hint="0 saves only the final adapter")
    seed: int = key(0, "random seed (data order, initialization, dropout)", ge=0, le=2**32 - 1,
                    hint="seeds are 32-bit")
    grad_checkpointing: bool = key(False, "recompute activations in backward: less memory, more compute")
    # backends/cuda/offload.py: saved tensors of the model's body (not the head's) through
    # saved_tensors_hooks, pinned on a GPU; the plan prices the device saving, the host copy
    # and the bytes moved a step
    activation_offload: bool = key(False, "move what the forward saves for backward to host memory and back (cuda): "
                                   "less device memory, host RAM and transfers each step")
    # shapes repeat, so allocator caches reuse buffers instead of growing (capped at seq_len).
    # benchmarks/mlx_footprint.py on CPU: padding cost 3-8% tokens/s and saved no memory once
    # memory.cache_limit=auto bounds the cache
    pad_multiple: int = key(0, "pad micro-batches to a multiple of N tokens; 1: trim to the longest; 0: auto (32 "
                            "on an Apple GPU, as mlx-lm, else 1)", ge=0, hint="1: no padding; 0: auto")
    resume: bool = key(False, "continue from the latest checkpoint in the run dir")
    overwrite: bool = key(False, "a new run into a dir holding another run's checkpoints or result: false refuses "
                          "it; true deletes them")
    on_save_error: str = key("stop", "a checkpoint that cannot be written (disk full): stop (exit 2, the previous "
                             "kept) or continue without it", choices=("stop", "continue"))
    keep_checkpoints: int = key(2, "newest N checkpoints kept; the oldest goes once the new one is complete", ge=1)
    progress: bool = key(True, "progress bar on stderr")
    loss_chunk: int = key(0, "chunked loss: logits this many tokens at a time, recomputed in backward (never the "
                          "full [B, T, V]); 0: off", ge=0)
    compile: bool = key(False, "compile the step (mx.compile on mlx, torch.compile on cuda); off until it measures "
                        "faster")
    # cuda: transformers' position_ids path; mlx: a block-diagonal causal mask. Memory per
    # micro-batch is set by tokens, not by the longest sample
    packing: bool = key(False, "pack samples end to end into micro-batches of tokens_per_micro tokens: no pads, no "
                        "attention across samples, the same loss")
    tokens_per_micro: int | None = key(None, "tokens per packed micro-batch (the governor lowers it under memory "
                                       "pressure); null: batch_size * seq_len", ge=2)
    pack_overflow: str = key("truncate", "a sample longer than tokens_per_micro: truncate its tail, or split it "
                             "into pieces (every target kept once)", choices=("truncate", "split"))
    # pads out of the loss, no sample's token sees one (backends/base.py pack_layout); the cost
    # is compute on the pads
    pack_fill: bool = key(False, "pad each step's last packed micro-batch to tokens_per_micro too: every step has "
                          "the same shape and memory")

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
    """memory sampling, the budget, and what the governor may change"""

    sample_every: int = key(1, "steps between memory samples; 0: off", ge=0, hint="0 turns sampling off")
    # the optimizer-phase sample of every sampled step keeps the peaks exact
    phase_every: int = key(10, "after step 2, forward/backward samples on every N-th sampled step only; 1: all",
                           ge=1)
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
    empty_cache_every: int = key(0, "release the allocator's cache after every N-th optimizer step; 0: never", ge=0)
    # mlx: a recorded mx.device_info() to judge the peak against Metal's working set;
    # tests/data/mac_device_info.json holds several; null: memory.budget taken as the Mac's RAM off a Mac
    device_info: str | None = key(None, "mlx plan: a Mac's mx.device_info() JSON (FILE or FILE:NAME) to judge the "
                                  "peak against; null: this Mac's")


@dataclass(frozen=True)
class GenerateSpec:
    """mode=generate: load the base and a run's adapter and print a completion."""

    # the spec's: generate.prompt, else the top-level short form prompt=
    prompt: str | None = key(None, "the user's message, or the text to continue (see generate.chat_template)")
    adapter: str | None = key(None, "a run dir or adapter dir; null: the base model alone")
    max_new_tokens: int = key(64, "tokens to generate at most", ge=1)
    temperature: float = key(0.0, "sampling temperature; 0: greedy", ge=0)
    # None: as the adapter's run formatted its prompts (finetune/prompting.py)
    chat_template: bool | None = key(None, "true: the prompt goes through the tokenizer's chat template; false: raw "
                                     "text; null: as the adapter's run formatted its prompts (adapter/finetune.json), "
                                     "else the chat template where the tokenizer has one")


@dataclass(frozen=True)
class EvalSpec:
    """lm-evaluation-harness: mode=eval, and after training where eval.tasks is set (finetune/evaluate.py)"""

    # any name lm-eval knows (its data from the hub, as lm-eval reads it), the local tasks
    # finetune ships (finetune/evaluate.py LOCAL_TASKS, over eval.path), or your own YAML's
    tasks: tuple[str, ...] = key((), "lm-eval tasks: gsm8k_local / gsm8k_local_ppl (over eval.path), any lm-eval "
                                 "task name (data from the hub), or your own (eval.include_path); on a train run: "
                                 "evaluate the final adapter too")
    adapter: str | None = key(None, "mode=eval: a run dir or adapter dir evaluated beside the base; null: the base "
                              "alone")
    path: str | None = key(None, "the JSONL the local tasks read (gsm8k_local: GSM8K's question/answer records)")
    include_path: str | None = key(None, "a folder of your own lm-eval task YAMLs (lm_eval --include_path)")
    # lm-eval's --limit: an integer counts documents, a value below 1 is a share of them
    limit: float | None = key(None, "documents per task (lm_eval --limit; below 1: a share); null: all", gt=0)
    num_fewshot: int | None = key(None, "few-shot examples per prompt; null: the task's own (gsm8k_local: 5)", ge=0)
    max_gen_toks: int | None = key(None, "generation tasks: new tokens at most; null: the task's own (lm-eval: 256)",
                                   ge=1)
    batch_size: int = key(1, "sequences per forward pass (lm_eval --batch_size)", ge=1)
    chat_template: bool = key(False, "prompts through the tokenizer's chat template (lm_eval --apply_chat_template)")
    # lm-eval's default; a metric with a closed-form stderr (a mean) needs none
    bootstrap_iters: int = key(100000, "resamples for the stderr of metrics without a closed form (perplexity); 0: "
                               "no stderr", ge=0)


@dataclass(frozen=True)
class SweepSpec:
    """a multirun's settings (top-level keys)"""

    # see finetune/sweep.py
    isolate_jobs: bool = key(True, "multirun: each job in a fresh process (its own memory baseline)")
    # either way the sweep exits 1 naming the failed jobs
    fail_fast: bool = key(False, "multirun: stop the sweep at the first failed job; false: record it (failed.json) "
                          "and go on")
    # a job whose plan exceeds memory.budget is pruned before loading anything
    search_objective: str | None = key(None, "multirun with Optuna: what a job returns (maximized or minimized): "
                                       "tokens_per_sec, val_loss, train_loss, or eval:TASK/METRIC (an eval.tasks "
                                       "metric of the adapter); null: its summary")


@dataclass(frozen=True)
class PathsSpec:
    """where the run writes (a top-level key)"""

    # set from Hydra's run dir by the CLI, settable for tests
    run_dir: Path = key(MISSING, "where the run writes (hydra.run.dir sets it)")


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
    """the mode, the loggers, a sweep's settings and keys of your own

    The root of the tree: its keys are the config's top level (this line titles them in
    ``finetune --help``).
    """

    backend: BackendSpec = group(BackendSpec, "which framework runs the job")
    model: ModelSpec = group(ModelSpec, "the model")
    method: MethodSpec = group(MethodSpec, "how the model is adapted")
    optim: OptimSpec = group(OptimSpec, "the optimizer")
    precision: PrecisionSpec = group(PrecisionSpec, "dtypes")
    data: DataSpec = group(DataSpec, "the samples")
    objective: ObjectiveSpec = group(ObjectiveSpec, "the training objective (sft, dpo, orpo, simpo, kto)")
    train: TrainSpec = group(TrainSpec, "the training loop")
    memory: MemorySpec = group(MemorySpec, "memory accounting and the governor")
    # chosen logger -> its settings: each chosen option of the `logger` group
    # (logger=[tensorboard,mlflow]) adds its settings under its name, e.g. logger.tensorboard; its
    # keys are its YAML's (conf/logger/)
    loggers: dict[str, dict[str, Any]] = key(
        meaning="loggers beside metrics.jsonl (always written), chosen with logger=[...]; each one's keys sit under "
                "its name (logger.wandb.mode)", factory=dict, name="logger")
    generate: GenerateSpec = group(GenerateSpec, "mode=generate")
    prompt: str | None = key(None, "mode=generate: the same as generate.prompt (the short form)")
    eval: EvalSpec = group(EvalSpec, "lm-evaluation-harness (mode=eval, or after training)")
    sweep: SweepSpec = group(SweepSpec, "a multirun's settings", flat=True)
    mode: str = key("train", "what the command does (finetune --help lists the modes)", choices=tuple(MODES))
    paths: PathsSpec = group(PathsSpec, "where the run writes", flat=True)
    extra: dict[str, Any] = key(meaning="keys of your own (+extra.NAME=VALUE), recorded with the run", factory=dict)
    world: World = derived("the processes of the run (rank, size) and the devices planned for", factory=World)
    # the composed config as a plain dict (interpolations resolved): what loggers record as the
    # run's hyperparameters; never read for a setting
    record: dict[str, Any] = derived("the composed config, as recorded with the run", factory=dict)
    # the model described once (mode=plan and mode=train; finetune.planner.setup.describe_model),
    # located at its directory once the run has one; None where nothing described it
    model_handle: ModelHandle | None = derived("the model described once, where the run described it")

    def joined(self, world: World, run_dir: Path | None = None) -> RunSpec:
        """This spec for the ranks a launcher started: ``world`` (rank, size), the run dir the
        ranks agreed on, and the devices planned for (the world size, unless device_map=auto
        splits one process over GPUs). A new spec: nothing is written into this one."""
        n = self.world.num_devices
        if world.world_size > 1 and self.backend.device_map != "auto":
            n = world.world_size
        return replace(self, world=replace(world, num_devices=n),
                       paths=replace(self.paths, run_dir=Path(run_dir) if run_dir is not None else self.paths.run_dir))
