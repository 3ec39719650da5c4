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
