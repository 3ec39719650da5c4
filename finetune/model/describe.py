"""The model description: every weight of a checkpoint with its shape and kind, read from the
checkpoint's own ``config.json`` (a local directory, the hub's cached config for a hub id, or a
preset holding a released config's facts; ``finetune.model.source.model_config``).

One frozen ``ModelDesc`` is shared by the planner (the parameter inventory, activations), both
runtimes and the config checks (which LoRA targets exist, what ``all-linear`` means). Nothing
here assumes a Llama: each family's block is built from what its transformers modeling file
creates (transformers 5.24: ``models/<family>/modeling_<family>.py`` ``__init__``s), and mlx-lm
0.32 builds the same matrices (checked per family by tests/test_families.py against a meta-device
count and a loaded model). A family not listed in ``FAMILIES`` is described as a Llama-style
decoder *with a note saying so*; nothing is priced as a Llama silently.

No torch, no mlx: ``mode=plan`` stays light.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, NamedTuple

from finetune.errors import UserError
from finetune.model.source import text_config
from finetune.model.types import STAGE_ATTN_IN, STAGE_ATTN_OUT, STAGE_MLP_IN, STAGE_MLP_OUT, Block, Linear, ModelDesc

# ---- building it from config.json --------------------------------------------------------------

# Families described exactly, with what each one's transformers config class defaults to where
# a config.json leaves a key out (configuration_<family>.py __init__ defaults, transformers 5.24).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "mistral": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {"tie_word_embeddings": False},
    "olmo2": {"tie_word_embeddings": False},
    "gemma": {"tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"tie_word_embeddings": True},
    "phi3": {"tie_word_embeddings": False},
    "mixtral": {"tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
                  "decoder_sparse_step": 1, "moe_intermediate_size": 768},
    "gpt_oss": {"tie_word_embeddings": False, "num_local_experts": 128, "num_experts_per_tok": 4,
                "attention_bias": True},
    "starcoder2": {"tie_word_embeddings": True, "use_bias": True},
    # Llama's layout: granite scales embeddings, residuals, attention and logits (no weight of
    # its own); smollm3 leaves RoPE out of every fourth layer (no weight either)
    "granite": {"tie_word_embeddings": False},
    "ministral3": {"tie_word_embeddings": False, "head_dim": 128},  # Llama's layout, YaRN RoPE
    "olmo3": {"tie_word_embeddings": False, "sliding_window": 4096},  # OLMo2's, local/global layers
    # q/k/v biases, fused gate_up_proj, a norm after attention and after the MLP besides Llama's two
    "glm4": {"tie_word_embeddings": False, "attention_bias": True, "head_dim": 128},
    "smollm3": {"tie_word_embeddings": True},
    "olmoe": {"tie_word_embeddings": False, "num_experts": 64, "num_experts_per_tok": 8},
    "qwen2_moe": {"tie_word_embeddings": False, "num_experts": 60, "num_experts_per_tok": 4,
                  "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "qkv_bias": True},
}

# MoE families whose layer pattern is decoder_sparse_step / mlp_only_layers and whose experts'
# width is moe_intermediate_size (the others: intermediate_size, every layer)
_SPARSE_STEP = ("qwen3_moe", "qwen2_moe")
# olmo2 and olmoe norm q and k over the whole projection; qwen3 and gemma3 per head
_QK_NORM_FULL = ("olmo2", "olmoe", "olmo3")

# transformers picks eager attention for these (their modeling files do not support sdpa:
# soft-capped scores in Gemma-2, attention sinks in gpt-oss); sdpa elsewhere.
_EAGER_ONLY = {"gemma2": "soft-capped attention scores", "gpt_oss": "attention sinks"}


def _text(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model (``text_config``; its head tied as the whole model's
    config says where it says so, finetune.model.source ``text_config``), else the config itself."""
    if "hidden_size" not in hf and isinstance(hf.get("text_config"), dict):
        return text_config(hf)
    return hf


