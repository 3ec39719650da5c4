"""The ``tiny`` model: a random-init Qwen2 with a BPE tokenizer trained on the built-in data.

Written once as an HF-format directory (config.json, model.safetensors, tokenizer files) into
a cache folder and reused; both backends load that same directory through their ordinary
loading code (transformers on cuda, mlx-lm on mlx). Weights are drawn with numpy, so building
it needs neither torch nor mlx.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from finetune.io import as_umask
from finetune.synthetic import generate
from finetune.spec import ModelSpec

BUILDER_VERSION = 2  # 2: weights at a trained network's scale, so the default LoRA job visibly learns
EMBED_STD = 0.1  # embeddings (tied to the head): logits can reach ~6 nats at the head, starting near uniform
SELF_QK_STD = 0.2  # each query head equal to its key head: attention starts on the token itself
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def cache_root() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune"))


def _arch(m: ModelSpec) -> dict[str, Any]:
    keys = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
            "vocab_size", "tie_embeddings", "attn_bias", "max_position", "rope_theta", "rms_norm_eps")
    return {k: getattr(m, k) for k in keys}


def hf_config(arch: dict[str, Any]) -> dict[str, Any]:
    head_dim = arch["head_dim"] or arch["hidden_size"] // arch["num_heads"]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": arch["hidden_size"],
        "intermediate_size": arch["intermediate_size"],
        "num_hidden_layers": arch["num_layers"],
        "num_attention_heads": arch["num_heads"],
        "num_key_value_heads": arch["num_kv_heads"],
        "head_dim": head_dim,
        "vocab_size": arch["vocab_size"],
        "max_position_embeddings": arch["max_position"],
        "rope_theta": arch["rope_theta"],
        "rms_norm_eps": arch["rms_norm_eps"],
        "tie_word_embeddings": arch["tie_embeddings"],
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": arch["num_layers"],
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _weights(arch: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, v, f = arch["hidden_size"], arch["vocab_size"], arch["intermediate_size"]
    hd = arch["head_dim"] or h // arch["num_heads"]
    q_out, kv_out = arch["num_heads"] * hd, arch["num_kv_heads"] * hd

    def normal(out_f: int, in_f: int, std: float) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) * std).astype(np.float32)

    def lin(out_f: int, in_f: int) -> np.ndarray:  # 1/sqrt(fan_in): each linear keeps its input's scale
        return normal(out_f, in_f, in_f ** -0.5)

    # A random model at the usual 0.02 init cannot be taught by LoRA on q/v in a demo's steps:
    # its tied head bounds every logit near 0.16 (|h| 8 x |e| 0.02*8), o_proj damps what v learns
    # 6-fold, and near-uniform attention spreads the token's own value over the whole row (the
    # default job went 6.21 -> 5.97 against a uniform 6.24). At these scales it reaches ~4.3.
    w = {"model.embed_tokens.weight": normal(v, h, EMBED_STD), "model.norm.weight": np.ones(h, np.float32)}
    group = arch["num_heads"] // arch["num_kv_heads"]
    for i in range(arch["num_layers"]):
        p = f"model.layers.{i}."
        k = normal(kv_out, h, SELF_QK_STD)
        w[p + "self_attn.q_proj.weight"] = np.concatenate(
            [k[j * hd:(j + 1) * hd] for j in range(arch["num_kv_heads"]) for _ in range(group)])
        w[p + "self_attn.k_proj.weight"] = k
        w[p + "self_attn.v_proj.weight"] = lin(kv_out, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, q_out)
        if arch["attn_bias"]:
            w[p + "self_attn.q_proj.bias"] = np.zeros(q_out, np.float32)
            w[p + "self_attn.k_proj.bias"] = np.zeros(kv_out, np.float32)
            w[p + "self_attn.v_proj.bias"] = np.zeros(kv_out, np.float32)
        w[p + "mlp.gate_proj.weight"] = lin(f, h)
        w[p + "mlp.up_proj.weight"] = lin(f, h)
        w[p + "mlp.down_proj.weight"] = lin(h, f)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    if not arch["tie_embeddings"]:
        w["lm_head.weight"] = lin(v, h)
    return w


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [r["prompt"] + r["completion"] for r in generate(4000, seed=1234)]
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_tiny(model: ModelSpec, seed: int = 0) -> Path:
    """Return the directory of the tiny model for these architecture numbers, building it once.

    The directory is assembled under a temporary name and renamed into place, so a reader
    never sees a half-written model, and two processes building at once both end well.
    """
    arch = _arch(model)
    key = hashlib.sha256(json.dumps([BUILDER_VERSION, arch, seed], sort_keys=True).encode()).hexdigest()[:12]
    final = cache_root() / f"tiny-qwen2-{key}"
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-tiny-", dir=final.parent))
    try:
        from safetensors.numpy import save_file

        _write_tokenizer(tmp, arch["vocab_size"])
        save_file(_weights(arch, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(arch), indent=2))
        as_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600: the model is as readable as the umask says
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
