"""The ``tiny`` model: a random-init Qwen2 with a BPE tokenizer trained on the built-in data.

Built from config.json facts alone: the preset's ``config:`` block (conf/model/tiny.yaml), with
the user's overrides (``model.config.num_hidden_layers=4``), is the config.json it writes, and its
numbers size the weights. Written once as an HF-format directory (config.json, model.safetensors,
tokenizer files) into a cache folder and reused; both backends load that same directory through
their ordinary loading code (transformers on cuda, mlx-lm on mlx). Weights are drawn with numpy,
so building it needs neither torch nor mlx.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import numpy as np

from finetune.errors import UserError
from finetune.io import as_umask
from finetune.synthetic import generate

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


# config.json's names of the numbers the builder draws weights from, under the names builder 2
# hashed them by (the cache key below keeps builder 2's, so a model built then is reused)
_NUMBERS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "intermediate_size": "intermediate_size",
            "vocab_size": "vocab_size", "tie_embeddings": "tie_word_embeddings",
            "max_position": "max_position_embeddings", "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps"}
_COUNTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "vocab_size", "max_position_embeddings")


@functools.lru_cache(maxsize=32)
def preset_config(name: str) -> tuple[tuple[str, Any], ...] | None:
    """The ``config:`` block of preset ``name`` (conf/model/NAME.yaml) as the YAML states it,
    interpolations resolved, as (key, value) pairs; None where the preset has none. The tiny
    model is built from its own; ``finetune.model.source`` tells a user's facts from a preset's."""
    from importlib import resources

    from omegaconf import DictConfig, OmegaConf

    f = resources.files("finetune.conf") / "model" / f"{name}.yaml"
    if not f.is_file():
        return None
    doc = OmegaConf.create(f.read_text())
    facts = doc.get("config") if isinstance(doc, DictConfig) else None
    return None if facts is None else tuple(cast(dict[str, Any], OmegaConf.to_container(facts, resolve=True)).items())


def tiny_config(model: Any) -> dict[str, Any]:
    """The config.json the tiny model ``model`` names is built from: its ``model.config`` (the
    preset's block with the user's overrides; a schema-default ``ModelConfig`` without one: the
    preset's), with ``head_dim`` written out (hidden_size / num_attention_heads where null), so
    transformers and mlx-lm read the same width.

    Raises:
        UserError: a fact the builder cannot build (another family, a count below 1), in one line.
    """
    facts = getattr(model, "config", None)
    if facts is None:
        config = dict(preset_config("tiny") or ())
    else:
        from omegaconf import OmegaConf

        config = (cast(dict[str, Any], OmegaConf.to_container(facts, resolve=True)) if OmegaConf.is_config(facts)
                  else dict(facts))
        config = json.loads(json.dumps(config))  # as config.json holds it: the run spec's tuples are lists
    if config.get("model_type") != "qwen2":
        raise UserError(f"model.config.model_type={config.get('model_type')}: the tiny model is built as a Qwen2 "
                        "(model_type qwen2); give another family's checkpoint with model.path")
    missing = [k for k in _NUMBERS.values() if k not in config and k != "head_dim"]
    if missing:
        raise UserError(f"model.config has no {missing[0]}, which the tiny model is built from; "
                        f"set model.config.{missing[0]} (conf/model/tiny.yaml has every one)")
    for k in _COUNTS:
        v = config.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"model.config.{k}={v} must be a whole number >= 1 to build the tiny model; "
                            f"set model.config.{k} to a value >= 1")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise UserError(f"model.config.num_attention_heads={config['num_attention_heads']} is not a multiple of "
                        f"model.config.num_key_value_heads={config['num_key_value_heads']}; each key/value head "
                        "serves a whole group of query heads")
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def _arch(config: dict[str, Any]) -> dict[str, Any]:
    """The numbers the weights are drawn from, as builder 2 named them (head_dim None where it
    is hidden / heads; Qwen2's q/k/v biases always on)."""
    arch = {k: config[v] for k, v in _NUMBERS.items()}
    if arch["head_dim"] == arch["hidden_size"] // arch["num_heads"]:
        arch["head_dim"] = None
    arch["attn_bias"] = True
    return arch


def _cache_key(config: dict[str, Any], seed: int) -> str:
    """The tiny model's cache key: builder 2's (its numbers and the seed) when the rest of
    ``config`` is the preset's, else those facts that differ too (a model built from other
    facts is another model)."""
    preset = {**dict(preset_config("tiny") or ()), "max_window_layers": config["num_hidden_layers"]}  # as builder 2 wrote it
    rest = {k: v for k, v in config.items() if k not in _NUMBERS.values() and (k not in preset or preset[k] != v)}
    rest.update({k: "(absent)" for k in preset if k not in config})
    payload: list[Any] = [BUILDER_VERSION, _arch(config), seed] + ([rest] if rest else [])
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


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


def tiny_dir(model: Any, seed: int = 0) -> Path:
    """Where the tiny model ``model`` names is (or will be) built: no file is read or written."""
    return cache_root() / f"tiny-qwen2-{_cache_key(tiny_config(model), seed)}"


def build_tiny(model: Any, seed: int = 0) -> Path:
    """Return the directory of the tiny model for these config.json facts (``tiny_config``),
    building it once.

    The directory is assembled under a temporary name and renamed into place, so a reader
    never sees a half-written model, and two processes building at once both end well.
    """
    config = tiny_config(model)
    arch = _arch(config)
    final = cache_root() / f"tiny-qwen2-{_cache_key(config, seed)}"
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-tiny-", dir=final.parent))
    try:
        from safetensors.numpy import save_file

        _write_tokenizer(tmp, arch["vocab_size"])
        save_file(_weights(arch, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        as_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600: the model is as readable as the umask says
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