# the sizes a Llama-style decoder is priced from; a family not in FAMILIES must give all of them
_LLAMA_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _need(c: dict[str, Any], key: str, source: str) -> Any:
    v = c.get(key)
    if v is None:
        raise UserError(f"{source}: config.json has no {key}; point model.path at a complete model directory")
    return v


Others = list[tuple[str, tuple[int, ...], str, float, int]]


class _Sizes(NamedTuple):
    """The sizes config.json gives (a family's defaults filled in)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # 0 where config.json leaves it out

    @property
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim


def _sizes(c: dict[str, Any], source: str) -> _Sizes:
    """Raises UserError where config.json lacks a size nothing can stand in for."""
    h = int(_need(c, "hidden_size", source))
    L = int(_need(c, "num_hidden_layers", source))
    heads = int(_need(c, "num_attention_heads", source))
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or h // heads)
    V = int(_need(c, "vocab_size", source))
    return _Sizes(h, L, heads, kv, hd, V, int(c.get("intermediate_size") or 0))


def _attention(c: dict[str, Any], mt: str, z: _Sizes) -> tuple[list[Linear], Others, bool, bool]:
    """A block's attention: its projections, its q/k norms and sinks, whether q/k/v are one
    fused projection and whether q and k are normed."""
    h, q_out, kv_out = z.hidden, z.q_out, z.kv_out
    bias_all = bool(c.get("use_bias")) if mt == "starcoder2" else bool(c.get("attention_bias", False))
    qkv_bias = True if mt == "qwen2" else bool(c.get("qkv_bias")) if mt == "qwen2_moe" else bias_all
    o_bias = False if mt in ("qwen2", "glm4") else bias_all
    fused = mt == "phi3"
    attn: list[Linear] = []
    if fused:  # Phi3Attention: one qkv_proj of (heads + 2 kv) * head_dim
        attn.append(Linear("qkv_proj", "self_attn.qkv_proj", h, q_out + 2 * kv_out, qkv_bias, "attention",
                           STAGE_ATTN_IN))
    else:
        attn += [Linear("q_proj", "self_attn.q_proj", h, q_out, qkv_bias, "attention", STAGE_ATTN_IN),
                 Linear("k_proj", "self_attn.k_proj", h, kv_out, qkv_bias, "attention", STAGE_ATTN_IN),
                 Linear("v_proj", "self_attn.v_proj", h, kv_out, qkv_bias, "attention", STAGE_ATTN_IN)]
    attn.append(Linear("o_proj", "self_attn.o_proj", q_out, h, o_bias, "attention", STAGE_ATTN_OUT))
    others: Others = []
    qk_norm = mt in ("qwen3", "qwen3_moe", "gemma3_text", *_QK_NORM_FULL)
    if qk_norm:
        # Qwen3/Gemma3: RMSNorm over head_dim; OLMo2/OLMoE: over the whole projection
        qn, kn = ((q_out,), (kv_out,)) if mt in _QK_NORM_FULL else ((z.head_dim,), (z.head_dim,))
        others += [("self_attn.q_norm.weight", qn, "norm", 1.5, q_out),
                   ("self_attn.k_norm.weight", kn, "norm", 1.5, kv_out)]
    if mt == "gpt_oss":
        others.append(("self_attn.sinks", (z.heads,), "sinks", 1.5, 0))  # GptOssAttention.sinks: one per head
    return attn, others, fused, qk_norm


def _block_norms(mt: str, h: int) -> Others:
    """The norms of a block (and a LayerNorm's biases), each at the stage where it runs."""
    names = {"gemma2": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm"),
             "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
             "glm4": ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")}
    names["olmo3"] = names["olmo2"]
    norm_names = names.get(mt, ("input_layernorm", "post_attention_layernorm"))
    if mt == "gemma3_text":
        norm_names = names["gemma2"]
    layer_norm = mt == "starcoder2"  # nn.LayerNorm with bias
    # where each norm runs: before attention, after its output projection (Gemma/OLMo2's
    # post-attention norm), before the MLP, after it
    sandwich = mt in ("gemma2", "gemma3_text", "olmo2", "olmo3")
    where = {"input_layernorm": 0.0, "post_attention_layernorm": 2.5 if sandwich else 3.0,
             "pre_feedforward_layernorm": 3.0, "post_feedforward_layernorm": 5.5,
             "post_self_attn_layernorm": 2.5, "post_mlp_layernorm": 5.5}  # glm4's
    norms: Others = []
    for n in norm_names:
        norms.append((f"{n}.weight", (h,), "norm", where[n], h))
        if layer_norm:
            norms.append((f"{n}.bias", (h,), "bias", where[n], h))
    return norms


def _dense_mlp(mt: str, h: int, width: int, bias: bool) -> tuple[list[Linear], Others]:
    if mt == "starcoder2":  # Starcoder2MLP: c_fc, gelu, c_proj (both with use_bias)
        return [Linear("c_fc", "mlp.c_fc", h, width, bias, "mlp", STAGE_MLP_IN),
                Linear("c_proj", "mlp.c_proj", width, h, bias, "mlp", STAGE_MLP_OUT)], []
    if mt in ("phi3", "glm4"):  # Phi3MLP, Glm4MLP: one gate_up_proj of 2 x intermediate
        return [Linear("gate_up_proj", "mlp.gate_up_proj", h, 2 * width, bias, "mlp", STAGE_MLP_IN),
                Linear("down_proj", "mlp.down_proj", width, h, bias, "mlp", STAGE_MLP_OUT)], []
    return [Linear("gate_proj", "mlp.gate_proj", h, width, bias, "mlp", STAGE_MLP_IN),
            Linear("up_proj", "mlp.up_proj", h, width, bias, "mlp", STAGE_MLP_IN),
            Linear("down_proj", "mlp.down_proj", width, h, bias, "mlp", STAGE_MLP_OUT)], []


def _moe_mlp(mt: str, h: int, width: int, experts: int, shared: int) -> tuple[list[Linear], Others]:
    """transformers 5: the router, then every expert's gate and up fused into one stacked
    [E, 2 x width, h] parameter and the down projections in [E, h, width] (gpt-oss stores them
    transposed, [E, h, 2 x width] and [E, width, h]: same counts). Qwen2-MoE adds a shared
    expert every token runs (``mlp.shared_expert``, a gated MLP of width ``shared``) and its
    sigmoid gate (``mlp.shared_expert_gate``, one output)."""
    router = "router" if mt == "gpt_oss" else "gate"
    lins = [Linear(router, f"mlp.{router}", h, experts, mt == "gpt_oss", "router", STAGE_MLP_IN, module=False),
            Linear("experts", "mlp.experts.gate_up_proj", h, 2 * width, False, "expert", STAGE_MLP_IN, experts),
            Linear("experts", "mlp.experts.down_proj", width, h, False, "expert", STAGE_MLP_OUT, experts)]
    if shared:  # Qwen2MoeSparseMoeBlock: shared_expert (Qwen2MoeMLP) and shared_expert_gate
        lins += [Linear("gate_proj", "mlp.shared_expert.gate_proj", h, shared, False, "mlp", STAGE_MLP_IN),
                 Linear("up_proj", "mlp.shared_expert.up_proj", h, shared, False, "mlp", STAGE_MLP_IN),
                 Linear("down_proj", "mlp.shared_expert.down_proj", shared, h, False, "mlp", STAGE_MLP_OUT),
                 Linear("shared_expert_gate", "mlp.shared_expert_gate", h, 1, False, "router", STAGE_MLP_IN)]
    others: Others = []
    if mt == "gpt_oss":  # GptOssExperts: gate_up_proj_bias [E, 2 x width], down_proj_bias [E, h]
        others = [("mlp.experts.gate_up_proj_bias", (experts, 2 * width), "bias", 4.0, 0),
                  ("mlp.experts.down_proj_bias", (experts, h), "bias", 5.0, 0)]
    return lins, others


def _experts(c: dict[str, Any], mt: str) -> tuple[int, int]:
    """(experts, top-k) of a described MoE family; (0, 0) for a dense model."""
    experts = int(c.get("num_local_experts") or c.get("num_experts") or 0) if mt in (
        "mixtral", "qwen3_moe", "gpt_oss", "olmoe", "qwen2_moe") else 0
    top_k = int(c.get("num_experts_per_tok") or c.get("experts_per_token") or 0) if experts else 0
    return experts, top_k


def _layer_kinds(c: dict[str, Any], mt: str, layers: int, experts: int,
                 sliding_window: Any) -> list[tuple[bool, bool]]:
    """(runs experts, sliding-window attention) of each layer, in order."""
    layer_types = c.get("layer_types") if isinstance(c.get("layer_types"), list) else None
    mlp_only = set(c.get("mlp_only_layers") or [])
    step = int(c.get("decoder_sparse_step") or 1)
    kinds: list[tuple[bool, bool]] = []
    for i in range(layers):
        is_moe = bool(experts) and (mt not in _SPARSE_STEP or (i not in mlp_only and (i + 1) % step == 0))
        if layer_types and i < len(layer_types):
            sliding = layer_types[i] == "sliding_attention" and bool(sliding_window)
        elif mt == "gemma2":
            sliding = i % 2 == 0 and bool(sliding_window)  # Gemma2: every other layer, from the first
        elif mt == "olmo3":  # Olmo3Config's default layer_types: every fourth layer global
            sliding = (i + 1) % 4 != 0 and bool(sliding_window)
        else:
            sliding = bool(sliding_window)
        kinds.append((is_moe, sliding))
    return kinds


def describe(hf: dict[str, Any], source: str) -> ModelDesc:
    """The description of the model ``hf`` (a config.json dict) defines.

    Raises UserError for a config too incomplete to describe.
    """
    c = _text(hf)
    mt = str(c.get("model_type") or "")
    notes: list[str] = []
    described = mt in FAMILIES
    if not described:
        notes.append(f"model_type={mt or '?'} is not a family finetune describes exactly "
                     f"({', '.join(sorted(FAMILIES))}): priced as a Llama-style decoder from its sizes (approximate)")
    c = {**FAMILIES.get(mt, {"tie_word_embeddings": False}), **{k: v for k, v in c.items() if v is not None}}
    if not described and any(int(c.get(k) or 0) > 1 for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise UserError(f"{source}: model_type={mt} is a mixture of experts finetune cannot describe (priced as "
                        "a dense decoder, its experts would be left out of the plan and of LoRA's targets); use a "
                        f"model of a described family: {', '.join(sorted(FAMILIES))}")
    if not described and any(c.get(k) is None for k in _LLAMA_SIZES):
        # GPT-2 (n_embd, n_layer), T5-style (d_model), ...: no Llama-style sizes to price, even roughly
        missing = ", ".join(k for k in _LLAMA_SIZES if c.get(k) is None)
        raise UserError(f"{source}: model_type={mt or '?'} is not a family finetune can describe (its config.json "
                        f"has no {missing}: another layout than a Llama-style decoder's); use a model of a described "
                        f"family: {', '.join(sorted(FAMILIES))}")
    z = _sizes(c, source)
    h, f = z.hidden, z.intermediate
    attn, attn_others, fused, qk_norm = _attention(c, mt, z)
    norms = _block_norms(mt, h)
    layer_norm = mt == "starcoder2"  # nn.LayerNorm with bias
    experts, top_k = _experts(c, mt)
    mlp_bias = bool(c.get("use_bias")) if mt == "starcoder2" else bool(c.get("mlp_bias", False))
    sliding_window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    blocks: list[Block] = []
    cache: dict[tuple[bool, bool], Block] = {}  # one Block per kind of layer, shared
    for key in _layer_kinds(c, mt, z.layers, experts, sliding_window):
        is_moe, sliding = key
        if key not in cache:
            width = (int(c.get("moe_intermediate_size") or f) if mt in _SPARSE_STEP else f) if is_moe else f
            if width <= 0:
                raise UserError(f"{source}: config.json has no intermediate_size; "
                                "point model.path at a complete model directory")
            shared = int(c.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0
            mlp, mlp_others = (_moe_mlp(mt, h, width, experts, shared) if is_moe
                               else _dense_mlp(mt, h, width, mlp_bias))
            cache[key] = Block(tuple(attn + mlp), tuple(attn_others + norms + mlp_others), is_moe, sliding)
        blocks.append(cache[key])

    top = [("model.norm.weight", (h,), "norm", 6.0, h)] + ([("model.norm.bias", (h,), "bias", 6.0, h)] if layer_norm else [])
    if experts and mt == "gpt_oss":
        notes.append("gpt-oss: the released checkpoint stores its experts in MXFP4; priced dequantized to the load "
                     "dtype, as transformers loads them where no MXFP4 kernel runs (an over-estimate where one does, "
                     "and on mlx, whose mlx-lm keeps them in MXFP4)")
    return ModelDesc(
        model_type=mt, hidden=h, layers=z.layers, heads=z.heads, kv_heads=z.kv_heads, head_dim=z.head_dim,
        vocab=z.vocab, tie=bool(c.get("tie_word_embeddings")), blocks=tuple(blocks), top=tuple(top),
        experts=experts, top_k=top_k, gated_mlp=mt != "starcoder2",
        # gpt-oss's experts ignore hidden_act: GptOssExperts._apply_gate clamps gate and up, then
        # (up + 1) * gate * sigmoid(alpha * gate)
        mlp_act="clamped_swiglu" if mt == "gpt_oss" else str(c.get("hidden_act") or c.get("hidden_activation") or "silu"),
        norm="layer" if layer_norm else "rms", qk_norm=qk_norm,
        attn_softcap=c.get("attn_logit_softcapping") if mt == "gemma2" else None,
        final_softcap=c.get("final_logit_softcapping") if mt in ("gemma2", "gemma3_text") else None,
        sliding_window=int(sliding_window) if sliding_window else None,
        attn_default="eager" if mt in _EAGER_ONLY else "sdpa", fused_qkv=fused, source=source,
        notes=tuple(notes), described=described,
    )


# ---- a family not described, against its checkpoint ------------------------------------------

UNDESCRIBED_WEIGHTS = "model.weights_not_in_layout"  # the top-level entry carrying them


def reconcile(desc: ModelDesc, found: tuple[int, str] | None) -> ModelDesc:
    """A family priced as a Llama-style decoder, held against what its checkpoint holds (``found``:
    the elements of its safetensors files' tensors and where they were read,
    ``finetune.model.source.checkpoint_elements``). Weights the layout leaves out (per-layer
    embeddings, a hybrid's linear-attention projections, extra norms) are priced as one more
    top-level weight of the load dtype, so the plan's weights, and under full fine-tuning its
    gradients and optimizer state, are the checkpoint's own; a layout that lists more than the
    checkpoint holds is said, with how much. Activations stay the Llama-style layout's. A
    described family, or nothing read, is returned as it is."""
    if desc.described or found is None:
        return desc
    real, where = found
    listed = desc.weight_elements()
    if real == listed:
        note = f"its {real:,} weights are the ones its checkpoint holds ({where}: safetensors headers)"
        return replace(desc, notes=desc.notes + (note,))
    share = abs(real - listed) / real if real else 1.0
    pct = f"{share:.0%}" if share >= 0.01 else "under 1%"
    if real < listed:
        note = (f"the Llama-style layout lists {listed:,} weights, its checkpoint holds {real:,} ({where}: "
                f"safetensors headers): weights priced {pct} high")
        return replace(desc, notes=desc.notes + (note,))
    extra = real - listed
    note = (f"its checkpoint holds {real:,} weights ({where}: safetensors headers), {extra:,} ({pct}) more "
            "than the Llama-style layout lists: those are priced as frozen weights of the load dtype, their "
            "activations not at all")
    top = desc.top + ((UNDESCRIBED_WEIGHTS, (extra,), "other", 6.0, 0),)
    return replace(desc, top=top, notes=desc.notes + (note,))


# ---- what LoRA adapts --------------------------------------------------------------------------

ALL_LINEAR = "all-linear"
EXPERTS = "experts"
HEAD = "lm_head"  # the output head (PEFT adapts it; never part of all-linear)


def default_keys(desc: ModelDesc) -> tuple[str, ...]:
    """The attention's query and value projections where they exist, else the fused attention
    projection (Phi-3's qkv_proj)."""
    keys = desc.linear_keys()
    if "q_proj" in keys and "v_proj" in keys:
        return ("q_proj", "v_proj")
    return tuple(k for k in keys if k == "qkv_proj") or keys[:1]


def lora_keys(desc: ModelDesc, keys: Any) -> tuple[str, ...]:
    """``method.lora.keys`` checked against the model: the block keys to adapt, in forward order.

    Accepts the module names of the model's blocks (``q_proj``; mlx-lm's dotted paths such as
    ``self_attn.q_proj`` too), ``all-linear`` (every attention and MLP linear of the blocks, no
    head, no router; on MoE models the experts are adapted only when named), ``experts`` (every
    expert's matrices), ``lm_head`` (the output head; backends that cannot adapt it refuse) and
    null (``default_keys``). Raises UserError naming the model's own keys.
    """
    if keys is None or (isinstance(keys, str) and keys in ("", "default")):
        return default_keys(desc)
    wanted = [keys] if isinstance(keys, str) else list(keys)
    valid = tuple(lin.key for lin in dict.fromkeys(x for b in desc.blocks for x in b.linears) if lin.kind != "router")
    valid = tuple(dict.fromkeys(valid))
    adaptable = tuple(k for k in valid if k != EXPERTS)
    choices = ", ".join([*adaptable, ALL_LINEAR] + ([EXPERTS] if EXPERTS in valid else []) + [HEAD])
    out: list[str] = []
    for k in wanted:
        k = str(k)
        if k == HEAD:
            picks = [HEAD]
        elif k == ALL_LINEAR:
            picks = [lin.key for b in desc.blocks for lin in b.linears if lin.kind in ("attention", "mlp")]
        else:
            short = k.rsplit(".", 1)[-1]
            paths = {lin.path.rsplit(".", 1)[0] if lin.key == EXPERTS else lin.path: lin.key
                     for b in desc.blocks for lin in b.linears}
            hit = k if k in valid else short if short in valid and short != EXPERTS else paths.get(k)
            if hit is None:
                raise UserError(f"method.lora.keys: {k} is not a linear layer of this {desc.model_type} model's "
                                f"blocks; choose from: {choices}")
            picks = [hit]
        for p in picks:
            if p not in out:
                out.append(p)
    if not out:
        raise UserError(f"method.lora.keys is empty; choose from: {choices}")
    order = {k: i for i, k in enumerate((*valid, HEAD))}
    return tuple(sorted(out, key=order.__getitem__))


def check_targets(desc: ModelDesc, keys: tuple[str, ...], found: set[str], loader: str) -> None:
    """UserError where the loaded model's blocks have no layer named as a resolved LoRA key.

    ``found``: the leaf names of the linear layers the backend's loaded model has (``loader``
    built it: transformers, mlx-lm). A described family always has its keys (tests/test_families.py);
    a family priced as a Llama-style decoder may not (GPT-NeoX's ``query_key_value``), and then
    neither LoRA nor the plan fits it.
    """
    missing = [k for k in keys if k not in (EXPERTS, HEAD) and k not in found]
    if not missing:
        return
    has = ", ".join(sorted(found)) or "none"
    if not desc.described:
        raise UserError(f"model_type={desc.model_type} is not a family finetune describes exactly: it is priced as a "
                        f"Llama-style decoder, whose {', '.join(missing)} its blocks do not have ({loader} built: "
                        f"{has}), so LoRA has nothing to adapt there and the plan does not hold; use a model of a "
                        f"described family: {', '.join(sorted(FAMILIES))}")
    raise UserError(f"model_type={desc.model_type}: {loader} built blocks without {', '.join(missing)} (it built: {has}), "
                    "unlike the family's own layout; is config.json from another model? Point model.path at the "
                    "checkpoint's own directory")


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
