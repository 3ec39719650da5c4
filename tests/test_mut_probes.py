"""Process and system memory readers: the figures a sample carries (RSS, peak RSS), the
portable path macOS takes (psutil and getrusage), and descriptors given back."""

from __future__ import annotations

import gc
import os
import resource
import sys

import psutil
import pytest

from finetune.accounting import probes
from finetune.accounting.probes import SystemProbe

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _close(a: int, b: int) -> bool:
    return abs(a - b) <= 0.25 * max(a, b)


@linux
def test_rss_is_the_process_resident_set_in_bytes() -> None:
    r = SystemProbe().read()
    own = psutil.Process().memory_info().rss
    assert isinstance(r["rss"], int) and _close(r["rss"], own)
    assert r["peak_rss"] >= r["rss"]


def test_the_portable_path_reads_rss_and_peak_rss_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # the path every platform but Linux takes (psutil for RSS, getrusage for the peak)
    monkeypatch.setattr(probes, "_LINUX", False)
    r = SystemProbe().read()
    own = psutil.Process().memory_info().rss
    assert isinstance(r["rss"], int) and _close(r["rss"], own)
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    want = ru if sys.platform == "darwin" else ru * 1024  # bytes on macOS, KiB elsewhere
    assert isinstance(r["peak_rss"], int) and r["peak_rss"] >= want and r["peak_rss"] >= r["rss"] // 2


@linux
def test_probes_give_their_descriptors_back() -> None:
    # a sweep makes a probe per job: each must close the /proc files it kept open
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        p = SystemProbe()
        p.read()
        del p
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_failed_pressure_sysctl_is_unknown_not_a_level() -> None:
    # macOS kern.memorystatus_vm_pressure_level through sysctlbyname: 0 is success, -1 failure
    p = SystemProbe()

    def failing(name, val, size, new, newlen) -> int:
        return -1

    def level_2(name, val, size, new, newlen) -> int:
        val._obj.value = 2
        return 0

    p._darwin_sysctl = failing
    assert p._darwin_pressure() is None
    p._darwin_sysctl = level_2
    assert p._darwin_pressure() == 2


class _Pynvml:
    """Answers like pynvml: one GPU, 4 GiB used, the compute processes given."""

    nvmlMemory_v2 = 0x02000028

    def __init__(self, procs: dict[int, int]):
        self.procs = procs

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None):
        return type("Mem", (), {"used": 4 << 30, "total": 80 << 30})()

    def nvmlDeviceGetComputeRunningProcesses(self, h: int):
        return [type("P", (), {"pid": p, "usedGpuMemory": m})() for p, m in self.procs.items()]


def _nvml(monkeypatch: pytest.MonkeyPatch, procs: dict[int, int]) -> dict:
    monkeypatch.setitem(sys.modules, "pynvml", _Pynvml(procs))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return probes.NvmlProbe().read(0)


def test_nvml_reads_the_device_and_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    got = _nvml(monkeypatch, {os.getpid(): 3 << 30, 4242: 1 << 30})
    assert got == {"device_used": 4 << 30, "device_total": 80 << 30, "process_used": 3 << 30,
                   "other_processes_used": 1 << 30}


def test_in_a_container_the_one_process_listed_is_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML lists host pids; a pid namespace hides ours, but we hold a context on the device
    assert _nvml(monkeypatch, {777777: 3 << 30})["process_used"] == 3 << 30
    two = _nvml(monkeypatch, {777777: 3 << 30, 888888: 1 << 30})  # which one is us: unknown
    assert two["process_used"] is None and two["other_processes_used"] is None


@linux
def test_host_heap_trim_hands_back_what_a_step_left_and_nothing_else() -> None:
    """A "step" of 64 1-MiB C allocations, touched and freed below a live one, stays resident
    (glibc keeps free heap chunks mapped under its mmap threshold, 32 MiB as lean_host_heap
    leaves it); HostHeapTrim hands it back after that step, and does nothing after a step that
    left less than its minimum."""
    import ctypes

    from finetune.accounting.probes import _M_MMAP_THRESHOLD, HostHeapTrim

    libc = probes._libc()
    if libc is None:
        pytest.skip("not glibc")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    libc.malloc_trim(0)  # from a heap with nothing free resident: what the blocks touch is new

    def rss() -> int:
        return SystemProbe().read()["rss"]

    mib = 1 << 20
    trim = HostHeapTrim()
    blocks = [libc.malloc(mib) for _ in range(65)]
    for b in blocks:
        ctypes.memset(b, 1, mib)
    keep = blocks.pop()  # the last, above the rest: their space is no free top the heap shrinks by itself
    for b in blocks:
        libc.free(b)
    before = rss()
    assert trim.after_step() and trim.trims == 1
    assert before - rss() >= 48 * mib, (before, rss())
    small = [libc.malloc(mib) for _ in range(4)]  # a step that leaves 4 MiB: under the minimum
    for b in small:
        ctypes.memset(b, 1, mib)
    for b in small:
        libc.free(b)
    assert not trim.after_step() and trim.trims == 1
    libc.free(keep)
