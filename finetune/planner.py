"""Predict a run's memory from the config alone: no weights loaded, no torch, no mlx.

``plan(cfg)`` builds the parameter inventory the backends would build (every tensor, its
shape, dtype, whether it trains, how it is quantized), then prices each mechanism that holds
memory during a step:

- weights by dtype; 4-bit NF4 (bitsandbytes) or affine (mlx) quantization with its constants;
- LoRA/DoRA adapters exactly per adapted Linear and layer;
- gradients for trainable tensors only;
- optimizer state per optimizer and per tensor (bitsandbytes' small-tensor and paging rules);
- activations kept for backward, per layer that needs gradients, by attention implementation
  and gradient checkpointing; logits and the loss at full vocabulary;
- framework overheads (CUDA context, allocator rounding).

Every figure is an int of bytes. The mechanisms cite the libraries' code they model (file and
function, versions: torch 2.13, transformers 5.24, peft 0.21, bitsandbytes 0.50, accelerate
1.15, mlx 0.32, mlx-lm 0.32). Where a number is calibrated rather than derived it says so.

Public API: ``plan``, ``format_table``, ``run_plan``, ``trainable_params``, ``parse_budget``,
``fit_to_budget`` (+ ``FitResult``), ``plan_error``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.budget import apple_silicon, cuda_devices, device_memory, parse_budget, run_device
from finetune.config import UserError, check_backend_support

__all__ = ["FitResult", "fit_to_budget", "format_table", "params_total", "parse_budget", "plan", "plan_error",
           "run_plan", "trainable_params"]

SCHEMA_VERSION = 1
GIB = 2**30
MIB = 2**20

# The Linear layers of a decoder block, in forward order, and the "stage" of the block they
# belong to. A stage before the first adapted Linear of the lowest adapted layer computes
# nothing that needs a gradient, so autograd (and mlx's vjp) keep nothing for it.
BLOCK_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_STAGE = {"norm1": 0, "q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "norm2": 3,
          "gate_proj": 4, "up_proj": 4, "down_proj": 5}
_BLOCK_PATHS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# bitsandbytes 0.50 constants (bitsandbytes/functional.py quantize_4bit: default blocksize 64;
# compress_statistics -> quantize_blockwise(absmax, blocksize=256); optim/optimizer.py
# Optimizer2State.init_state: 8-bit state blocksize 256, min_8bit_size 4096;
# Optimizer8bit.get_state_buffer: paged only when numel >= 1e5).
BNB_4BIT_BLOCK = 64
BNB_NESTED_BLOCK = 256
BNB_4BIT_CODE_BYTES = 16 * 4  # QuantState.code: the 16-entry fp32 NF4/FP4 table, one per weight
BNB_NESTED_CODE_BYTES = 256 * 4  # state2.code: a copy of the 256-entry dynamic map (copy=True)
BNB_OPT_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_PAGED_MIN_NUMEL = 100_000
BNB_QMAPS_BYTES = 2 * 256 * 4  # name2qmap["dynamic"] and ["udynamic"], shared by every 8-bit state

CUDA_CONTEXT_BYTES = 500 * MIB  # estimate: CUDA context + cuBLAS/cuDNN handles, outside torch's allocator
CUDA_ALLOC_ROUND = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: every block is a multiple of 512 B

# mlx calibration (mlx 0.32 on CPU with backends/mlx.py, fp32 and bf16, hidden 128-512, 1-4
# layers, vocab 512-8192, batch 1-4, 32-256 tokens): bytes of the step's transient workspace
# beyond the arrays kept for backward, in units of n*h, n*f and B*H*T*T elements of the
# activation dtype; and of logits+loss per n*V. Fitted within ~10% of mx.get_peak_memory.
MLX_TRANSIENT_NH = 3.0
MLX_TRANSIENT_NF = 6.0
MLX_TRANSIENT_NF_QUANT = 2.0  # extra with quantized (QuantizedLinear) base layers
MLX_TRANSIENT_TT = 1.5
# With gradient checkpointing (mlx_lm.tuner.trainer.grad_checkpoint -> mx.checkpoint around each
# block), mlx keeps only each block's input and recomputes the block in its vjp. The peak stays
# in the logits region (measured: the same 16 B per n*V slope with and without checkpointing,
# 0.5-4k vocab), and there, beyond the saved inputs and the transient above, mlx holds only part
# of one recomputed block (0.35-0.75 of _mlx_layer's bytes), not all of it: forward and backward
# are one lazily evaluated graph, so the top block's recompute overlaps the logits' backward
# rather than following it as in torch. Calibrated on mlx 0.32
# CPU fp32 (hidden 64/256, 2/4 layers, vocab 512-2048, batch 1-16, 64-256 tokens, LoRA on all or
# the top layer; mx.get_peak_memory of forward+backward), in the same units as MLX_TRANSIENT_*:
# within ~7% of the measured step peak above the weights.
MLX_CKPT_RECOMPUTE_NH = 0.8
MLX_CKPT_RECOMPUTE_NF = 2.4
MLX_CKPT_RECOMPUTE_TT = 0.8
# When the only layer with gradients is the lowest adapted one (method.lora.num_layers=1 and
# adapters only), its backward needs no gradient for the layer's input, and mlx's vjp prunes
# that path: the [B, H, T, T]-sized workspace is smaller by this factor. Calibrated without
# checkpointing from benchmarks/plan_vs_measured.py (tiny, T=256, batch 4 and 16: measured
# peaks were 0.57 * B * H * T^2 * dtype below the full-workspace prediction).
MLX_LOWEST_ONLY_TT_SAVING = 0.57
MLX_LOGITS_PER_NV = 16  # fp32 logits kept + logsumexp/softmax/scatter cotangents (measured slope: 4 x 4 B)
MLX_LOGITS_PER_NV_HALF = 4  # extra with bf16 weights: the bf16 logits and their cotangent
# Full fine-tuning: gradients grow while activations are freed, layer by layer, so the peak of
# forward+backward is below activations + gradients. Measured (mlx) ~ max + half of min.
GRAD_ACTIVATION_OVERLAP = 0.5


# ---- config access --------------------------------------------------------------------------

def _get(node: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a DictConfig, dict or dataclass; ``default`` only when it is absent.
    (DictConfig.keys is a method, so a field named ``keys`` must be read as an item.)"""
    if node is None:
        return default
    if hasattr(node, "__getitem__") and hasattr(node, "__contains__") and not isinstance(node, (list, tuple, str)):
        try:
            return node[key] if key in node else default
        except Exception:  # a missing (???) or interpolation error value
            return default
    return getattr(node, key, default)


def _seq(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


# ---- architecture -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    """The architecture numbers planning needs (a Llama/Qwen2-style decoder)."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    source: str  # "preset" or the config.json path

    @property
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """Block Linear name -> (in_features, out_features, has_bias), as the HF modules
        (transformers models/qwen2|llama/modeling_*.py Attention and MLP __init__)."""
        h, f = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_out, self.qkv_bias),
            "k_proj": (h, self.kv_out, self.qkv_bias),
            "v_proj": (h, self.kv_out, self.qkv_bias),
            "o_proj": (self.q_out, h, self.o_bias),
            "gate_proj": (h, f, self.mlp_bias),
            "up_proj": (h, f, self.mlp_bias),
            "down_proj": (f, h, self.mlp_bias),
        }


