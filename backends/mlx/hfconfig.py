"""A transformers-5 config.json in the words mlx-lm 0.32 reads.

transformers 5 writes RoPE settings only under ``rope_parameters`` (gemma3: one block per layer
type), while most of mlx-lm 0.32's ``ModelArgs`` read top-level ``rope_theta``/``rope_scaling`` and
fall back to their own defaults when those are absent: the model then loads without error and
computes something else (a Llama-3 checkpoint with theta 500000 runs with theta 10000). Each key
below was checked by comparing base logits against transformers on the tiny checkpoints of
``tests/families.py`` (fp32, ``tests/test_families_mlx.py``).

``normalise`` adds the keys mlx-lm reads (it never removes any, so the result can be merged over
config.json with ``load(..., model_config=...)``); ``refusal`` names what mlx-lm cannot run as the
checkpoint says, in one line, before any weights are read.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any, TypeGuard
from finetune.errors import UserError
from finetune.model.source import is_multimodal, text_config

# what mlx-lm's multimodal wrappers (gemma3, mistral3, ...) call their language model: the
# runtime trains that model, and an adapter of a multimodal base names its modules under it
MLX_TEXT_PREFIX = "language_model."

# model_type -> the mlx_lm/models/<module>.py that builds it (mlx_lm.utils.MODEL_REMAPPING)
_MODULE = {"mistral": "llama"}

# Modules whose attention builds nn.RoPE(base=rope_theta) directly and never reads rope_scaling
# (read from mlx_lm/models/<module>.py, 0.32.2): a scaled RoPE would be dropped without a word.
_UNSCALED_ROPE = {"gemma2", "mixtral", "qwen3_moe", "starcoder2"}

# Modules that ignore ``sliding_window``: every layer attends to the whole sequence. The llama
# module (which mistral maps to) windows only layers that ``layer_types`` marks, and needs one
# full-attention layer, so mistral's all-layers window is not expressible there either.
_NO_WINDOW = {"gemma2", "mistral"}


def _mlx_lm_version() -> str:
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's ``rope_scaling`` from one transformers-5 ``rope_parameters`` block: None for the
    plain RoPE, else the block with its type under both names mlx-lm reads (``rope_utils.
    initialize_rope`` reads ``type`` then ``rope_type``; phi3 checks ``type`` alone)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    out = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["type"] = out["rope_type"] = kind
    return out


def _sliding_pattern(layer_types: list[str]) -> int | None:
    """gemma3's ``sliding_window_pattern`` P (layer i is global iff (i + 1) % P == 0) that gives
    ``layer_types``, or None when no P does (mlx-lm's gemma3 takes only the period)."""
    n = len(layer_types)
    for p in range(1, n + 1):
        want = ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]
        if want == layer_types:
            return p
    return None


def _is_per_layer_type(rope: Any) -> TypeGuard[dict[str, dict[str, Any]]]:
    return isinstance(rope, dict) and bool(rope) and all(isinstance(v, dict) for v in rope.values())


def normalise(config: dict[str, Any]) -> dict[str, Any]:
    """The config with the keys mlx-lm 0.32's ``ModelArgs`` read for its model_type added.

    Args:
        config: config.json as transformers 5 wrote it (also fine: an older one, which already
            has top-level ``rope_theta``; keys already present at the top level are kept).

    Returns:
        A new dict: ``config`` plus ``rope_theta``/``rope_scaling``/``partial_rotary_factor``
        from ``rope_parameters``; gemma3's ``rope_local_base_freq`` and
        ``sliding_window_pattern``; qwen3_moe's ``num_experts``.
    """
    out = dict(config)
    mtype = config.get("model_type")
    rope = config.get("rope_parameters")
    if _is_per_layer_type(rope):
        # gemma3: {"full_attention": {...}, "sliding_attention": {...}}; global layers take the
        # full-attention block, local layers a plain RoPE at rope_local_base_freq
        full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
        if "rope_theta" in full:
            out.setdefault("rope_theta", full["rope_theta"])
        if "rope_scaling" not in config:
            out["rope_scaling"] = _scaling(full)
        if "rope_theta" in local:
            out.setdefault("rope_local_base_freq", local["rope_theta"])
    elif isinstance(rope, dict):
        if "rope_theta" in rope:
            out.setdefault("rope_theta", rope["rope_theta"])
        if "rope_scaling" not in config:
            out["rope_scaling"] = _scaling(rope)
        if "partial_rotary_factor" in rope:
            out.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    if mtype == "gemma3_text" and isinstance(config.get("layer_types"), list):
        # transformers keeps the period it was built with in _sliding_window_pattern (6) even when
        # layer_types says otherwise; mlx-lm reads only the period, and indexes its caches with it
        p = _sliding_pattern(config["layer_types"])
        if p is not None:
            out["sliding_window_pattern"] = p
    if mtype == "qwen3_moe" and "num_experts" not in config and "num_local_experts" in config:
        out["num_experts"] = config["num_local_experts"]
    return out


