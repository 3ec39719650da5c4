"""Backends: one folder per framework (``cuda/``, ``mlx/``), each with its runtime behind the
Protocol in ``base`` (imports its framework), its capabilities and its memory model (neither
imports a framework). Installed as ``finetune.backends``.

Only the chosen backend's runtime is imported, so the other platform's framework never is.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys

from finetune.backends.base import Backend, Batch, Capabilities, ModelInfo, OutOfMemory

__all__ = ["BACKENDS", "Backend", "Batch", "Capabilities", "ModelInfo", "OutOfMemory", "capabilities", "get_backend",
           "resolve_backend_name"]

BACKENDS = ("cuda", "mlx")  # a folder each; a third backend adds its name here


def capabilities(name: str) -> Capabilities:
    """What backend ``name`` runs (no framework imported). Raises UserError for an unknown name."""
    from finetune.config import UserError

    if name not in BACKENDS:
        raise UserError(f"backend={name} is not valid; choose one of: auto, {', '.join(BACKENDS)}")
    return importlib.import_module(f"finetune.backends.{name}.capabilities").CAPABILITIES


def concrete_name(name: str) -> str:
    """``auto`` -> the backend a run here would use, without importing a framework: mlx on
    Apple Silicon, else cuda (on a GPU or on CPU). Raises UserError for an unknown name."""
    from finetune.budget import apple_silicon
    from finetune.config import UserError

    if name == "auto":
        return "mlx" if apple_silicon() else "cuda"
    if name not in BACKENDS:
        raise UserError(f"backend.name={name} is not valid; choose one of: auto, {', '.join(BACKENDS)}")
    return name


def _cuda_visible() -> bool:
    # Cheap check that imports no torch: a driver tool or device node, then torch only if both
    # hint at a GPU.
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def resolve_backend_name(name: str) -> tuple[str, str]:
    """Map ``auto`` to a concrete backend. Returns (name, reason)."""
    if name != "auto":
        return name, f"backend={name} (asked for)"
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "mlx", "backend=auto chose mlx: Apple Silicon"
    if _cuda_visible():
        return "cuda", "backend=auto chose cuda: a CUDA device is visible"
    return "cuda", "backend=auto chose cuda on CPU: no CUDA device and not Apple Silicon"


def get_backend(name: str) -> Backend:
    """Instantiate a backend by concrete name, importing only its module."""
    from finetune.config import UserError

    needs = {"cuda": ("torch", "backend=cuda needs torch: run `bash scripts/setup.sh` (or pip install '.[cuda]')"),
             "mlx": ("mlx", "backend=mlx needs mlx: pip install '.[mlx]' (on Linux this brings mlx[cpu])")}
    if name not in needs:
        raise UserError(f"backend={name} is not valid; choose one of: auto, {', '.join(BACKENDS)}")
    module, fix = needs[name]
    if importlib.util.find_spec(module) is None:
        raise UserError(fix)
    runtime = importlib.import_module(f"finetune.backends.{name}.runtime")
    return runtime.BACKEND()
