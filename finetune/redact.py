"""Tokens and keys never reach a file: the saved config (.hydra/), the loggers' copy of it,
exported configs. A value is secret when its key names one (``api_key``, ``hf_token``,
``password``...), when it is the value of such an environment variable (HF_TOKEN,
WANDB_API_KEY, MLFLOW_TRACKING_TOKEN...), or when it is the password in a URL."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

MASK = "***"
# ``(^|_)token($|_)`` so hf_token matches and max_new_tokens / tokens_per_sec do not
SECRET_KEY = re.compile(r"(^|[_.-])(token|api[_-]?key|apikey|secret|password|passwd|auth|credentials?)($|[_.-])",
                        re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(://[^/:@\s]+:)[^/@\s]+@")
MIN_SECRET_LEN = 6  # shorter env values ("1", "true") are settings, not secrets


def env_secrets() -> list[str]:
    """Values of environment variables whose names say they hold a secret."""
    return sorted({v for k, v in os.environ.items() if SECRET_KEY.search(k) and len(v) >= MIN_SECRET_LEN},
                  key=len, reverse=True)


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    """``text`` with every known secret value and URL password masked."""
    for s in env_secrets() if secrets is None else secrets:
        text = text.replace(s, MASK)
    return _URL_PASSWORD.sub(lambda m: m.group(1) + MASK + "@", text)


def config_secrets(tree: Any) -> list[str]:
    """Values found under secret-named keys of a plain config tree (dicts and lists)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if SECRET_KEY.search(str(k)) and isinstance(v, (str, int)) and len(str(v)) >= MIN_SECRET_LEN:
                    found.append(str(v))
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(tree)
    return found


def redact_tree(tree: Any, secrets: list[str] | None = None) -> Any:
    """A copy of a plain config tree with secret-named keys and secret values masked."""
    secrets = env_secrets() if secrets is None else secrets
    if isinstance(tree, dict):
        return {k: MASK if SECRET_KEY.search(str(k)) and v not in (None, "") else redact_tree(v, secrets)
                for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact_tree(v, secrets) for v in tree]
    if isinstance(tree, str):
        return redact_text(tree, secrets)
    return tree


def redact_hydra_files(cfg: Any) -> None:
    """Rewrite the run dir's ``.hydra/*.yaml`` (config, overrides, hydra) with secrets masked.
    Hydra writes them before the task runs; nothing else reads them back."""
    from omegaconf import OmegaConf

    from finetune.io import atomic_write_text

    run_dir = cfg.get("run_dir") if hasattr(cfg, "get") else None
    if not run_dir:
        return
    secrets = sorted(set(env_secrets()) | set(config_secrets(OmegaConf.to_container(cfg, resolve=False))),
                     key=len, reverse=True)
    hydra_dir = Path(str(run_dir)) / ".hydra"
    if not secrets or not hydra_dir.is_dir():
        return
    for f in hydra_dir.glob("*.yaml"):
        text = f.read_text()
        clean = redact_text(text, secrets)
        if clean != text:
            atomic_write_text(f, clean)