def refusal(config: dict[str, Any], seq_len: int | None = None) -> str | None:
    """One line saying why mlx-lm cannot run this checkpoint as transformers would, or None.

    Args:
        config: config.json as transformers wrote it.
        seq_len: the longest sequence the caller will run (tokens). Windowed attention that
            mlx-lm ignores matters only past the window, so it is checked only when given (not
            by a merge, which runs no tokens, nor by generation, which cannot count them before
            the tokenizer is loaded).
    """
    mtype = config.get("model_type")
    module = _MODULE.get(mtype, mtype) if isinstance(mtype, str) else mtype
    cannot = f"backend=mlx: mlx-lm {_mlx_lm_version()} cannot load model_type={mtype}"
    fix = "use backend=cuda"
    rope = config.get("rope_parameters")
    blocks = rope.values() if _is_per_layer_type(rope) else [rope] if isinstance(rope, dict) else []
    if isinstance(config.get("rope_scaling"), dict):
        blocks = [*blocks, config["rope_scaling"]]
    kinds = {b.get("rope_type", b.get("type", "default")) for b in blocks}
    if module in _UNSCALED_ROPE and kinds - {"default"}:
        return (f"{cannot} with rope_type={','.join(sorted(kinds - {'default'}))}: its mlx_lm/models/{module}.py "
                f"applies plain RoPE and ignores the scaling; {fix}")
    if mtype == "gemma3_text":
        local = rope.get("sliding_attention", {}) if _is_per_layer_type(rope) else {}
        if _scaling(local) is not None:
            return f"{cannot} with a scaled RoPE on its sliding layers (mlx-lm's are plain RoPE); {fix}"
        lt = config.get("layer_types")
        if isinstance(lt, list) and _sliding_pattern(lt) is None:
            return (f"{cannot} with layer_types={lt}: mlx-lm places global layers by a fixed period "
                    f"and needs at least one; {fix}")
    window = config.get("sliding_window")
    windowed = config.get("layer_types") is None or "sliding_attention" in config["layer_types"]
    if module in _NO_WINDOW and window and windowed and seq_len is not None and seq_len > int(window):
        return (f"{cannot} with sliding_window={window} at {seq_len} tokens: its mlx_lm/models/{module}.py attends "
                f"to the whole sequence on every layer; keep train.seq_len <= {window}, or {fix}")
    if mtype == "gpt_oss" and "quantization_config" not in config:
        # transformers 5 saves experts fused and transposed (gate_up_proj [E, hidden, 2*inter], no
        # ".weight"); mlx-lm's sanitize splits only the MXFP4 hub layout (gate_up_proj_blocks)
        return (f"{cannot} from transformers' unquantized expert layout (experts.gate_up_proj "
                f"[experts, hidden, 2*intermediate]): its sanitize reads only the MXFP4 hub layout; {fix}")
    return None


def model_config(model_dir: Path | str, seq_len: int | None = None) -> dict[str, Any]:
    """The ``model_config`` to hand ``mlx_lm.utils.load`` for ``model_dir`` (merged over its
    config.json there; nothing is written into the directory).

    Raises:
        UserError: mlx-lm cannot run this checkpoint as it is described (see ``refusal``).
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return {}  # mlx-lm names the missing file itself
    config = json.loads(path.read_text())
    line = refusal(config, seq_len)
    if line is not None:
        raise UserError(line)
    out = {k: v for k, v in normalise(config).items() if k not in config or config[k] != v}
    if is_multimodal(config):
        # mlx-lm's wrapper builds its language model from text_config: the same words for the
        # text model, and the vocabulary where the wrapper reads it (its default is Gemma 3's
        # 262,208, whatever text_config says)
        text = config["text_config"]
        line = refusal(text, seq_len)
        if line is not None:
            raise UserError(line)
        out["text_config"] = normalise(text_config(config))  # tied as the whole model's config says
        if "vocab_size" in text and "vocab_size" not in config:
            out["vocab_size"] = text["vocab_size"]
    return out
