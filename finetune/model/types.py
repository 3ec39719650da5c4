"""The model description's types: every weight of a checkpoint with its shape, kind and stage
(``ModelDesc``, ``Block``, ``Linear``). ``finetune.model.describe`` builds one from a
checkpoint's ``config.json``; the planner, both runtimes, both memory models and the config checks
read it. It sits low in the house (it imports nothing of the project's) so a backend's memory model
can read it without importing the planner that prices with that memory model.

No torch, no mlx: ``mode=plan`` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Forward order of the parts of a decoder block (the "stage" of a weight): a stage before the
# first adapted weight of the lowest adapted layer computes nothing that needs a gradient, so
# autograd (and mlx's vjp) keep nothing for it.
STAGE_NORM1, STAGE_ATTN_IN, STAGE_ATTN_OUT, STAGE_NORM2, STAGE_MLP_IN, STAGE_MLP_OUT = range(6)


@dataclass(frozen=True)
class Linear:
    """One matrix of a block: an ``nn.Linear`` (experts == 1) or a stacked expert parameter
    ``[experts, out, in]`` (transformers 5's fused MoE experts).

    ``key`` is the name a user gives in ``method.lora.keys`` (the module's own name, as PEFT's
    ``target_modules`` matches it); ``path`` is where it sits inside the block.
    """

    key: str
    path: str
    in_f: int
    out_f: int
    bias: bool
    kind: str  # attention | mlp | router | expert
    stage: int
    experts: int = 1
    # False where transformers keeps the matrix as a bare parameter of its own module, not an
    # nn.Linear (transformers 5's MoE TopK routers): bitsandbytes, which swaps nn.Linear only,
    # leaves it unquantized under qlora. Qwen2-MoE's shared_expert_gate is an nn.Linear (a router
    # by kind) and is quantized.
    module: bool = True

    @property
    def numel(self) -> int:
        return self.experts * self.in_f * self.out_f


@dataclass(frozen=True)
class Block:
    """One decoder layer: its matrices in forward order, its other weights (norms, sinks,
    expert biases: path -> shape), and what its forward does."""

    linears: tuple[Linear, ...]
    # (path, shape, kind: norm | bias | sinks, stage it runs after, width of its input per token)
    others: tuple[tuple[str, tuple[int, ...], str, float, int], ...]
    moe: bool = False
    sliding: bool = False

    def norms(self) -> tuple[tuple[float, int], ...]:
        """(stage, input width per token) of each norm of the block, in forward order."""
        return tuple(sorted((st, w) for _, _, kind, st, w in self.others if kind == "norm"))

    def group(self, stage: int) -> tuple[Linear, ...]:
        return tuple(lin for lin in self.linears if lin.stage == stage)

    def get(self, key: str) -> Linear | None:
        return next((lin for lin in self.linears if lin.key == key), None)

    @property
    def mlp_width(self) -> int:
        """The width of the MLP's hidden activation for one token (an expert's for MoE)."""
        outs = self.group(STAGE_MLP_OUT)
        if self.moe:
            outs = tuple(lin for lin in outs if lin.experts > 1)
        return max((lin.in_f for lin in outs), default=0)

    @property
    def shared_width(self) -> int:
        """An MoE block's shared expert (Qwen2-MoE's ``mlp.shared_expert``, a gated MLP every
        token runs beside its routed experts): its hidden width per token; 0 where there is none."""
        if not self.moe:
            return 0
        return max((lin.in_f for lin in self.group(STAGE_MLP_OUT) if lin.experts == 1), default=0)


@dataclass(frozen=True)
class ModelDesc:
    """What a checkpoint is, for pricing and for choosing what to adapt."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie: bool
    blocks: tuple[Block, ...]
    # top-level weights besides embeddings and head: path -> shape (final norm and its bias)
    top: tuple[tuple[str, tuple[int, ...], str, float, int], ...]
    experts: int = 0  # 0: dense
    top_k: int = 0
    gated_mlp: bool = True
    mlp_act: str = "silu"
    norm: str = "rms"  # rms | layer (LayerNorm with bias)
    qk_norm: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    attn_default: str = "sdpa"  # what transformers picks when the user leaves it to it
    fused_qkv: bool = False
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    # False: a family finetune does not describe exactly, priced as a Llama-style decoder from its
    # sizes (its notes say so; the runtimes check its blocks have the LoRA targets it resolved)
    described: bool = True

    # ---- the figures activations are priced with ---------------------------------------------
    @property
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def intermediate(self) -> int:
        """The widest MLP activation per token: a dense MLP's width, or top-k experts' widths."""
        return max(b.mlp_width * (self.top_k if b.moe else 1) for b in self.blocks)

    def weight_elements(self) -> int:
        """Elements of every weight the description lists (embeddings, the head once unless tied,
        every block's matrices, biases and other weights, the top-level ones): what a checkpoint
        of it holds."""
        import math

        total = self.vocab * self.hidden * (1 if self.tie else 2)
        for b in self.blocks:
            total += sum(lin.numel + (lin.out_f * lin.experts if lin.bias else 0) for lin in b.linears)
            total += sum(math.prod(shape) for _, shape, _, _, _ in b.others)
        return total + sum(math.prod(shape) for _, shape, _, _, _ in self.top)

    def linear_keys(self) -> tuple[str, ...]:
        """Every adaptable key of the blocks, in forward order."""
        seen: dict[str, None] = {}
        for b in self.blocks:
            for lin in b.linears:
                seen.setdefault(lin.key, None)
        return tuple(seen)

    def summary(self) -> dict[str, Any]:
        """The plan.json ``model`` section's architecture facts."""
        b0 = self.blocks[0]
        q = b0.get("q_proj") or b0.get("qkv_proj")
        return {"model_type": self.model_type, "hidden": self.hidden, "layers": self.layers, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "intermediate": self.intermediate,
                "vocab": self.vocab, "tie": self.tie, "qkv_bias": bool(q and q.bias),
                "o_bias": bool(b0.get("o_proj") and b0.get("o_proj").bias),  # type: ignore[union-attr]
                "mlp_bias": any(lin.bias for lin in b0.linears if lin.kind == "mlp"),
                "experts": self.experts, "top_k": self.top_k, "moe_layers": sum(b.moe for b in self.blocks),
                "gated_mlp": self.gated_mlp, "fused_qkv": self.fused_qkv, "qk_norm": self.qk_norm,
                "attn_softcap": self.attn_softcap, "final_softcap": self.final_softcap,
                "sliding_window": self.sliding_window, "source": self.source}



