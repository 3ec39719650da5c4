"""What the planner prices: the architecture, the resolved setup and the parameter inventory.

Generic: the backend's own knowledge (dtypes it stores, quantization, where it runs) comes from
its memory model, ``finetune/backends/<name>/memory.py``, which ``memory_model`` loads.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from finetune.config import UserError, check_backend_support

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


def memory_model(backend: str) -> ModuleType:
    """The backend's torch/mlx-free memory model module (finetune.backends.<name>.memory)."""
    from finetune.backends import BACKENDS

    if backend not in BACKENDS:
        raise UserError(f"backend={backend} is not valid; choose one of: auto, {', '.join(BACKENDS)}")
    return importlib.import_module(f"finetune.backends.{backend}.memory")


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


def resolve(cfg: Any, seq_len: int | None = None, state: Any = None) -> tuple[Arch, Setup]:
    """Resolve the config (and the machine, for backend=auto and the GPU count) into an
    architecture and a setup. ``state`` (a finetune.state.RunState) overrides the backend,
    micro-batch, accumulation, checkpointing and loss chunk with the run's live values. Raises UserError
    for a combination the backend would refuse."""
    arch = arch_from_cfg(_get(cfg, "model"))
    b = _get(cfg, "backend")
    from finetune.backends import concrete_name

    backend = state.backend if state is not None else concrete_name(str(_get(b, "name", "auto")))
    m, o, t = _get(cfg, "method"), _get(cfg, "optim"), _get(cfg, "train")
    method, optim = str(_get(m, "name", "lora")), str(_get(o, "name", "adamw"))
    precision = str(_get(_get(cfg, "precision"), "name", "32-true"))
    if method not in ("lora", "dora", "qlora", "full"):
        raise UserError(f"method={method} is not valid; choose one of: lora, dora, qlora, full")
    notes: list[str] = []
    from finetune import precision as prec_mod
    from finetune.model_source import stored_dtype, stored_quantization

    check_backend_support(backend, cfg)  # the same refusal the backend gives at setup
    model_cfg = _get(cfg, "model")
    stored, dtype_source = stored_dtype(model_cfg)
    pre_quant = stored_quantization(model_cfg)
    mm = memory_model(backend)
    mm.pre_quantized(cfg, pre_quant)
    device, n_devices, dev_notes = mm.resolve_device(cfg, str(_get(cfg, "mode", "train") or "train"), method)
    notes += dev_notes
    world_size, strategy = mm.ranks(cfg)  # the backend's refusals for a strategy come from here
    # both runtimes load with these same dtypes (finetune/precision.py)
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
        batch=state.micro_batch if state is not None else int(_get(t, "batch_size", 1)), seq_len=T,
        grad_accum=state.grad_accum if state is not None else int(_get(t, "grad_accum", 1)),
        ckpt=state.grad_checkpointing if state is not None else bool(_get(t, "grad_checkpointing", False)), attn="sdpa" if attn == "flash_attention_2" else attn,
        momentum=float(_get(o, "momentum", 0.0) or 0.0), clip=_get(o, "max_grad_norm", 1.0) is not None,
        budget_text=_get(_get(cfg, "memory"), "budget"), notes=notes, dtype_source=dtype_source,
        pre_quant=pre_quant if backend == "mlx" else None, world_size=world_size, strategy=strategy,
        loss_chunk=state.loss_chunk if state is not None else int(_get(t, "loss_chunk", 0) or 0),
        padding_mask=bool(_get(model_cfg, "trust_remote_code", False)),
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
    out: list[Tensor] = []

    mm = memory_model(s.backend)

    def quant_of(role: str, in_f: int) -> str | None:
        return mm.quant_of(s, role, in_f)

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



def _first_stage(s: Setup) -> int:
    """Stage of the block where gradients start in the lowest layer that needs them."""
    if s.method == "full":
        return 0
    return min(_STAGE[k] for k in s.keys)