def arch_from_cfg(model_cfg: Any) -> Arch:
    """Architecture from the model preset, or from ``config.json`` when ``model.path`` is a
    local directory holding one (its numbers win)."""
    m = model_cfg
    num = {
        "model_type": str(_get(m, "model_type", "qwen2")),
        "hidden": int(_get(m, "hidden_size")),
        "layers": int(_get(m, "num_layers")),
        "heads": int(_get(m, "num_heads")),
        "kv_heads": int(_get(m, "num_kv_heads") or _get(m, "num_heads")),
        "head_dim": _get(m, "head_dim"),
        "intermediate": int(_get(m, "intermediate_size")),
        "vocab": int(_get(m, "vocab_size")),
        "tie": bool(_get(m, "tie_embeddings", False)),
        "attn_bias": bool(_get(m, "attn_bias", False)),
        "mlp_bias": bool(_get(m, "mlp_bias", False)),
    }
    source = "preset"
    path = _get(m, "path")
    if path:
        cj = Path(str(path)).expanduser() / "config.json"
        if cj.is_file():
            try:
                hf = json.loads(cj.read_text())
            except (OSError, ValueError) as e:
                raise UserError(f"model.path={path}: config.json is unreadable ({e})") from None
            hf = hf.get("text_config", hf) if "hidden_size" not in hf else hf
            mapping = {"hidden_size": "hidden", "num_hidden_layers": "layers", "num_attention_heads": "heads",
                       "num_key_value_heads": "kv_heads", "intermediate_size": "intermediate",
                       "vocab_size": "vocab", "model_type": "model_type", "head_dim": "head_dim"}
            for k, ours in mapping.items():
                if hf.get(k) is not None:
                    num[ours] = hf[k]
            # Absent keys take the config classes' defaults (LlamaConfig / Qwen2Config:
            # tie_word_embeddings=False, attention_bias=False, mlp_bias=False), not the preset's.
            num["tie"] = bool(hf.get("tie_word_embeddings", False))
            num["attn_bias"] = bool(hf.get("attention_bias", False))
            num["mlp_bias"] = bool(hf.get("mlp_bias", False))
            if num["model_type"] == "qwen2":
                num["attn_bias"] = True  # Qwen2Attention: q/k/v always have a bias, o_proj never
            source = str(cj)
    heads = int(num["heads"])
    head_dim = int(num["head_dim"] or int(num["hidden"]) // heads)
    qwen = num["model_type"] == "qwen2"
    return Arch(
        model_type=str(num["model_type"]), hidden=int(num["hidden"]), layers=int(num["layers"]), heads=heads,
        kv_heads=int(num["kv_heads"]), head_dim=head_dim, intermediate=int(num["intermediate"]),
        vocab=int(num["vocab"]), tie=bool(num["tie"]), qkv_bias=bool(num["attn_bias"]),
        # LlamaAttention puts config.attention_bias on o_proj too; Qwen2Attention never does.
        o_bias=bool(num["attn_bias"]) and not qwen, mlp_bias=bool(num["mlp_bias"]), source=source,
    )


# ---- the resolved setup -----------------------------------------------------------------------

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


def _resolve_backend(name: str) -> str:
    if name in ("cuda", "mlx"):
        return name
    if name != "auto":
        raise UserError(f"backend.name={name} is not valid; choose one of: auto, cuda, mlx")
    # As backends.resolve_backend_name, without importing torch: NVML answers "is there a GPU".
    if apple_silicon():
        return "mlx"
    return "cuda"


def _block_keys(keys: list[str]) -> tuple[str, ...]:
    """Map PEFT-style (``q_proj``) or mlx-lm-style (``self_attn.q_proj``) keys to block Linears."""
    out: list[str] = []
    for k in keys:
        short = str(k).rsplit(".", 1)[-1]
        if short not in BLOCK_KEYS:
            raise UserError(f"method.lora.keys: {k} is not a linear layer of a block; "
                            f"choose from: {', '.join(BLOCK_KEYS)}")
        if short not in out:
            out.append(short)
    if not out:
        raise UserError(f"method.lora.keys is empty; choose from: {', '.join(BLOCK_KEYS)}")
    return tuple(sorted(out, key=BLOCK_KEYS.index))


def resolve(cfg: Any, seq_len: int | None = None) -> tuple[Arch, Setup]:
    """Resolve the config (and the machine, for backend=auto and the GPU count) into an
    architecture and a setup. Raises UserError for a combination the backend would refuse."""
    arch = arch_from_cfg(_get(cfg, "model"))
    b = _get(cfg, "backend")
    backend = _resolve_backend(str(_get(b, "name", "auto")))
    m, o, t = _get(cfg, "method"), _get(cfg, "optim"), _get(cfg, "train")
    method, optim = str(_get(m, "name", "lora")), str(_get(o, "name", "adamw"))
    precision = str(_get(_get(cfg, "precision"), "name", "32-true"))
    if method not in ("lora", "dora", "qlora", "full"):
        raise UserError(f"method={method} is not valid; choose one of: lora, dora, qlora, full")
    notes: list[str] = []
    from finetune import precision as prec_mod
    from finetune.model_source import stored_dtype, stored_quantization

    model_cfg = _get(cfg, "model")
    stored, dtype_source = stored_dtype(model_cfg)
    pre_quant = stored_quantization(model_cfg)
    mode = str(_get(cfg, "mode", "train") or "train")
    n_wanted = _get(b, "num_devices")
    if backend == "mlx":
        check_backend_support("mlx", cfg)  # the same refusal the backend gives at setup
        device = run_device("mlx")
        n_devices = 1
        autocast = False
        if precision not in prec_mod.MLX:
            raise UserError(f"precision={precision} is not valid; choose one of: {', '.join(prec_mod.MLX)}")
    else:
        if precision not in prec_mod.CUDA:
            raise UserError(f"precision={precision} is not valid; choose one of: {', '.join(prec_mod.CUDA)}")
        if pre_quant:
            raise UserError(f"model.path={_get(model_cfg, 'path')} is MLX-quantized ({pre_quant['bits']}-bit, "
                            "config.json 'quantization'), which transformers cannot load; use backend=mlx, "
                            "or the unquantized checkpoint with method=qlora")
        want_device = str(_get(b, "device", "auto"))
        count, _ = cuda_devices()
        if mode == "plan" and str(_get(b, "name", "auto")) == "cuda" and want_device == "auto":
            # Planning a CUDA job for a target machine: backend=cuda means a GPU whether or not
            # this one has one (backend.device=cpu plans the CPU run).
            device = "cuda"
        else:
            device = run_device("cuda", want_device)
        split = _get(b, "device_map") == "auto" and device == "cuda"
        # backend.num_devices plans a split over N GPUs this machine need not have.
        n_devices = (int(n_wanted) if n_wanted else max(count, 1)) if split else 1
        if split and count == 0 and not n_wanted:
            notes.append("backend.device_map=auto: no GPU visible here, planned for 1 device "
                         "(set backend.num_devices=N to plan a split over N GPUs)")
        bits, qtype = int(_get(m, "quant_bits", 4)), str(_get(m, "quant_type", "nf4"))
        if method == "qlora" and (bits != 4 or qtype not in ("nf4", "fp4")):
            raise UserError("method=qlora on backend=cuda quantizes to 4 bits as nf4 or fp4; "
                            "set method.quant_bits=4 method.quant_type=nf4")
    # backends/cuda.py and backends/mlx.py load with these same dtypes (finetune/precision.py)
    dt = prec_mod.resolve(backend, precision, method, stored)
    weight_dtype, adapter_dtype, compute_dtype = dt.weights, dt.adapters, dt.compute
    autocast = dt.autocast is not None
    if dt.note:
        notes.append(dt.note)
    if precision == "auto":
        notes.append(f"precision=auto: the checkpoint stores {stored} ({dtype_source}); weights {weight_dtype}"
                     + (f", adapters {adapter_dtype}" if method in ("lora", "dora", "qlora") else ""))
    lc = _get(m, "lora")
    keys = _block_keys(_seq(_get(lc, "keys", ["q_proj", "v_proj"])))
    n = int(_get(lc, "num_layers", -1))
    L = arch.layers
    if method == "full" or n <= 0 or n >= L:
        # PEFT layers_to_transform=None and mlx-lm linear_to_lora_layers(model.layers[-max(n, 0):])
        # both adapt every layer for n <= 0 (mlx: -1 -> layers[0:]).
        layers = tuple(range(L))
        if method != "full" and n > L:
            notes.append(f"method.lora.num_layers={n} exceeds the model's {L} layers (mlx refuses it)")
    else:
        layers = tuple(range(L - n, L))
    T = int(seq_len) if seq_len else int(_get(t, "seq_len", 256))
    attn = str(_get(_get(cfg, "backend"), "attn_implementation", None) or "sdpa")
    if attn not in ("sdpa", "eager", "flash_attention_2"):
        raise UserError(f"backend.attn_implementation={attn} is not valid; "
                        "choose one of: sdpa, eager, flash_attention_2")
    setup = Setup(
        backend=backend, device=device, n_devices=n_devices, method=method, optim=optim, precision=precision,
        weight_dtype=weight_dtype, adapter_dtype=adapter_dtype, compute_dtype=compute_dtype, autocast=autocast,
        rank=int(_get(lc, "rank", 8)), dropout=float(_get(lc, "dropout", 0.0)), keys=keys, lora_layers=layers,
        quant_bits=int(_get(m, "quant_bits", 4)), quant_group=int(_get(m, "quant_group_size", 64)),
        quant_type=str(_get(m, "quant_type", "nf4")), double_quant=bool(_get(m, "double_quant", True)),
        batch=int(_get(t, "batch_size", 1)), seq_len=T, grad_accum=int(_get(t, "grad_accum", 1)),
        ckpt=bool(_get(t, "grad_checkpointing", False)), attn="sdpa" if attn == "flash_attention_2" else attn,
        momentum=float(_get(o, "momentum", 0.0) or 0.0), clip=_get(o, "max_grad_norm", 1.0) is not None,
        budget_text=_get(_get(cfg, "memory"), "budget"), notes=notes, dtype_source=dtype_source,
        pre_quant=pre_quant if backend == "mlx" else None,
    )
    if setup.pre_quant:
        # the checkpoint's own quantization, as mlx_lm.load rebuilds it (QuantizedLinear /
        # QuantizedEmbedding); method=qlora quantizes nothing more
        setup.quant_bits, setup.quant_group = setup.pre_quant["bits"], setup.pre_quant["group_size"]
        notes.append(f"model is pre-quantized ({setup.pre_quant['bits']}-bit, group {setup.pre_quant['group_size']}, "
                     f"from {setup.pre_quant['source']}): LoRA trains on the quantized base")
    return arch, setup


# ---- the parameter inventory -------------------------------------------------------------------

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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def bnb4_bytes(numel: int, double_quant: bool, blocksize: int = BNB_4BIT_BLOCK) -> tuple[int, int]:
    """(packed weight bytes, quantization-constant bytes) of one bitsandbytes 4-bit weight.

    bitsandbytes/functional.py quantize_4bit: two 4-bit codes per uint8 (quant_storage=uint8);
    one fp32 absmax per ``blocksize`` elements; with compress_statistics (double quant) the
    absmax are themselves quantize_blockwise'd to uint8 in blocks of 256 (state2: fp32 absmax
    per 256 blocks + a copy of the 256-entry fp32 code) and centred by a 0-d fp32 offset. Each
    QuantState also holds the 16-entry fp32 NF4/FP4 code.
    """
    packed = (numel + 1) // 2
    blocks = -(-numel // blocksize)
    if double_quant:
        consts = blocks + (-(-blocks // BNB_NESTED_BLOCK)) * 4 + BNB_NESTED_CODE_BYTES + 4
    else:
        consts = blocks * 4
    return packed, consts + BNB_4BIT_CODE_BYTES


def mlx_quant_bytes(out_f: int, in_f: int, bits: int, group: int, scale_bytes: int) -> tuple[int, int]:
    """(packed weight bytes, scales+biases bytes) of one mlx affine-quantized matrix.

    mlx.core.quantize (mode "affine"): ``bits`` per element packed into uint32 words along the
    last axis, plus a scale and a bias per ``group`` elements in the weight's dtype
    (mlx/nn/layers/quantized.py QuantizedLinear/QuantizedEmbedding keep weight, scales, biases).
    """
    packed = out_f * (in_f * bits // 32) * 4
    return packed, 2 * out_f * (in_f // group) * scale_bytes


def inventory(arch: Arch, s: Setup) -> list[Tensor]:
    """Every parameter the backend would create, with what trains and how it is stored.

    Mirrors: transformers Qwen2/Llama ForCausalLM (embed_tokens, per layer q/k/v/o, gate/up/down,
    two RMSNorms; final norm; lm_head unless tied), PEFT LoraLayer.update_layer (lora_A
    [r, in], lora_B [out, r], no bias; DoRA: lora_magnitude_vector [out]), mlx-lm
    tuner/lora.py LoRALinear (lora_a [in, r], lora_b [r, out]) and tuner/dora.py DoRALinear
    (m [out]); counts are identical, shapes transposed.
    """
    full = s.method == "full"
    wd, ad = s.wd, s.ad
    h, V = arch.hidden, arch.vocab
    adapted = set(s.lora_layers) if s.adapters else set()
    qlora = s.method == "qlora" or s.pre_quant is not None
    out: list[Tensor] = []

    def quant_of(role: str, in_f: int) -> str | None:
        if not qlora:
            return None
        if s.backend == "cuda":
            # transformers integrations/bitsandbytes.py replace_with_bnb_linear: only nn.Linear,
            # minus get_keys_to_not_convert (lm_head / tied output embeddings).
            return "bnb4" if role == "linear" else None
        # mlx: nn.quantize with class_predicate hasattr(m, "to_quantized") and width % group == 0
        # (backends/mlx.py, as mlx_lm.utils.quantize_model): Linear *and* Embedding, lm_head too.
        if role in ("linear", "embed", "lm_head") and in_f % s.quant_group == 0:
            return "mlx"
        return None

    out.append(Tensor("model.embed_tokens.weight", (V, h), None, "embed", full, wd, quant_of("embed", h)))
    for i in range(arch.layers):
        p = f"model.layers.{i}."
        out.append(Tensor(p + "input_layernorm.weight", (h,), i, "norm", full, wd))
        out.append(Tensor(p + "post_attention_layernorm.weight", (h,), i, "norm", full, wd))
        for key, (in_f, out_f, bias) in arch.linears().items():
            base = f"{p}{_BLOCK_PATHS[key]}.{key}"
            out.append(Tensor(base + ".weight", (out_f, in_f), i, "linear", full, wd, quant_of("linear", in_f)))
            if bias:
                out.append(Tensor(base + ".bias", (out_f,), i, "bias", full, wd))
            if i in adapted and key in s.keys:
                out.append(Tensor(base + ".lora_A", (s.rank, in_f), i, "lora_A", True, ad))
                out.append(Tensor(base + ".lora_B", (out_f, s.rank), i, "lora_B", True, ad))
                if s.method == "dora":
                    # mlx DoRALinear.set_linear: m = norm(weight.astype(float32)) -> fp32, then
                    # set_dtype for bf16-true; PEFT: same dtype as the other adapter weights.
                    out.append(Tensor(base + ".magnitude", (out_f,), i, "dora_m", True, ad))
    out.append(Tensor("model.norm.weight", (h,), None, "norm", full, wd))
    if not arch.tie:
        out.append(Tensor("lm_head.weight", (V, h), None, "lm_head", full, wd, quant_of("lm_head", h)))
    return out


def _weight_bytes(t: Tensor, s: Setup) -> tuple[int, int]:
    """(bytes of the tensor itself, bytes of its quantization constants)."""
    if t.quant == "bnb4":
        return bnb4_bytes(t.numel, s.double_quant)
    if t.quant == "mlx":
        return mlx_quant_bytes(t.shape[0], t.shape[1], s.quant_bits, s.quant_group, s.wd)
    return t.numel * t.dtype_bytes, 0


# ---- optimizer state ----------------------------------------------------------------------------

def optimizer_state_bytes(optim: str, backend: str, shape: tuple[int, ...], dtype_bytes: int,
                          on_gpu: bool, momentum: float = 0.0, host_step: bool = False) -> tuple[int, int]:
    """(allocator-held bytes, paged bytes) of one trainable tensor's optimizer state.

    Args:
        optim: adamw | adam | adamw_8bit | paged_adamw_8bit | paged_adamw | adafactor | sgd.
        backend: cuda | mlx.
        shape: the parameter's shape.
        dtype_bytes: the parameter's element size.
        on_gpu: bitsandbytes pages state only on CUDA (on CPU get_state_buffer falls back).
        momentum: sgd momentum.
        host_step: torch keeps Adam's per-tensor ``step`` on the host; when the parameters are
            on the CPU too, that 4-byte scalar sits beside them (count it).
    """
    n = math.prod(shape)
    if optim in ("adamw", "adam"):
        # torch/optim/adam.py Adam._init_group: exp_avg, exp_avg_sq = zeros_like(p) (param dtype);
        # `step` is a host scalar unless capturable/fused. mlx/optimizers Adam.init_single: m, v
        # = zeros_like(parameter).
        return 2 * n * dtype_bytes + (4 if backend == "cuda" and host_step else 0), 0
    if optim == "sgd":
        # torch/optim/sgd.py: momentum_buffer = clone(grad) only when momentum != 0.
        # mlx/optimizers SGD.init_single: state["v"] = zeros_like(parameter), even at momentum 0.
        if backend == "mlx" or momentum:
            return n * dtype_bytes, 0
        return 0, 0
    if optim == "adafactor":
        factored = len(shape) >= 2
        if backend == "mlx":
            # mlx/optimizers Adafactor.init_single: exp_avg_sq_row shape[:-1], _col shape[:-2]+
            # shape[-1:] in the parameter's dtype; 1-D: exp_avg_sq = zeros_like; beta_1=None.
            elems = (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if factored else n
            return elems * dtype_bytes, 0
        # transformers/optimization.py Adafactor.step: grad.float() for 16-bit params, state
        # .to(grad) -> fp32; factored: exp_avg_sq_row [rows] + exp_avg_sq_col [cols]; beta1=None:
        # no exp_avg; state["RMS"] = self._rms(p) is a 0-d fp32 tensor on the parameter's device.
        elems = (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if factored else n
        return elems * 4 + 4, 0
    if optim in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw"):
        paged = optim.startswith("paged") and on_gpu and n >= BNB_PAGED_MIN_NUMEL
        eight = optim != "paged_adamw" and n >= BNB_MIN_8BIT_SIZE
        if eight:
            # Optimizer2State.init_state: state1/state2 uint8 (get_state_buffer: paged if big)
            # + absmax1/absmax2 fp32 per 256-element block (never paged).
            states = 2 * n
            absmax = 2 * (-(-n // BNB_OPT_BLOCK)) * 4
            return (absmax, states) if paged else (absmax + states, 0)
        # numel < min_8bit_size (or 32-bit paged AdamW): fp32 state1/state2 whatever the param dtype.
        states = 2 * n * 4
        return (0, states) if paged else (states, 0)
    raise UserError(f"optim={optim} is not valid; choose one of: adamw, adam, adamw_8bit, "
                    "paged_adamw_8bit, paged_adamw, adafactor, sgd")


def _optimizer_transient(s: Setup, trainable: list[Tensor]) -> int:
    """Workspace the optimizer step allocates on top of weights, grads and state."""
    if not trainable:
        return 0
    largest = max(t.numel * t.dtype_bytes for t in trainable)
    if s.backend == "mlx":
        # backends/mlx.py optimizer_step: optim.clip_grad_norm builds a clipped copy of the
        # gradient tree, then Optimizer.update's lazy graph (new m, v, p per parameter) is
        # evaluated at once. Calibrated on mlx 0.32 CPU, full fine-tuning of 2-8 layer models
        # (mx.get_peak_memory during optimizer_step minus weights + state + grads): about one
        # more trainable-sized tree (0.6 for SGD) plus 4x the largest tensor, within -9%..0%.
        total = sum(t.numel * t.dtype_bytes for t in trainable)
        return int((0.6 if s.optim == "sgd" else 1.0) * total) + 4 * largest
    if s.optim in ("adamw", "adam") and s.device == "cuda":
        # torch/optim/adam.py _multi_tensor_adam (foreach, the CUDA default):
        # exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs) allocates one more state-sized list.
        return sum(t.numel * t.dtype_bytes for t in trainable)
    if s.optim == "adafactor":
        # transformers Adafactor.step: fp32 `update` (grad**2 + eps, then the approximation)
        # and p.float() copies for 16-bit params, one parameter at a time.
        return 3 * max(t.numel for t in trainable) * 4
    # per-tensor kernels (torch single-tensor path on CPU; bitsandbytes fused 8-bit/32-bit)
    return largest if s.optim in ("adamw", "adam", "sgd") else 0


# ---- activations ----------------------------------------------------------------------------------

def _first_stage(s: Setup) -> int:
    """Stage of the block where gradients start in the lowest layer that needs them."""
    if s.method == "full":
        return 0
    return min(_STAGE[k] for k in s.keys)


def _torch_layer(arch: Arch, s: Setup, lowest: bool) -> tuple[int, dict[str, int]]:
    """Bytes autograd keeps for backward in one decoder layer (HF Qwen2/Llama, PEFT, torch).

    Derived from the saved tensors of each op (torch autograd saves only what the backward of
    inputs that require grad needs; checked against torch.autograd.graph.saved_tensors_hooks):
    - RMSNorm (modeling_qwen2.py Qwen2RMSNorm.forward): hidden.to(float32) and rsqrt(variance);
      with a trainable weight also hidden.to(input_dtype).
    - Linear: its input if the weight trains; under autocast the bf16/fp16 cast of the input
      (autocast casts activations per call, no cache) and the cast weight (kept for the input's
      grad even when frozen). bitsandbytes MatMul4Bit keeps only the packed weight.
    - PEFT lora.Linear.forward: x cast to the adapter dtype (_cast_input_dtype), lora_A keeps
      it, lora_B keeps lora_A's output [n, r]; DoRA (lora/dora.py DoraLinearLayer.forward) also
      keeps base_result and lora_B's output (both [n, out]) for the magnitude's grad.
    - attention: sdpa (flash/efficient) keeps q, k, v, out and the fp32 logsumexp [B, H, T];
      eager (eager_attention_forward) keeps q, repeat_kv'd k and v, the fp32 softmax, its
      cast, and the contiguous output.
    - MLP: silu keeps gate, the product keeps silu(gate) and up; down_proj's input if it trains.
    """
    n = s.batch * s.seq_len
    h, qd, kv, f = arch.hidden, arch.q_out, arch.kv_out, arch.intermediate
    st, a, ad, ac = (4 if s.autocast else s.wd), s.a, s.ad, s.autocast
    full = s.method == "full"
    quant = s.method == "qlora"
    start = _first_stage(s) if lowest else 0
    lin = arch.linears()
    parts: dict[str, int] = {"norms": 0, "linear_inputs": 0, "weight_casts": 0, "adapters": 0,
                             "attention": 0, "mlp": 0}

    def keep(stage: int) -> bool:
        return stage >= start

    def norm(stage: int) -> None:
        if keep(stage) and (stage > start or full or not lowest):
            parts["norms"] += n * h * 4 + n * 4
            if full:
                parts["norms"] += n * h * st

    def inputs(names: tuple[str, ...], width: int, src_bytes: int, src_already_kept: bool) -> None:
        """Saved inputs of Linears reading one source tensor of dtype ``src_bytes``."""
        stage = _STAGE[names[0]]
        if not keep(stage):
            return
        grad_in = stage > start or not lowest or full  # does the source itself need a grad?
        shared = False
        for name in names:
            in_f, out_f, _ = lin[name]
            if full:
                if ac and src_bytes != 2:
                    parts["linear_inputs"] += n * in_f * 2  # autocast's cast of the input, per call
                else:
                    shared = True
                if ac:
                    parts["weight_casts"] += out_f * in_f * 2
                continue
            if name in s.keys:
                if s.dropout > 0:
                    parts["adapters"] += n * in_f * (1 + ad)  # dropout mask + its output (lora_A's input)
                elif ac and ad != 2:
                    parts["adapters"] += n * in_f * 2  # autocast cast of x (fp32) for lora_A
                elif src_bytes != ad:
                    parts["adapters"] += n * in_f * ad  # _cast_input_dtype copy kept by lora_A
                else:
                    shared = True
                parts["adapters"] += n * s.rank * (2 if ac else ad)  # lora_A output kept by lora_B
                if ac:
                    parts["weight_casts"] += s.rank * (in_f + out_f) * 2
                if s.method == "dora":
                    parts["adapters"] += n * out_f * (a + (2 if ac else ad))
            if ac and not quant and grad_in:
                parts["weight_casts"] += out_f * in_f * 2  # cast weight kept for the input's grad
        if shared and not src_already_kept:
            parts["linear_inputs"] += n * width * src_bytes

    norm(_STAGE["norm1"])
    inputs(("q_proj", "k_proj", "v_proj"), h, st, False)
    if keep(1):
        if s.attn == "eager":
            groups = arch.heads // arch.kv_heads
            kv_kept = n * (qd if groups > 1 else kv) * a
            probs = s.batch * arch.heads * s.seq_len ** 2 * (4 + (a if a != 4 else 0))  # fp32 softmax + its cast
            parts["attention"] += n * qd * a + 2 * kv_kept + probs
        else:
            parts["attention"] += n * (2 * qd + 2 * kv) * a + s.batch * arch.heads * s.seq_len * 4
    if keep(2):
        if s.attn == "eager":
            if full or "o_proj" in s.keys:
                parts["linear_inputs"] += n * qd * a  # attn_output.transpose(1, 2).contiguous()
            inputs(("o_proj",), qd, a, True)
        else:
            inputs(("o_proj",), qd, a, keep(1))  # sdpa keeps its output when attention needs grads
    norm(_STAGE["norm2"])
    inputs(("gate_proj", "up_proj"), h, st, False)
    if keep(4):
        parts["mlp"] += 3 * n * f * a
    inputs(("down_proj",), f, a, False)
    return sum(parts.values()), parts


def _mlx_layer(arch: Arch, s: Setup, lowest: bool) -> tuple[int, dict[str, int]]:
    """Bytes mlx keeps for backward in one mlx-lm decoder layer (models/qwen2.py, llama.py).

    Measured on mlx 0.32 (CPU) by evaluating the loss of nn.value_and_grad first and reading
    mx.get_active_memory before evaluating the gradients; each term is an array the vjp graph
    references:
    - mx.fast.rms_norm (CPU fallback): the input upcast to fp32 and the rsqrt, per norm;
    - attention: mx.fast.scaled_dot_product_attention's fallback (mlx/fast.cpp: used on CPU and
      whenever the fused VJP is unavailable) keeps scale*q, k, v, the softmax [B, H, T, T] and
      the [T, T] bool causal mask; mx.fast.rope's fallback keeps cos/sin tables [T, d] per call;
    - MLP: nn.silu = x * sigmoid(x) keeps gate and sigmoid(gate); the product keeps silu and up;
    - inputs of trained or adapted Linears; LoRALinear keeps x @ lora_a [n, r]; DoRALinear keeps
      the un-normalised output [n, out] for m's grad; full fine-tuning keeps the norm outputs.
    """
    T = s.seq_len - 1  # backends/mlx.py _loss: model(ids[:, :-1])
    n = s.batch * T
    h, qd, kv, f = arch.hidden, arch.q_out, arch.kv_out, arch.intermediate
    a = s.wd
    full = s.method == "full"
    start = _first_stage(s) if lowest else 0
    lin = arch.linears()
    parts = {"norms": 0, "linear_inputs": 0, "adapters": 0, "attention": 0, "mlp": 0}
    for stage in (0, 3):
        if stage > start or (stage == start and (full or not lowest)):
            parts["norms"] += n * h * 4 + n * 4
    if start <= 1:
        parts["attention"] += (n * (qd + 2 * kv) * a + s.batch * arch.heads * T * T * a + T * T
                               + 2 * T * arch.head_dim * a)
    if start <= 4:
        parts["mlp"] += 4 * n * f * a
    sources = {"q_proj": ("y1", h), "k_proj": ("y1", h), "v_proj": ("y1", h), "o_proj": ("o", qd),
               "gate_proj": ("y2", h), "up_proj": ("y2", h), "down_proj": ("p", f)}
    trained = BLOCK_KEYS if full else s.keys
    for src, width in {sources[k] for k in trained}:
        parts["linear_inputs"] += n * width * a
    if full:
        parts["norms"] += 2 * n * h * a
    else:
        for k in s.keys:
            in_f, out_f, _ = lin[k]
            parts["adapters"] += n * s.rank * a
            if s.dropout > 0:
                parts["adapters"] += n * in_f * (1 + a)
            if s.method == "dora":
                parts["adapters"] += n * out_f * a
    return sum(parts.values()), parts


def activations(arch: Arch, s: Setup) -> tuple[int, int, dict[str, int]]:
    """(activation bytes, logits+loss bytes, detail); their sum is the step's peak above
    weights, optimizer state and gradients.

    Activations are what autograd / mlx's vjp keep for backward plus the backward workspace
    where it is not already covered by the logits region (detail: saved_layers, head,
    backward_workspace).

    Only layers that need gradients keep anything: with adapters on the top N layers the
    forward below them runs without a graph. Gradient checkpointing keeps each such layer's
    input and recomputes one layer at a time during backward.
    """
    L = arch.layers
    first = 0 if s.method == "full" else min(s.lora_layers)
    backward_layers = L - first
    h, f, V = arch.hidden, arch.intermediate, arch.vocab
    detail: dict[str, int] = {"layers_with_grad": backward_layers}
    if s.backend == "mlx":
        layer, lparts = _mlx_layer(arch, s, lowest=False)
        low, _ = _mlx_layer(arch, s, lowest=s.method != "full")
        T = s.seq_len - 1
        n = s.batch * T
        a = s.wd
        head = n * h * 4 + n * 4  # final rms_norm: fp32 input and rsqrt
        tt = MLX_TRANSIENT_TT
        if backward_layers == 1 and s.method != "full" and not s.ckpt:
            tt -= MLX_LOWEST_ONLY_TT_SAVING
        transient = int((MLX_TRANSIENT_NH * n * h + MLX_TRANSIENT_NF * n * f
                         + (MLX_TRANSIENT_NF_QUANT * n * f if s.method == "qlora" or s.pre_quant else 0)
                         + tt * s.batch * arch.heads * T * T) * a)
        logits = n * V * (MLX_LOGITS_PER_NV + (MLX_LOGITS_PER_NV_HALF if a == 2 else 0))
        ckpt_input = n * h * a  # mlx.core.checkpoint keeps the layer's input
        # the part of one recomputed block live at the peak (see MLX_CKPT_RECOMPUTE_*)
        ckpt_recompute = int((MLX_CKPT_RECOMPUTE_NH * n * h + MLX_CKPT_RECOMPUTE_NF * n * f
                              + MLX_CKPT_RECOMPUTE_TT * s.batch * arch.heads * T * T) * a)
    else:
        layer, lparts = _torch_layer(arch, s, lowest=False)
        low, _ = _torch_layer(arch, s, lowest=s.method != "full")
        n = s.batch * s.seq_len
        a, st = s.a, (4 if s.autocast else s.wd)
        full = s.method == "full"
        head = n * h * 4 + n * 4 + (n * h * st if full else 0)  # final RMSNorm
        if full:  # lm_head (or the tied embedding) trains: its input, cast under autocast
            head += n * h * 2 + V * h * 2 if s.autocast else n * h * st
            head += n * 8  # nn.Embedding backward keeps the int64 indices
        elif s.autocast:
            head += V * h * 2  # cast lm_head weight kept for the hidden state's grad
        if s.attn == "sdpa":
            head += s.batch * s.seq_len * s.seq_len  # bool [B, 1, T, T] padding mask, shared by layers
        # Layer backward workspace: grads of the MLP intermediates and of the fp32 residual
        # stream; eager attention also materialises the [B, H, T, T] grads.
        transient = 3 * n * f * a + 2 * n * h * 4
        if s.attn == "eager":
            transient += 2 * s.batch * arch.heads * s.seq_len ** 2 * 4
        if s.method == "qlora":
            # bitsandbytes MatMul4Bit: F.dequantize_4bit(B) -> the full weight in compute dtype,
            # per matmul (forward and backward), one at a time.
            transient += max(i * o for i, o, _ in arch.linears().values()) * a
        if s.method == "dora":
            # PEFT DoraLinearLayer: get_lora_weight runs lora_A on an [in, in] identity and
            # get_weight_norm builds weight + scaling * lora_weight [out, in], per module.
            transient += max(lin[0] * lin[0] * s.ad + lin[0] * lin[1] * 4
                             for k, lin in arch.linears().items() if k in s.keys)
        # Logits and loss (backends/cuda.py _loss_sum: logits[:, :-1].float(), F.cross_entropy):
        # log_softmax keeps its fp32 output; backward adds nll_loss's dense grad and
        # log_softmax's grad: 3 x 4 B per (token, vocab) at the start of backward (the forward
        # end is no higher: model logits + fp32 copy + log_softmax output).
        logits = 12 * n * V
        ckpt_input = n * h * st  # non-reentrant checkpoint keeps each layer's input
        ckpt_recompute = layer  # the loss's backward is freed first: one whole layer recomputed
    if backward_layers == 0:
        saved, recompute = 0, 0
    elif s.ckpt:
        saved, recompute = backward_layers * ckpt_input, ckpt_recompute  # inputs; one layer recomputed in backward
    else:
        saved, recompute = low + (backward_layers - 1) * layer, 0
    workspace = transient + recompute
    if s.backend == "mlx":
        # mlx evaluates forward and backward as one graph: the calibrated workspace coexists
        # with the logits' cotangents (fitted that way).
        extra = workspace
    else:
        # torch: the loss's backward (logits region) runs first and is freed before the layers'
        # backward (and any recomputation) starts, so only the larger of the two adds to the
        # kept activations (checked with torch.profiler memory events on CPU).
        extra = max(0, workspace - logits)
    detail.update({"per_layer": layer, "lowest_layer": low, "saved_layers": saved, "head": head,
                   "backward_workspace": workspace, **{f"per_layer_{k}": v for k, v in lparts.items()}})
    return saved + head + extra, logits, detail


# ---- device split ---------------------------------------------------------------------------------

def _split_layers(sizes: list[tuple[str, int]], n_devices: int) -> dict[str, int]:
    """Assign modules (in forward order) to GPUs the way transformers' device_map="auto"
    does through accelerate 1.15 (accelerate/utils/modeling.py): get_balanced_memory caps each
    GPU but the last at total // N + 1.25 x max(largest decoder layer, mean module); then
    infer_auto_device_map fills GPUs in order, GPU 0 (a "main device") keeping room for the
    largest layer, the last GPU taking what is left."""
    if n_devices <= 1:
        return {name: 0 for name, _ in sizes}
    total = sum(b for _, b in sizes)
    largest = max((b for n, b in sizes if n.startswith("layer.")), default=0)
    per_gpu = total // n_devices + int(1.25 * max(largest, total / max(len(sizes), 1)))
    caps = [per_gpu - largest] + [per_gpu] * (n_devices - 2) + [None]
    out, dev, used = {}, 0, 0
    for name, b in sizes:
        while caps[dev] is not None and used + b > caps[dev] and dev < n_devices - 1:
            dev, used = dev + 1, 0
        out[name] = dev
        used += b
    return out


# ---- the plan -------------------------------------------------------------------------------------

def _module_of(t: Tensor) -> str:
    if t.layer is not None:
        return f"layer.{t.layer}"
    return "embed" if t.role == "embed" else "head"


def _count(tensors: list[Tensor]) -> tuple[int, int]:
    return sum(t.numel for t in tensors), sum(t.numel for t in tensors if t.trainable)


def trainable_params(cfg: Any) -> int:
    """Parameters the optimizer updates, as the backends count them after building adapters:
    LoRA r * (in + out) per adapted Linear (+ out for DoRA's magnitude), or every parameter for
    method=full (tied embeddings once)."""
    arch, s = resolve(cfg)
    return _count(inventory(arch, s))[1]


def params_total(cfg: Any) -> int:
    """Every parameter by logical element (a 4-bit weight counts its real shape), adapters
    included, tied embeddings once: backends' ModelInfo.params_total."""
    arch, s = resolve(cfg)
    return _count(inventory(arch, s))[0]


_MODULE_KEYS = ("weights", "quant", "trainable_weights", "grads", "optimizer_state", "optimizer_state_paged", "round")


def _core(arch: Arch, s: Setup) -> dict[str, Any]:
    """Price one setup: categories, steady state, peak, per device."""
    tensors = inventory(arch, s)
    total, trainable = _count(tensors)
    on_gpu = s.device == "cuda"
    # Group bytes by module so a split model's share can be priced per device.
    by_module: dict[str, dict[str, int]] = {}
    trainable_t = [t for t in tensors if t.trainable]
    for t in tensors:
        mod = by_module.setdefault(_module_of(t), dict.fromkeys(
            _MODULE_KEYS, 0))
        w, q = _weight_bytes(t, s)
        mod["weights"] += w + q
        mod["quant"] += q
        mod["round"] += (-w) % CUDA_ALLOC_ROUND
        if t.trainable:
            mod["trainable_weights"] += w
            mod["grads"] += w  # a gradient has its parameter's shape and dtype
            st, paged = optimizer_state_bytes(s.optim, s.backend, t.shape, t.dtype_bytes, on_gpu, s.momentum,
                                              host_step=s.device == "cpu")
            mod["optimizer_state"] += st
            mod["optimizer_state_paged"] += paged
            mod["round"] += 2 * ((-w) % CUDA_ALLOC_ROUND)
    qmaps = BNB_QMAPS_BYTES if s.optim in ("adamw_8bit", "paged_adamw_8bit") and any(
        t.numel >= BNB_MIN_8BIT_SIZE for t in trainable_t) else 0
    _, logits, act_detail = activations(arch, s)
    opt_tr = _optimizer_transient(s, trainable_t)

    # Modules on devices (device_map=auto over N GPUs; one device otherwise).
    order = ["embed"] + [f"layer.{i}" for i in range(arch.layers)] + ["head"]
    assign = _split_layers([(m, by_module.get(m, {}).get("weights", 0)) for m in order], s.n_devices)
    n_dev = s.n_devices
    first = 0 if s.method == "full" else min(s.lora_layers)
    layer_share = act_detail["saved_layers"]
    per_dev_layers = [0] * n_dev
    for i in range(first, arch.layers):
        per_dev_layers[assign[f"layer.{i}"]] += 1
    devices = []
    bw_layers = max(arch.layers - first, 1)
    for d in range(n_dev):
        mods = [m for m in order if assign[m] == d]
        agg = {k: sum(by_module.get(m, {}).get(k, 0) for m in mods) for k in
               _MODULE_KEYS}
        if d == 0:
            agg["optimizer_state"] += qmaps
        last = d == assign["head"]
        # Activations: the layers on this device; the head and logits live with lm_head; each
        # device runs its own layers' backward workspace.
        dev_logits = logits if last else 0
        workspace = act_detail["backward_workspace"]
        dev_act = (layer_share * per_dev_layers[d]) // bw_layers + (
            workspace if s.backend == "mlx" else max(0, workspace - dev_logits))
        if last:
            dev_act += act_detail["head"]
        devices.append(_price(s, agg, dev_act, dev_logits, opt_tr if agg["grads"] else 0, d, mods))
    tot = {k: sum(dv["bytes"][k] for dv in devices) for k in devices[0]["bytes"]}
    if n_dev == 1:
        summary = devices[0]
    else:
        worst = max(devices, key=lambda dv: dv["peak_bytes"])
        summary = {"bytes": tot,
                   "steady_state_allocated_bytes": sum(dv["steady_state_allocated_bytes"] for dv in devices),
                   "peak_allocated_bytes": sum(dv["peak_allocated_bytes"] for dv in devices),
                   "peak_bytes": sum(dv["peak_bytes"] for dv in devices), "peak_phase": worst["peak_phase"]}
    return {
        "params_total": total, "params_trainable": trainable,
        "bytes": summary["bytes"],
        "steady_state_allocated_bytes": summary["steady_state_allocated_bytes"],
        "peak_allocated_bytes": summary["peak_allocated_bytes"],
        "peak_bytes": summary["peak_bytes"],
        "peak_phase": summary["peak_phase"],
        "max_device_peak_bytes": max(dv["peak_bytes"] for dv in devices),
        "per_device": devices,
        "activations_detail": act_detail,
        "quant_constants_bytes": sum(m["quant"] for m in by_module.values()),
        "optimizer_step_workspace_bytes": opt_tr,
    }


def _price(s: Setup, agg: dict[str, int], act: int, logits: int, opt_tr: int, index: int,
           modules: list[str]) -> dict[str, Any]:
    """Peak and steady state on one device from its categories."""
    W, S, G = agg["weights"], agg["optimizer_state"], agg["grads"]
    gpu = s.device == "cuda"
    overhead = (CUDA_CONTEXT_BYTES if gpu else 0)
    rounding = agg["round"] if gpu else 0
    fb = act + logits
    if s.grad_accum > 1 and s.backend == "mlx":
        # backends/mlx.py forward_backward: tree_map(mx.add, self._grads, grads) is evaluated
        # with this micro-batch's graph: the running sum, the new grads and the new sum.
        grads_fb = max(fb + 2 * G, 3 * G)
    elif s.grad_accum > 1:
        grads_fb = fb + G  # torch accumulates into p.grad in place: earlier grads stay alive
    else:
        grads_fb = max(fb, G) + int(GRAD_ACTIVATION_OVERLAP * min(fb, G))
    step = G + opt_tr
    phases = {"forward_backward": grads_fb, "optimizer_step": step}
    phase = max(phases, key=phases.get)
    peak_alloc = W + S + phases[phase] + rounding
    return {
        "index": index,
        "modules": f"{modules[0]}..{modules[-1]}" if modules else "",
        "bytes": {
            "weights": W,
            "trainable_weights": agg["trainable_weights"],
            "grads": G,
            "optimizer_state": S,
            "optimizer_state_paged": agg["optimizer_state_paged"],
            "activations": act,
            "logits": logits,
            "overhead": overhead + rounding,
        },
        "overhead_detail": {"cuda_context_estimate": overhead, "allocator_rounding_512B": rounding},
        "steady_state_allocated_bytes": W + S,
        "peak_allocated_bytes": peak_alloc,
        "peak_bytes": peak_alloc + overhead,
        "peak_phase": phase,
    }


def _budget(s: Setup, override: int | None) -> tuple[int | None, str, int | None]:
    """(budget bytes per device, where it came from, device total)."""
    dm = device_memory(s.backend, s.device)
    if override is not None:
        return int(override), "argument", dm.total_bytes
    if s.budget_text is not None:
        return parse_budget(s.budget_text, dm.total_bytes), f"memory.budget={s.budget_text}", dm.total_bytes
    label = dm.source + (" (estimate)" if dm.estimate and "estimate" not in dm.source else "")
    return dm.total_bytes, f"device: {label}", dm.total_bytes


def _setup_with(s: Setup, **changes: Any) -> Setup:
    import dataclasses

    return dataclasses.replace(s, **changes)


def _fits(p: dict[str, Any], budget: int | None) -> bool | None:
    return None if budget is None else p["max_device_peak_bytes"] <= budget


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _largest_fitting_micro(arch: Arch, s: Setup, budget: int, ckpt: bool) -> int | None:
    eff = s.batch * s.grad_accum
    for d in _divisors_desc(eff):
        if _fits(_core(arch, _setup_with(s, batch=d, grad_accum=eff // d, ckpt=ckpt)), budget):
            return d
    return None


def _levers(arch: Arch, s: Setup, budget: int) -> list[dict[str, Any]]:
    """Single changes that make the run fit at its current micro-batch (or at micro-batch 1
    with checkpointing when nothing else is left), each with its predicted peak."""
    out: list[dict[str, Any]] = []

    def trial(change: str, **kw: Any) -> None:
        try:
            p = _core(arch, _setup_with(s, **kw))
        except UserError:
            return
        if _fits(p, budget):
            out.append({"change": change, "peak_bytes": p["max_device_peak_bytes"]})

    if not s.ckpt:
        trial("train.grad_checkpointing=true", ckpt=True)
    if s.backend == "cuda" and s.optim in ("adamw", "adam"):
        trial("optim=adamw_8bit", optim="adamw_8bit")
        if s.device == "cuda":
            trial("optim=paged_adamw_8bit", optim="paged_adamw_8bit")
    if s.method in ("lora", "dora") or (s.method == "full" and s.backend == "cuda"):
        trial("method=qlora", method="qlora", lora_layers=tuple(range(arch.layers)) if s.method == "full" else s.lora_layers,
              adapter_dtype=s.adapter_dtype if s.method != "full" else ("bfloat16" if s.precision == "bf16-true" else "float32"))
    if s.method == "full" and s.backend == "mlx":
        trial("method=qlora", method="qlora", lora_layers=tuple(range(arch.layers)))
    if s.precision != "bf16-true":
        bf = {"weight_dtype": "bfloat16", "compute_dtype": "bfloat16", "autocast": False,
              "adapter_dtype": "bfloat16", "precision": "bf16-true"}
        trial("precision=bf16-true", **bf)
    if s.adapters and len(s.lora_layers) > 1:
        best = None
        lo, hi = 1, len(s.lora_layers) - 1
        while lo <= hi:  # more layers -> more memory: bisect the largest N that fits
            mid = (lo + hi) // 2
            if _fits(_core(arch, _setup_with(s, lora_layers=tuple(range(arch.layers - mid, arch.layers)))), budget):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        if best:
            p = _core(arch, _setup_with(s, lora_layers=tuple(range(arch.layers - best, arch.layers))))
            out.append({"change": f"method.lora.num_layers={best}", "peak_bytes": p["max_device_peak_bytes"]})
    best, lo, hi = None, 8, s.seq_len - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if _fits(_core(arch, _setup_with(s, seq_len=mid)), budget):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best:
        p = _core(arch, _setup_with(s, seq_len=best))
        out.append({"change": f"train.seq_len={best}", "peak_bytes": p["max_device_peak_bytes"]})
    return out


def _recommend(arch: Arch, s: Setup, budget: int | None) -> dict[str, Any] | None:
    """Largest micro-batch that fits (a divisor of the effective batch, so the math stays the
    same), with and without checkpointing, and single levers that make the run fit."""
    if budget is None:
        return None
    eff = s.batch * s.grad_accum
    micro = _largest_fitting_micro(arch, s, budget, s.ckpt)
    rec: dict[str, Any] = {"max_micro_batch": micro,
                           "max_micro_batch_note": f"largest divisor of the effective batch ({eff}) that fits"}
    if not s.ckpt:
        rec["max_micro_batch_with_grad_checkpointing"] = _largest_fitting_micro(arch, s, budget, True)
    smallest = _setup_with(s, batch=1, grad_accum=eff, ckpt=True)
    rec["smallest_peak_bytes"] = _core(arch, smallest)["max_device_peak_bytes"]  # micro-batch 1 + checkpointing
    base = s if micro is not None else smallest  # levers on top of the smallest configuration
    rec["levers"] = _levers(arch, base, budget) if not _fits(_core(arch, base), budget) else []
    if micro is None:
        rec["levers_apply_to"] = "micro-batch 1 with gradient checkpointing"
    return rec


def plan(cfg: Any, seq_len: int | None = None, budget_bytes: int | None = None,
         recommend: bool = True) -> dict[str, Any]:
    """Predict a run's memory without loading weights (the content of plan.json).

    Args:
        cfg: the composed finetune.config.Config (DictConfig or dataclass).
        seq_len: tokens per sample to plan for; default ``train.seq_len``. Pass the data's
            longest (truncated) sample for a tighter plan.
        budget_bytes: the budget to judge ``fits`` against; default ``memory.budget`` or the device.
        recommend: also search the largest micro-batch and levers that fit.

    Returns:
        A dict of ints of bytes (schema in the module docstring and format_table).
    """
    arch, s = resolve(cfg, seq_len)
    core = _core(arch, s)
    budget, budget_source, device_total = _budget(s, budget_bytes)
    fits = _fits(core, budget)
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "backend": s.backend,
        "device": s.device,
        "devices": s.n_devices,
        "model": {"name": str(_get(_get(cfg, "model"), "name", "")), **{k: v for k, v in arch.__dict__.items()}},
        "method": s.method,
        "optim": s.optim,
        "precision": s.precision,
        "dtypes": {"weights": s.weight_dtype, "adapters": s.adapter_dtype if s.adapters else None,
                   "compute": s.compute_dtype, "autocast": s.autocast,
                   "stored": s.dtype_source,  # where the checkpoint's dtype was read
                   "quantized": ("nf4" if s.quant_type == "nf4" else s.quant_type) + "/bitsandbytes"
                   if s.method == "qlora" and s.backend == "cuda" else
                   (f"int{s.quant_bits}/affine/group{s.quant_group}" + (" (pre-quantized)" if s.pre_quant else "")
                    if s.method == "qlora" or s.pre_quant else None)},
        "lora": {"rank": s.rank, "keys": list(s.keys), "layers": len(s.lora_layers)} if s.adapters else None,
        "batch_size": s.batch,
        "grad_accum": s.grad_accum,
        "effective_batch": s.batch * s.grad_accum,
        "seq_len": s.seq_len,
        "grad_checkpointing": s.ckpt,
        "attn_implementation": s.attn if s.backend == "cuda" else "mx.fast.scaled_dot_product_attention",
        **core,
        "device_total_bytes": device_total,
        "budget_bytes": budget,
        "budget_source": budget_source,
        "fits": fits,
        "recommendation": _recommend(arch, s, budget) if recommend else None,
        "notes": s.notes + _notes(s),
    }
    return out


def _notes(s: Setup) -> list[str]:
    notes = []
    if s.device == "cuda":
        notes.append("overhead: CUDA context ~500 MiB is an estimate (varies by GPU, driver and "
                     "libraries); allocator rounding counts 512 B blocks of persistent tensors; "
                     "reserved-but-unallocated cache (2 MiB / 20 MiB segments) is not included")
    if s.optim.startswith("paged") and s.device == "cuda":
        notes.append("optimizer_state_paged lives in CUDA unified memory (pages to host under "
                     "pressure): not in peak_bytes")
    if s.backend == "mlx":
        notes.append("mlx: activations calibrated on mlx 0.32 CPU (fallback attention keeps the "
                     "[B, H, T, T] softmax); unified memory: no separate context")
    if s.device == "cpu":
        notes.append("cpu: the process's own resident libraries are not counted")
    return notes


# ---- fitting to a budget ------------------------------------------------------------------------

@dataclass
class FitResult:
    """What fit_to_budget decided. ``events`` are {trigger, action, before, after} dicts."""

    fits: bool
    plan: dict[str, Any]
    batch_size: int
    grad_accum: int
    grad_checkpointing: bool
    events: list[dict[str, Any]] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)


def fit_to_budget(cfg: Any, budget_bytes: int, seq_len: int | None = None) -> FitResult:
    """Change the run, keeping its math, until the plan fits ``budget_bytes`` (per device).

    First lower the micro-batch to the largest divisor of the effective batch that fits
    (grad_accum rises so batch_size * grad_accum stays exactly the same); if even micro-batch 1
    does not fit, turn on gradient checkpointing and take the largest micro-batch that fits with
    it. If nothing fits, return fits=False with the plan at micro-batch 1 with checkpointing and
    suggestions (each alone makes it fit), e.g. "method=qlora", "method.lora.num_layers=4",
    "train.seq_len=512".
    """
    arch, s = resolve(cfg, seq_len)
    budget = int(budget_bytes)
    eff = s.batch * s.grad_accum

    def full_plan(batch: int, ckpt: bool) -> dict[str, Any]:
        c = _merged(cfg, batch, eff // batch, ckpt)
        return plan(c, seq_len=seq_len, budget_bytes=budget, recommend=False)

    p0 = _core(arch, s)
    before = {"batch_size": s.batch, "grad_accum": s.grad_accum, "grad_checkpointing": s.ckpt,
              "peak_bytes": p0["max_device_peak_bytes"], "budget_bytes": budget}
    if _fits(p0, budget):
        return FitResult(True, full_plan(s.batch, s.ckpt), s.batch, s.grad_accum, s.ckpt)
    events: list[dict[str, Any]] = []
    for ckpt in ((s.ckpt,) if s.ckpt else (False, True)):
        for d in _divisors_desc(eff):
            if d > s.batch:
                continue
            p = _core(arch, _setup_with(s, batch=d, grad_accum=eff // d, ckpt=ckpt))
            if not _fits(p, budget):
                continue
            if d != s.batch:
                events.append({"trigger": "plan_over_budget", "action": "lower_micro_batch", "before": before,
                               "after": {"batch_size": d, "grad_accum": eff // d, "grad_checkpointing": s.ckpt,
                                         "peak_bytes": _core(arch, _setup_with(s, batch=d, grad_accum=eff // d))["max_device_peak_bytes"]}})
            if ckpt and not s.ckpt:
                prev = events[-1]["after"] if events else before
                events.append({"trigger": "plan_over_budget", "action": "enable_grad_checkpointing",
                               "before": {**prev}, "after": {**prev, "grad_checkpointing": True,
                                                             "peak_bytes": p["max_device_peak_bytes"]}})
            return FitResult(True, full_plan(d, ckpt), d, eff // d, ckpt, events)
    smallest = _setup_with(s, batch=1, grad_accum=eff, ckpt=True)
    suggestions = [lv["change"] for lv in _levers(arch, smallest, budget)]
    return FitResult(False, full_plan(1, True), 1, eff, True, [], suggestions)


def _merged(cfg: Any, batch: int, grad_accum: int, ckpt: bool) -> Any:
    """A copy of cfg with the train knobs changed (DictConfig or dataclass)."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            return OmegaConf.merge(cfg, {"train": {"batch_size": batch, "grad_accum": grad_accum,
                                                   "grad_checkpointing": ckpt}})
    except ImportError:
        pass
    import copy
    import dataclasses

    c = copy.deepcopy(cfg)
    c.train = dataclasses.replace(c.train, batch_size=batch, grad_accum=grad_accum, grad_checkpointing=ckpt)
    return c


# ---- calibration --------------------------------------------------------------------------------

def _err(predicted: int | None, measured: int | None) -> dict[str, Any]:
    if predicted is None or measured is None:
        rel = None
    elif measured == 0:
        rel = 0.0 if predicted == 0 else None
    else:
        rel = (predicted - measured) / measured
    return {"predicted": predicted, "measured": measured,
            "error_bytes": None if predicted is None or measured is None else predicted - measured,
            "relative_error": rel}


def plan_error(plan: dict[str, Any], census: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Per-category prediction error after the first optimizer step.

    Args:
        plan: a plan() result for the run as it is (micro-batch, checkpointing).
        census: Backend.census() (bytes by category of live tensors).
        measured: the accountant's sample after the step (allocated, step_peak_allocated, ...).

    Returns:
        {category: {predicted, measured, error_bytes, relative_error}}; relative error is
        (predicted - measured) / measured, None where either side is unknown. Gradients are
        released by the step, so a census of 0 there is reported as not measured.
    """
    b = plan["bytes"]
    c = census or {}
    m = measured or {}
    weights_measured = None
    if c:
        weights_measured = sum(int(c.get(k) or 0) for k in ("frozen_weights", "trainable_weights", "quant_buffers"))
    grads_measured = c.get("grads")
    out = {
        "weights": _err(b["weights"], weights_measured),
        "trainable_weights": _err(b["trainable_weights"], c.get("trainable_weights")),
        "grads": _err(b["grads"], grads_measured if grads_measured else None),
        "optimizer_state": _err(b["optimizer_state"], c.get("optimizer_state")),
        "optimizer_state_paged": _err(b["optimizer_state_paged"], c.get("optimizer_state_paged")),
        "steady_state_allocated": _err(plan.get("steady_state_allocated_bytes"), m.get("allocated")),
        "peak_allocated": _err(plan.get("peak_allocated_bytes"),
                               m.get("step_peak_allocated", m.get("peak_allocated"))),
    }
    return out


# ---- output ---------------------------------------------------------------------------------------

def _gib(b: int | None) -> str:
    return f"{'?':>9s} {'?':>16s}" if b is None else f"{b / GIB:9.3f} {b:16,d}"


def format_table(plan: dict[str, Any]) -> str:
    """The plan as a table for a terminal (GiB = 2^30 bytes, labelled)."""
    b = plan["bytes"]
    fits = plan.get("fits")
    verdict = "unknown (no budget)" if fits is None else ("yes" if fits else "NO")
    dt = plan.get("dtypes") or {}
    head = (f"plan: {plan['model'].get('name') or 'model'} {plan['method']} {plan['optim']} {plan['precision']} "
            f"on {plan['backend']} ({plan['device']}{' x' + str(plan['devices']) if plan['devices'] > 1 else ''}): "
            f"peak {plan['max_device_peak_bytes'] / GIB:.2f} GiB per device vs budget "
            + (f"{plan['budget_bytes'] / GIB:.2f} GiB" if plan.get("budget_bytes") else "unknown")
            + f", fits: {verdict}")
    lines = [head,
             f"  params: {plan['params_total']:,} total, {plan['params_trainable']:,} trainable",
             (f"  micro-batch {plan['batch_size']} x grad_accum {plan['grad_accum']} = {plan['effective_batch']}, "
              f"seq_len {plan['seq_len']}, grad_checkpointing {plan['grad_checkpointing']}, "
              f"attention {plan['attn_implementation']}"),
             (f"  dtypes: weights {dt.get('weights')}" + (f", adapters {dt['adapters']}" if dt.get("adapters") else "")
              + f", compute {dt.get('compute')}" + (f", quantized {dt['quantized']}" if dt.get("quantized") else "")
              + (f" (stored dtype from {dt['stored']})" if dt.get("stored") else "")),
             f"  {'category':32s}{'GiB':>9s} {'bytes':>16s}"]
    for k in ("weights", "trainable_weights", "grads", "optimizer_state", "optimizer_state_paged",
              "activations", "logits", "overhead"):
        note = {"trainable_weights": " (part of weights)", "optimizer_state_paged": " (unified memory, not in peak)"}.get(k, "")
        lines.append(f"  {k:32s}{_gib(b[k])}{note}")
    lines.append(f"  {'steady state (after a step)':32s}{_gib(plan['steady_state_allocated_bytes'])}")
    lines.append(f"  {'peak allocated':32s}{_gib(plan['peak_allocated_bytes'])}  ({plan['peak_phase']})")
    lines.append(f"  {'peak (with overhead)':32s}{_gib(plan['peak_bytes'])}")
    if plan["devices"] > 1:
        budget = plan.get("budget_bytes")
        lines.append(f"  per device (GiB){'':6s}{'weights':>9s}{'grads':>9s}{'optim':>9s}{'paged':>9s}{'activ':>9s}"
                     f"{'logits':>9s}{'peak':>9s}  fits  modules")
        for dv in plan["per_device"]:
            db = dv["bytes"]
            ok = "?" if budget is None else ("yes" if dv["peak_bytes"] <= budget else "NO")
            lines.append(f"    gpu {dv['index']:<16d}" + "".join(f"{db[k] / GIB:9.2f}" for k in (
                "weights", "grads", "optimizer_state", "optimizer_state_paged", "activations", "logits"))
                + f"{dv['peak_bytes'] / GIB:9.2f}  {ok:4s}  {dv['modules']}")
    lines.append(f"  {'budget':32s}{_gib(plan.get('budget_bytes'))}  ({plan.get('budget_source')})")
    if plan.get("budget_bytes") is None:
        where = "per GPU" if plan["device"] == "cuda" else "of this device"
        lines.append(f"  fits is unknown: {'no CUDA device is visible here' if plan['device'] == 'cuda' else 'the device size is unknown'}; "
                     f"set memory.budget (bytes {where}), e.g. memory.budget=48GiB")
    rec = plan.get("recommendation")
    if rec:
        lines.append(f"  largest micro-batch that fits: {rec.get('max_micro_batch')}"
                     + (f" (with grad checkpointing: {rec['max_micro_batch_with_grad_checkpointing']})"
                        if "max_micro_batch_with_grad_checkpointing" in rec else ""))
        if rec.get("levers"):
            where = f" at {rec['levers_apply_to']}" if rec.get("levers_apply_to") else ""
            lines.append(f"  each of these alone fits{where}: "
                         + ", ".join(f"{lv['change']} ({lv['peak_bytes'] / GIB:.2f} GiB)" for lv in rec["levers"]))
        elif rec.get("max_micro_batch") is None and rec.get("max_micro_batch_with_grad_checkpointing") is None:
            lines.append(f"  nothing fits: micro-batch 1 with gradient checkpointing peaks at "
                         f"{rec['smallest_peak_bytes'] / GIB:.2f} GiB, and no single lever (8-bit optimizer, qlora, "
                         "bf16-true, fewer adapted layers, shorter seq_len) brings it under the budget")
    for n in plan.get("notes", []):
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def run_plan(cfg: Any) -> dict[str, Any]:
    """mode=plan: compute the plan, write ``cfg.run_dir/plan.json`` atomically (temp file +
    rename), print the table, return the plan."""
    from finetune.io import atomic_write_json

    p = plan(cfg)
    run_dir = Path(str(_get(cfg, "run_dir")))
    atomic_write_json(run_dir / "plan.json", p)
    print(format_table(p))
    return p
