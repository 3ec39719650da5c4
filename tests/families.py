"""Tiny random-init checkpoints of the model families people fine-tune, built by transformers
from each family's own config class (2 layers, hidden 64), with the tiny model's BPE tokenizer.

``build_family(name)`` writes an HF-format directory (config.json as transformers saves it,
model.safetensors, tokenizer files) once per process into a cache folder and returns it; both
backends load it through their ordinary loading code. ``FAMILIES`` says what each family is.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

VOCAB = 512
COMMON: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 512,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "tie_word_embeddings": False,
}

# family -> (model_type, config overrides, what it stands for)
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}}, "dense, Llama-3 RoPE"),
    "mistral": ("mistral", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}, "dense"),
    "gemma2": ("gemma2", {"head_dim": 16, "tie_word_embeddings": True, "sliding_window": 256,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
               "soft-capped attention and logits, a sliding window longer than the tests' rows"),
    "gemma3": ("gemma3_text", {"head_dim": 16, "tie_word_embeddings": True, "sliding_window": 8,
                               "layer_types": ["sliding_attention", "full_attention"]},
               "q/k norms, sandwich norms, local/global layers"),
    "qwen3": ("qwen3", {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
              "dense, q/k norms"),
    "phi3": ("phi3", {}, "fused qkv_proj and gate_up_proj"),
    "olmo2": ("olmo2", {}, "q/k norms on the whole projection, post-norms"),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, "MoE, 4 experts, top-2"),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "head_dim": 16, "norm_topk_prob": True}, "MoE, 4 experts, top-2, q/k norms"),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                            "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
                "MoE with biases and attention sinks"),
    "starcoder2": ("starcoder2", {"use_bias": True}, "plain two-matrix MLP, biases, LayerNorm"),
    "granite": ("granite", {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                            "attention_multiplier": 0.25}, "Llama's layout, scaled embeddings, residuals and logits"),
    "smollm3": ("smollm3", {"tie_word_embeddings": True, "no_rope_layer_interval": 2},
                "Llama's layout, tied head, RoPE left out of every second layer"),
    "ministral3": ("ministral3", {"head_dim": 16, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}},
                   "Llama's layout, YaRN RoPE and position-scaled attention"),
    "olmo3": ("olmo3", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
              "OLMo2's post-norms and q/k norms, local/global layers"),
    "glm4": ("glm4", {"head_dim": 16}, "q/k/v biases, fused gate_up_proj, four norms a layer, partial RoPE"),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}, "MoE, 4 experts, top-2, q/k norms over the "
              "whole projection"),
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 96},
                  "MoE, 4 experts, top-2, a shared expert with a sigmoid gate, q/k/v biases"),
}

# Families finetune does not describe exactly (finetune/model/describe.py FAMILIES): a dense
# Llama-like one priced from its sizes (cohere: LayerNorm without bias, a parallel block, logits
# scaled after the head), a plain-MLP one with q/k/v names (phi-2), and the layouts it must refuse
# in one line (GPT-NeoX's fused query_key_value, GPT-2's n_embd sizes, an MoE it cannot price).
UNDESCRIBED: dict[str, tuple[str, dict[str, Any], str]] = {
    "cohere": ("cohere", {"logit_scale": 0.25, "tie_word_embeddings": True}, "Llama-like names, parallel block, scaled logits: trains, approximate"),
    "phi": ("phi", {"partial_rotary_factor": 0.5}, "phi-2: q/k/v/dense, fc1/fc2, LayerNorm: trains, approximate"),
    "gpt_neox": ("gpt_neox", {}, "fused query_key_value: LoRA refused"),
    "gpt2": ("gpt2", {}, "n_embd/n_layer sizes: refused"),
    "granitemoe": ("granitemoe", {"num_local_experts": 4, "num_experts_per_tok": 2}, "an MoE not described: refused"),
    "gemma4_text": ("gemma4_text", {"head_dim": 16, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8},
                    "per-layer input embeddings the Llama-style layout leaves out: priced from the checkpoint"),
}


def cache_root() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune")) / "families"


def family_config(name: str) -> Any:
    """The transformers config object of family ``name``'s tiny checkpoint."""
    from transformers import AutoConfig

    model_type, extra, _ = FAMILIES[name] if name in FAMILIES else UNDESCRIBED[name]
    return AutoConfig.for_model(model_type, **{**COMMON, **extra})


