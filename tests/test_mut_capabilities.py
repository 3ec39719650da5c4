"""What each backend's capabilities switch on, seen where it shows: NVML figures in a CUDA
run's memory samples, the cache limit the governor sets on MLX."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from finetune.accounting import Accountant
from finetune.config import compose
from finetune.run.governor import Governor
from finetune.resolver import resolve

GiB = 1 << 30


class _Pynvml:  # answers like pynvml for one GPU with 3 GiB used, all this process's
    nvmlMemory_v2 = 0x02000028

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Any:
        return type("Mem", (), {"used": 3 * GiB, "total": 80 * GiB})()

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [type("P", (), {"pid": os.getpid(), "usedGpuMemory": 3 * GiB})()]


class _CudaAllocator:  # a CUDA backend's allocator figures: 1 GiB allocated, 2 GiB reserved
    name = "cuda"

    def memory(self) -> dict[str, Any]:
        return {"allocated": GiB, "reserved": 2 * GiB, "peak_allocated": GiB, "peak_reserved": 2 * GiB}

    def reset_peak(self) -> None:
        pass

    def census(self) -> dict[str, int]:
        return {}


def test_a_cuda_run_reads_nvml_beside_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _Pynvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = Accountant(_CudaAllocator()).sample(0, "load")
    assert s["device_used"] == 3 * GiB and s["device_total"] == 80 * GiB
    assert s["non_allocator"] == GiB and s["process_device_used"] == 3 * GiB


class _MlxLimits:  # what the governor asks of an MLX backend when it attaches
    def __init__(self) -> None:
        self.cache_limits: list[int] = []

    def set_memory_limits(self, budget: int) -> dict[str, int]:
        return {}

    def set_cache_limit(self, limit: int) -> int:
        self.cache_limits.append(limit)
        return 32 << 20  # MLX's default before


def test_mlx_gets_the_cache_limit_memory_cache_limit_asks_for(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    cfg = compose(tmp_path / "run", "backend=mlx", "memory.budget=8GiB", "memory.cache_limit=512MiB")
    gov = Governor(resolve(cfg), "mlx", events.append)
    be = _MlxLimits()
    gov.attach(be)
    assert be.cache_limits == [512 << 20]
    assert events == [{"step": 0, "trigger": "memory.cache_limit", "action": "set_mlx_cache_limit",
                       "before": {"cache_limit": 32 << 20}, "after": {"cache_limit": 512 << 20}}]

