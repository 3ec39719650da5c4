"""What the planner prices and a backend's memory model reads: the resolved setup of a run
(``Setup``) and one parameter as the backend would hold it (``Tensor``). Low in the house, beside
the model description (``finetune.model.types``), so the memory models
(``finetune/backends/<name>/memory.py``) read these without importing the planner that prices
with them. The run's settings come in as a ``finetune.spec.RunSpec``: no config node is read here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from finetune.model.types import ModelDesc, first_stage

GIB = 2**30
MIB = 2**20

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Setup:
    """Everything plan() needs, resolved from the config and the machine."""

    backend: str  # cuda | mlx
    device: str  # cuda | cpu | mlx:gpu | mlx:cpu
    n_devices: int  # GPUs the model is split over (device_map=auto), else 1
    method: str
    optim: str
    precision: str
    weight_dtype: str
    adapter_dtype: str
    compute_dtype: str
    autocast: bool
    rank: int
    dropout: float
    keys: tuple[str, ...]
    lora_layers: tuple[int, ...]  # layer indices that carry adapters (all, for full)
    quant_bits: int
    quant_group: int
    quant_type: str
    double_quant: bool
    batch: int
    seq_len: int
    grad_accum: int
    ckpt: bool
    attn: str  # sdpa | eager
    momentum: float
    clip: bool
    budget_text: Any
    notes: list[str] = field(default_factory=list)
    dtype_source: str = ""  # where the stored dtype was read (precision=auto plans it)
    pre_quant: dict[str, Any] | None = None  # an MLX pre-quantized checkpoint's bits and group size
    # Data-parallel ranks of the run (backend.num_devices without device_map=auto; under a
    # launcher the loop sets it to the world size) and how they share the model
    # (backend.strategy: ddp replicates, fsdp shards). 1: one process.
    world_size: int = 1
    strategy: str = "ddp"
    # train.loss_chunk: target tokens per chunk of head + cross-entropy (0: the whole logits)
    loss_chunk: int = 0
    # cuda: the runtime passes a [B, T] padding mask only for remote-code models (right-padded
    # causal rows need none, backends/cuda/runtime.py), so only then is a [B, 1, T, T] one built
    padding_mask: bool = False
    # train.packing: one row of ``seq_len`` tokens per micro-batch (batch 1), samples kept
    # apart (cuda: sdpa per sample, transformers' [1, 1, T, T] block mask for eager; mlx:
    # attention per sample). False: ``batch`` rows of ``seq_len`` tokens.
    packed: bool = False
    # train.packing: (query, key) pairs per position of a packed row where a backend's attention
    # runs it one sample at a time: its [T, T] terms are ``seq_len x pair_span`` (the samples'
    # squares summed), at most the longest sample (cut at ``train.seq_len``). 0: the row's T.
    pair_span: int = 0
    # train.packing: the longest sample (or pad segment) of a packed row, in tokens: one
    # sample's attention is the widest a per-sample backward works on at once. 0: the row's T.
    longest_sample: int = 0
    # the share of positions that are targets (label tokens / tokens, from the data where
    # known; 1.0: every position, the bound without data). The head and its logits run on
    # target rows only (backends' target_head) unless ``target_head`` is False.
    target_fraction: float = 1.0
    target_head: bool = True
    # backend.alloc_conf (else the environment's PYTORCH_CUDA_ALLOC_CONF): the caching allocator
    # the plan replays the run's allocations through; memory.empty_cache_every
    alloc_conf: str | None = None
    empty_cache_every: int = 0
    # the padded widths of the run's first steps, from the data where the plan read it: the
    # allocator replay runs those steps at their own shapes (step 2's reserve depends on what
    # step 1 cached), then the planned width (``seq_len``); empty: every step at ``seq_len``
    step_widths: tuple[int, ...] = ()
    # train.activation_offload: what the model's body saves for backward goes to host memory
    offload: bool = False
    # backend.cpu_offload: FSDP's shards, their gradients and the optimizer state on the host
    cpu_offload: bool = False
    # the model and run allow a sharded load (cuda: each FSDP rank reads only its rows of the
    # checkpoint, never the model whole); whether one happens is the strategy's and the world's
    shard_loadable: bool = False
    fused: bool = True  # optim.fused: adam/adamw through torch's fused kernel (cuda backend)
    # objective (finetune/planner/preference.py): a preference objective's ``batch`` counts
    # pairs, each ``pair_rows`` rows of the model's batch (chosen and rejected, one forward);
    # ``reference_choice`` is objective.reference where the objective compares to a reference
    # ("auto" | "precompute"; "" none: sft, orpo, simpo); ``pairs_total`` the data's pairs where
    # read (a precomputed reference holds one fp32 log-prob a sample of each); 0: unknown
    objective: str = "sft"
    pair_rows: int = 1
    reference_choice: str = ""
    pairs_total: int = 0
    # the most positions a pair takes through the model where the backend runs each pair's
    # prompt once (mlx: memory model PAIR_PROMPT_ONCE; cuda: pair_row_each), from the data (finetune/data/pairs.py
    # pair_positions); 0: unknown, its two padded rows the bound
    pair_positions: int = 0
    # cuda: the model lets the pair step run each pair's prompt once, one row a pair
    # (backends/cuda/shared_prompt.py: sdpa or eager, no sliding window, no attention
    # soft-capping; the memory model's ``pair_row_each``), priced at the row's width
    pair_row_each: bool = False

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step and rank: the micro-batch x accumulation (the planner's
        levers change the two and keep their product)."""
        return self.batch * self.grad_accum

    @property
    def rows(self) -> int:
        """Rows of one micro-batch through the model: ``batch`` pairs of ``pair_rows`` rows."""
        return self.batch * self.pair_rows

    @property
    def reference(self) -> str | None:
        """How a preference step has its reference log-probs: "precomputed" (a table before
        step 1: method=full, or objective.reference=precompute), "adapters_off" (a no-grad
        forward with the adapters off, each micro-batch), None (no reference)."""
        if not self.reference_choice:
            return None
        return "precomputed" if self.reference_choice == "precompute" or self.method == "full" else "adapters_off"

    def head_rows(self, n: int) -> int:
        """Rows of the output head for ``n`` positions: the target rows where the head runs on
        targets only (a soft-cap or logit scale after the head runs on those rows too); every
        position where the runtime computes them all (a compiled cuda loss, FSDP shards)."""
        if not self.target_head:
            return n
        return max(1, -(-int(n * self.target_fraction * 1_000_000) // 1_000_000))

    @property
    def wd(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def ad(self) -> int:
        return DTYPE_BYTES[self.adapter_dtype]

    @property
    def a(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def adapters(self) -> bool:
        return self.method in ("lora", "dora", "qlora")

    def first_stage(self, arch: ModelDesc) -> int:
        """Stage of the block where gradients start in the lowest layer that needs them."""
        return first_stage(arch, self.keys, self.method == "full")


@dataclass
class Tensor:
    """One parameter as the backend would hold it."""

    name: str
    shape: tuple[int, ...]  # logical shape ([out, in] for Linear weights, both backends)
    layer: int | None  # decoder layer index; None for embeddings, final norm, lm_head
    role: str  # embed | lm_head | norm | linear | bias | lora_A | lora_B | dora_m
    trainable: bool
    dtype_bytes: int
    quant: str | None = None  # "bnb4" | "mlx" | None
    shards: int = 1  # ranks it is sharded over on dim 0 (FSDP), 1 = whole on every rank

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape one rank holds: ceil(dim 0 / shards) rows (FSDP2 pads every rank's
        shard to rank 0's, torch.chunk's first chunk)."""
        if self.shards <= 1 or not self.shape:
            return self.shape
        return (-(-self.shape[0] // self.shards), *self.shape[1:])

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