def build_family(name: str, seed: int = 0) -> Path:
    """Directory of family ``name``'s tiny checkpoint (fp32), built once and reused."""
    from transformers import AutoModelForCausalLM

    return _build_once(f"{name}-v1-s{seed}", lambda: AutoModelForCausalLM.from_config(family_config(name)), seed)


def _build_once(folder: str, make: Any, seed: int) -> Path:
    """``cache_root()/folder``: the model ``make()`` builds (seeded, fp32) saved as transformers
    saves it, with the tiny BPE tokenizer and ``dtype: float32`` in config.json; built once, and
    renamed into place whole (another process may have built it first)."""
    import torch

    from finetune.model.tiny import _write_tokenizer

    final = cache_root() / folder
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder}-", dir=final.parent))
    try:
        torch.manual_seed(seed)
        make().to(torch.float32).save_pretrained(str(tmp))
        _write_tokenizer(tmp, VOCAB)
        hf = json.loads((tmp / "config.json").read_text())
        hf["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _multimodal_config(kind: str) -> Any:
    from transformers import AutoConfig

    if kind == "gemma3":  # Gemma3ForConditionalGeneration: the gemma3 family's text model, a SigLIP tower
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 28, "patch_size": 14}
        return AutoConfig.for_model("gemma3", text_config=family_config("gemma3").to_dict(), vision_config=vision,
                                    mm_tokens_per_image=4, image_token_index=5, boi_token_index=6, eoi_token_index=7)
    if kind == "qwen3_5":  # Qwen3.5: a hybrid language model (linear and full attention) no family describes
        text = {**COMMON, "model_type": "qwen3_5_text", "head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"]}
        return AutoConfig.for_model("qwen3_5", text_config=text, vision_config={
            "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64})
    if kind == "qwen2_5_vl":  # a language model with M-RoPE, which transformers has no text-only class for
        text = {**COMMON, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4}}
        return AutoConfig.for_model("qwen2_5_vl", text_config=text, vision_config={
            "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64})
    # Mistral3ForConditionalGeneration (Mistral Small 3.1): the mistral family's text model, a Pixtral
    # tower; its outer config ties the head (Mistral3Config's default) over an untied text config
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14, "head_dim": 16}
    return AutoConfig.for_model("mistral3", text_config=family_config("mistral").to_dict(), vision_config=vision,
                                spatial_merge_size=1)


MULTIMODAL = ("gemma3", "mistral3")


def build_multimodal(kind: str = "gemma3", seed: int = 0) -> Path:
    """A tiny multimodal checkpoint of ``kind`` (``MULTIMODAL``: a described family's text model
    beside a one-layer vision tower), saved as transformers saves it (the vocabulary in
    ``text_config`` only, as in the released configs). Built once."""
    from transformers import AutoModelForImageTextToText

    return _build_once(f"{kind}-multimodal-v2-s{seed}",
                       lambda: AutoModelForImageTextToText.from_config(_multimodal_config(kind)), seed)


def reference_loss(logits: Any, ids: Any, mask: Any) -> float:
    """The summed cross-entropy of ``logits`` [B, T, V] at the targets ``ids[:, 1:]`` weighted by
    ``mask[:, 1:]``, in float64 with numpy: the loss a model's own logits give, to hold a
    backend's loss to."""
    import numpy as np

    z = np.asarray(logits)[:, :-1].astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.asarray(ids)[:, 1:, None], -1)[..., 0]
    return float(-(picked * np.asarray(mask)[:, 1:]).sum())