@dataclass(frozen=True)
class ModelHandle:
    """The model of one run, described once (``finetune.planner.setup.describe_model``) and
    handed to the planner, the governor, both runtimes, the checkpointer and calibration on the
    run spec (``RunSpec.model_handle``): nobody reads config.json again.

    Built by the resolver before any download, from the checkpoint's own config.json where this
    machine has it (a local directory, the hub cache), else the preset's released facts; once
    the model's directory is known (downloaded, or the tiny model built) the loop locates it
    there (``locate_model``), describing again only where that directory's config.json is not
    the one described."""

    desc: ModelDesc
    config: dict[str, Any]  # the config.json described (a what-if's overrides applied)
    config_path: str | None  # that file (the tiny model: where it is built); None: a preset's facts
    stored_dtype: tuple[str, str]  # the dtype the checkpoint stores, and where that was read
    quantization: dict[str, Any] | None  # an MLX pre-quantized checkpoint's block, or None
    # the checkpoint's tensors (their elements, and where read) where its safetensors headers
    # were read: only for a family not described exactly (finetune.model.describe.reconcile)
    elements: tuple[int, str] | None = None
    # model.config facts set over a hub checkpoint's config.json: the plan is a what-if, and a
    # run (which trains the checkpoint as it is) refuses it
    overridden: tuple[str, ...] = ()
    directory: str | None = None  # the model's directory, once resolved

def first_stage(desc: ModelDesc, keys: tuple[str, ...], full: bool) -> int:
    """Stage of the block where gradients start in the lowest layer that needs them."""
    if full:
        return STAGE_NORM1
    # the head alone (lm_head): no block computes anything that needs a gradient
    return min((lin.stage for b in desc.blocks for lin in b.linears if lin.key in keys), default=STAGE_MLP_OUT + 1)
