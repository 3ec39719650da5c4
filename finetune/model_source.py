"""Resolve ``model=`` to a local HF-format directory (tiny: built here; else local or hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.config import UserError

# What training needs from a hub repository; skips other formats (pytorch_model.bin twins,
# gguf, onnx) that would multiply the download.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]


def resolve_model_dir(model_cfg: Any, seed: int = 0) -> Path:
    """Return the local directory holding config.json, weights and tokenizer files."""
    if model_cfg.path is None:
        if model_cfg.name != "tiny":
            raise UserError(f"model={model_cfg.name} has no model.path; set model.path=<hub id or local dir>")
        from finetune.tiny import build_tiny

        return build_tiny(model_cfg, seed=seed)
    local = Path(str(model_cfg.path)).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise UserError(f"model.path={model_cfg.path} has no config.json; point it at an HF-format model directory")
        return local.resolve()
    if str(model_cfg.path).startswith((".", "/", "~")):
        raise UserError(f"model.path={model_cfg.path} does not exist; give an existing directory or a hub id")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model_cfg.path), allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, gated, misspelt: all end the same way for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"could not get model {model_cfg.path} from the hub ({first[:160]}); "
            "download it (huggingface-cli download, with a token for gated models) or pass model.path=/local/dir"
        ) from None


# config.json dtype names -> ours (transformers 5 writes "dtype", 4.x "torch_dtype")
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "half": "float16", "fp16": "float16"}


def local_config(model_cfg: Any, model_dir: Path | str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """The model's ``config.json`` as a dict and its path, read from ``model_dir`` or from a
    local ``model.path``; (None, None) for a hub id not downloaded (or ``tiny`` not built)."""
    import json

    for d in (model_dir, getattr(model_cfg, "path", None) if model_dir is None else None):
        if d is None:
            continue
        cj = Path(str(d)).expanduser() / "config.json"
        if cj.is_file():
            try:
                return json.loads(cj.read_text()), str(cj)
            except (OSError, ValueError) as e:
                raise UserError(f"{cj} is unreadable ({e}); fix it or point model.path at another model") from None
    return None, None


def stored_dtype(model_cfg: Any, model_dir: Path | str | None = None) -> tuple[str, str]:
    """The dtype the checkpoint stores its floating weights in, and where that was read:
    ``config.json`` ``dtype``/``torch_dtype`` (also inside ``text_config``), else the preset's
    ``model.dtype``, else float32 (transformers' own default when a config names none)."""
    hf, where = local_config(model_cfg, model_dir)
    if hf is not None:
        for node in (hf, hf.get("text_config") or {}):
            for key in ("dtype", "torch_dtype"):
                v = node.get(key)
                if isinstance(v, str) and v.removeprefix("torch.") in _DTYPE_NAMES:
                    return _DTYPE_NAMES[v.removeprefix("torch.")], f"{where} {key}"
    preset = getattr(model_cfg, "dtype", None)
    if preset:
        if str(preset) not in _DTYPE_NAMES:
            raise UserError(f"model.dtype={preset} is not a dtype; choose one of: float32, bfloat16, float16")
        return _DTYPE_NAMES[str(preset)], f"model.dtype of preset {getattr(model_cfg, 'name', '?')}"
    return "float32", "no dtype in config.json or model.dtype: float32 (transformers' default)"


def stored_quantization(model_cfg: Any, model_dir: Path | str | None = None) -> dict[str, Any] | None:
    """An MLX pre-quantized checkpoint's ``quantization`` block (``{"group_size": 64, "bits":
    4, ...}``, as ``mlx_lm.convert -q`` and the mlx-community repos write it), or None."""
    hf, where = local_config(model_cfg, model_dir)
    q = (hf or {}).get("quantization")  # HF "quantization_config" (bnb, GPTQ, AWQ) is another format
    if not isinstance(q, dict) or "bits" not in q or "group_size" not in q:
        return None
    return {"bits": int(q["bits"]), "group_size": int(q["group_size"]), "mode": str(q.get("mode", "affine")),
            "source": where}


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_weights(model_dir: Path | str, model_cfg: Any) -> None:
    """UserError, naming the fix, for a model directory without weights, or with pickle-only
    weights (loading a pickle runs code from the file) unless ``model.allow_pickle=true``."""
    d = Path(model_dir)
    files = [p for p in d.iterdir() if p.is_file()] if d.is_dir() else []
    safetensors = [p for p in files if p.name.endswith(".safetensors")]
    pickles = [p for p in files if p.name.endswith(PICKLE_SUFFIXES) and "training_args" not in p.name]
    if safetensors:
        return
    if pickles:
        if getattr(model_cfg, "allow_pickle", False):
            return
        raise UserError(f"model.path={d} has only pickle weights ({pickles[0].name}), which run code when loaded; "
                        "convert them to safetensors, or set model.allow_pickle=true if you trust the source")
    raise UserError(f"model.path={d} holds no weights (*.safetensors); point model.path at a complete model directory")
