"""Backends: one module per framework behind the Protocol in ``backends.base``.

Only the chosen backend's module is imported, so the other platform's framework never is.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys

from backends.base import Backend, Batch, ModelInfo, OutOfMemory

__all__ = ["Backend", "Batch", "ModelInfo", "OutOfMemory", "get_backend", "resolve_backend_name"]


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

    if name == "cuda":
        if importlib.util.find_spec("torch") is None:
            raise UserError("backend=cuda needs torch: run `bash scripts/setup.sh` (or pip install '.[cuda]')")
        from backends.cuda import CudaBackend

        return CudaBackend()
    if name == "mlx":
        if importlib.util.find_spec("mlx") is None:
            raise UserError("backend=mlx needs mlx: pip install '.[mlx]' (on Linux this brings mlx[cpu])")
        from backends.mlx import MlxBackend

        return MlxBackend()
    raise UserError(f"backend={name} is not valid; choose one of: auto, cuda, mlx")
