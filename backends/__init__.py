"""Backends: one folder per framework (``cuda/``, ``mlx/``), each with its runtime behind the
Protocol in ``base`` (imports its framework), its capabilities and its memory model (neither
imports a framework). Installed as ``finetune.backends``.

This registry holds each backend's framework-free parts (``capabilities``, ``memory_model``),
which the config checks and the planner import. Its runtime is loaded by ``finetune.backends.runtimes``
``get_backend``, above the planner that the runtimes use: only the chosen backend's runtime is
imported, so the other platform's framework never is.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys

from finetune.backends.base import Backend, Batch, Capabilities, MemoryModel, ModelInfo, OutOfMemory
from finetune.budget import DeviceMemory, apple_silicon
from finetune.errors import UserError

__all__ = ["BACKENDS", "Backend", "Batch", "Capabilities", "MemoryModel", "ModelInfo", "OutOfMemory", "capabilities",
           "device_memory", "memory_model", "resolve_backend_name", "run_device"]

# The one registry line: a backend is its folder backends/<name>/ (capabilities.py, memory.py,
# rules.py, runtime.py), its conf/backend/<name>.yaml, and its name here.
BACKENDS = ("cuda", "mlx")


# Each backend's framework-free parts, loaded with the registry (none imports its framework);
# importing its rules registers its accounting explanations.
_CAPABILITIES: dict[str, Capabilities] = {
    n: importlib.import_module(f"finetune.backends.{n}.capabilities").CAPABILITIES for n in BACKENDS}
_MEMORY_MODELS: dict[str, MemoryModel] = {n: importlib.import_module(f"finetune.backends.{n}.memory") for n in BACKENDS}
for _name, _model in _MEMORY_MODELS.items():
    importlib.import_module(f"finetune.backends.{_name}.rules")
    if not isinstance(_model, MemoryModel):  # a module checked against the Protocol, as mypy cannot here
        raise TypeError(f"finetune.backends.{_name}.memory lacks part of the MemoryModel Protocol (backends/base.py)")


def capabilities(name: str) -> Capabilities:
    """What backend ``name`` runs (no framework imported). Raises UserError for an unknown name."""
    if name not in BACKENDS:
        raise UserError(f"backend={name} is not valid; choose one of: auto, {', '.join(BACKENDS)}")
    return _CAPABILITIES[name]


def memory_model(name: str) -> MemoryModel:
    """Backend ``name``'s memory model, ``finetune.backends.<name>.memory`` (no framework imported:
    the planner prices with it). Raises UserError for an unknown name."""
    if name not in BACKENDS:
        raise UserError(f"backend={name} is not valid; choose one of: auto, {', '.join(BACKENDS)}")
    return _MEMORY_MODELS[name]


def run_device(backend: str, device: str = "auto") -> str:
    """The device a run of ``backend`` would use ("cuda", "cpu", "mlx:gpu", "mlx:cpu"): the
    backend's memory model says (its ``run_device``).

    Args:
        backend: "cuda" or "mlx".
        device: the backend's ``backend.device`` ("auto", "cuda", "cuda:N", "cpu").
    """
    return memory_model(backend).run_device(device)


def device_memory(backend: str, device: str) -> DeviceMemory:
    """Memory of the device a run with this backend/device would use (its memory model's
    ``device_memory``).

    Args:
        backend: "cuda" or "mlx".
        device: "cuda" (a GPU), "cpu", "mlx:gpu" or "mlx:cpu".
    """
    return memory_model(backend).device_memory(device)

def concrete_name(name: str) -> str:
    """``auto`` -> the backend a run here would use, without importing a framework: mlx on
    Apple Silicon, else cuda (on a GPU or on CPU). Raises UserError for an unknown name."""
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
