"""Cheap readers for process, system and NVML memory figures.

Every reader returns ints of bytes, or None where this platform or this machine cannot
measure the figure (never 0 for unknown). On Linux a reading is one ``pread`` each of
/proc/self/statm, /proc/self/status, /proc/meminfo and /proc/pressure/memory through
descriptors opened once: a few microseconds each when warm, but the first system call after a
burst of computation can cost 30-300 us on a virtualised host, so the Accountant decides how
often a fresh reading is worth it. On macOS psutil and ``getrusage``. NVML handles are opened
once and cached. Nothing here imports torch or mlx.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

_LINUX = sys.platform.startswith("linux")
_DARWIN = sys.platform == "darwin"
_SYSTEM_KEYS = ("swap_used", "swap_total", "system_total", "system_available", "psi_some_avg10", "psi_full_avg10",
                "pressure_level", "compressed", "swapped_in", "swapped_out")
# per process: phys_footprint (macOS: what the OS charges the process, compressed and swapped
# pages included), compressed_process (macOS), major_faults (count: page-ins from disk or swap)
_PROCESS_KEYS = ("phys_footprint", "compressed_process", "major_faults")


def _kib_field(text: bytes, key: bytes) -> int | None:
    """The value of a ``Key:   1234 kB`` line of a /proc file, in bytes."""
    i = text.find(key)
    if i < 0:
        return None
    j = text.find(b"\n", i)
    parts = text[i + len(key) : j if j >= 0 else None].split()
    if not parts:
        return None
    try:
        return int(parts[0]) * 1024  # /proc reports kB meaning KiB
    except ValueError:
        return None


_fork_gen = 0  # bumped in a forked child: its /proc/self descriptors would be the parent's


def _after_fork() -> None:
    global _fork_gen
    _fork_gen += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _libc() -> Any:
    """glibc's functions, or None off glibc (macOS, musl)."""
    if not _LINUX:
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes, libc.mallopt.argtypes = [ctypes.c_size_t], [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


_M_MMAP_THRESHOLD = -3  # glibc malloc.h
# glibc's own ceiling of its dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): the
# fixed threshold lean_host_heap leaves behind, and what a step may leave before HostHeapTrim
MMAP_THRESHOLD_MAX = 32 << 20


@contextlib.contextmanager
def lean_host_heap(block: int = 1 << 20, after: int = MMAP_THRESHOLD_MAX) -> Iterator[None]:
    """Within: host blocks of ``block`` bytes and up come from their own mappings, handed back
    to the OS when freed; on leaving, the C heap's free pages go back too (``malloc_trim``).

    Loading a checkpoint allocates and frees hundreds of MB of host staging buffers (safetensors
    reads, 4-bit quantization's fp copies) in an order set by thread scheduling. glibc's
    heap keeps freed chunks mapped and its mmap threshold rises to 32 MiB after the first large
    free, so the peak RSS of one and the same load (tiny 8x1024 QLoRA on a 2-core box) came
    out 1.05-1.6 GB run to run while live memory was 423 MB every time; with this it came out
    1.01-1.03 GB. The plan prices what is live; this makes the load hold what the plan prices.
    ``after`` is the fixed threshold left behind (glibc's own dynamic ceiling), so later
    CPU-side steps reuse heap memory as before. A no-op off glibc (macOS returns pages itself)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, block)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, after)
            libc.malloc_trim(0)


class _ProcFile:
    """A /proc file kept open and re-read at offset 0 with one pread (procfs regenerates it on
    each read): one syscall per reading."""

    def __init__(self, path: str):
        self.path = path
        self.gen = -1
        self.fd: int | None = None

    def read(self) -> bytes | None:
        try:
            if self.fd is None or self.gen != _fork_gen:
                self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self.gen = _fork_gen
            return os.pread(self.fd, 65536, 0)
        except OSError:
            self.fd = None
            return None

    def __del__(self) -> None:
        if self.fd is not None and self.gen == _fork_gen:
            try:
                os.close(self.fd)
            except OSError:
                pass


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _statm_rss(statm: bytes | str) -> int:
    """The resident set in bytes from /proc/self/statm's text (its second field, in pages)."""
    return int(statm.split()[1]) * _PAGE

# What a step may leave resident beyond the last trim before the C heap's free pages are handed
# back (HostHeapTrim). A trim costs the next step the page faults of what it touches again: on
# the 64-wide tiny model (8 ms steps, 3 MiB returned) trimming every step made the step 3 ms
# slower; on the 110M Qwen2 under FSDP with cpu_offload (~300 MiB returned a step) it made the
# step 6% faster (benchmarks/results/fsdp_sharded_load_cpu.txt section 4). The same figure as
# the mmap threshold lean_host_heap leaves behind: a block that size or larger is its own
# mapping anyway, returned when freed.
TRIM_MIN_GROWTH_BYTES = MMAP_THRESHOLD_MAX


class HostHeapTrim:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim(0)``: every arena, free
    chunks in the middle of the heap included) after a step that left the RSS at least
    ``min_growth`` bytes above its lowest since the last trim. A step on the host frees hundreds
    of MiB of activations, gathered weights and gradients, which glibc keeps mapped below its
    mmap threshold; trimmed, the RSS between steps is what is live, as the plan prices it. One
    ``pread`` of /proc/self/statm a step; nothing off glibc (macOS returns pages itself)."""

    def __init__(self, min_growth: int = TRIM_MIN_GROWTH_BYTES) -> None:
        self.min_growth = min_growth
        self.trims = 0  # how many times it handed pages back
        self._libc = _libc()
        self._statm = _ProcFile("/proc/self/statm") if self._libc is not None else None
        self._base = self._rss()

    def _rss(self) -> int | None:
        sm = self._statm.read() if self._statm is not None else None
        return _statm_rss(sm) if sm else None

    def after_step(self) -> bool:
        """Trim if the step left enough behind; whether it did."""
        rss = self._rss()
        if rss is None or self._base is None:
            return False
        if rss - self._base < self.min_growth:
            self._base = min(self._base, rss)
            return False
        self._libc.malloc_trim(0)
        self.trims += 1
        self._base = self._rss()
        return True


class SystemProbe:
    """Process and system memory: RSS, peak RSS, process swap, system swap, pressure."""

    def __init__(self) -> None:
        self._status = _ProcFile("/proc/self/status")
        self._statm = _ProcFile("/proc/self/statm")
        self._last: dict[str, Any] | None = None
        self._peak_rss = 0
        if _LINUX:
            # Peak RSS is per run, not per process (a sweep runs its jobs in one process):
            # "5" resets the kernel's VmHWM to the current RSS (proc(5), clear_refs).
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
        self._meminfo = _ProcFile("/proc/meminfo")
        self._stat = _ProcFile("/proc/self/stat")
        self._vmstat = _ProcFile("/proc/vmstat")
        self._psi = _ProcFile("/proc/pressure/memory")
        self._darwin_vm: DarwinVM | None = DarwinVM() if _DARWIN else None
        self._psi_ok = _LINUX and os.path.exists("/proc/pressure/memory")
        self._proc: Any = None  # psutil.Process, non-Linux only
        self._darwin_sysctl: Any = None
        self.system_total = self._system_total()

    @staticmethod
    def _system_total() -> int | None:
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except Exception:
            return None

    def read(self, fresh: bool = True) -> dict[str, Any]:
        """One reading. Keys (bytes unless named otherwise): rss, peak_rss, swap_process,
        swap_used, swap_total, system_total, system_available, psi_some_avg10 and
        psi_full_avg10 (percent of the last 10 s some/all tasks stalled on memory; Linux),
        pressure_level (macOS kern.memorystatus_vm_pressure_level: 1 normal, 2 warn, 4
        critical).

        Args:
            fresh: read every figure afresh (on Linux four ``pread`` calls on descriptors kept
                open: /proc/self/statm, /proc/self/status, /proc/meminfo,
                /proc/pressure/memory). When False nothing is read and the last fresh reading is
                returned: the caller decides how often a fresh reading is worth its cost (see
                Accountant ``io_budget``). The first reading is always fresh.
        """
        if self._last is not None and not fresh:
            return self._last
        out: dict[str, Any] = {"rss": None, "peak_rss": None, "swap_process": None, **dict.fromkeys(_PROCESS_KEYS)}
        if _LINUX:
            sm = self._statm.read()
            if sm:
                out["rss"] = _statm_rss(sm)
            st = self._status.read()
            if st:
                out["swap_process"] = _kib_field(st, b"VmSwap:")
                # VmHWM: the kernel's RSS high-water mark since this probe reset it
                self._peak_rss = max(self._peak_rss, _kib_field(st, b"VmHWM:") or 0)
            self._peak_rss = max(self._peak_rss, out["rss"] or 0)
            out["peak_rss"] = self._peak_rss or None
            out["major_faults"] = _parse_majflt(self._stat.read())
            sysf: dict[str, Any] = dict.fromkeys(_SYSTEM_KEYS)
            sysf["system_total"] = self.system_total
            mi = self._meminfo.read()
            if mi:
                total, free = _kib_field(mi, b"SwapTotal:"), _kib_field(mi, b"SwapFree:")
                sysf["swap_total"] = total
                # psutil's definition of used swap: total - free
                sysf["swap_used"] = total - free if total is not None and free is not None else None
                sysf["system_available"] = _kib_field(mi, b"MemAvailable:")
                sysf["compressed"] = _kib_field(mi, b"Zswap:")  # zswap's compressed pool, where enabled
            vm = self._vmstat.read()
            if vm:  # pages swapped in/out since boot, system-wide
                sysf["swapped_in"], sysf["swapped_out"] = (_count_field(vm, k) for k in (b"pswpin ", b"pswpout "))
                sysf["swapped_in"] = sysf["swapped_in"] * _PAGE if sysf["swapped_in"] is not None else None
                sysf["swapped_out"] = sysf["swapped_out"] * _PAGE if sysf["swapped_out"] is not None else None
            if self._psi_ok:
                psi = self._psi.read()
                if psi:
                    sysf["psi_some_avg10"], sysf["psi_full_avg10"] = _parse_psi(psi)
            out.update(sysf)
        else:
            self._read_portable(out)
        self._last = out
        return out

    def _read_portable(self, out: dict[str, Any]) -> None:
        try:
            import psutil

            if self._proc is None:
                self._proc = psutil.Process()
            out["rss"] = int(self._proc.memory_info().rss)
        except Exception:
            pass
        sysf: dict[str, Any] = dict.fromkeys(_SYSTEM_KEYS)
        sysf["system_total"] = self.system_total
        try:
            import psutil

            sw = psutil.swap_memory()  # macOS: sysctl vm.swapusage
            sysf["swap_used"], sysf["swap_total"] = int(sw.used), int(sw.total)
            sysf["system_available"] = int(psutil.virtual_memory().available)
        except Exception:
            pass
        if _DARWIN:
            sysf["pressure_level"] = self._darwin_pressure()
            if self._darwin_vm is not None:
                proc, system = self._darwin_vm.read()
                out.update(proc)
                sysf.update(system)
        out.update(sysf)
        try:
            import resource

            ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            # ru_maxrss is bytes on macOS, KiB on Linux and the BSDs
            out["peak_rss"] = int(ru) if _DARWIN else int(ru) * 1024
        except Exception:
            pass

    def _darwin_pressure(self) -> int | None:
        # sysctlbyname through ctypes: microseconds, where a `sysctl` subprocess costs ms
        try:
            import ctypes

            if self._darwin_sysctl is None:
                libc = ctypes.CDLL(None)
                self._darwin_sysctl = libc.sysctlbyname
            val = ctypes.c_int(0)
            size = ctypes.c_size_t(ctypes.sizeof(val))
            rc = self._darwin_sysctl(b"kern.memorystatus_vm_pressure_level", ctypes.byref(val),
                                     ctypes.byref(size), None, ctypes.c_size_t(0))
            return int(val.value) if rc == 0 else None
        except Exception:
            return None


def _count_field(text: bytes, key: bytes) -> int | None:
    """The number after ``key`` at the start of a line of /proc/vmstat."""
    i = text.find(b"\n" + key)
    i = i + 1 if i >= 0 else (0 if text.startswith(key) else -1)
    if i < 0:
        return None
    try:
        return int(text[i + len(key) :].split(None, 1)[0])
    except (ValueError, IndexError):
        return None


def _parse_majflt(stat: bytes | None) -> int | None:
    """Field 12 of /proc/self/stat (majflt: faults that read a page from disk or swap)."""
    if not stat:
        return None
    try:
        return int(stat[stat.rindex(b")") + 2 :].split()[9])  # fields after "comm)": state=3 ... majflt=12
    except (ValueError, IndexError):
        return None


class DarwinVM:
    """macOS memory figures through the Mach calls Activity Monitor reads, via ctypes (a few
    microseconds; no subprocess):

    - ``task_info(mach_task_self(), TASK_VM_INFO)`` -> ``task_vm_info_data_t`` (osfmk/mach/
      task_info.h, ``#pragma pack(4)``): ``phys_footprint`` (rev1: what the kernel charges the
      process, including its compressed and swapped-out pages, the figure Activity Monitor's
      "Memory" column shows) and ``compressed`` (this task's bytes in the compressor).
    - ``host_statistics64(mach_host_self(), HOST_VM_INFO64)`` -> ``vm_statistics64``
      (osfmk/mach/vm_statistics.h): ``compressor_page_count`` (pages the compressor occupies),
      ``swapins``/``swapouts`` (pages, cumulative since boot), times the page size.

    Every figure is None where a call fails (never 0 for unknown)."""

    TASK_VM_INFO = 22
    HOST_VM_INFO64 = 4

    def __init__(self) -> None:
        import ctypes

        c = ctypes
        self._c = c

        class TaskVmInfo(c.Structure):  # rev1: up to phys_footprint
            _pack_ = 4
            _fields_ = [("virtual_size", c.c_uint64), ("region_count", c.c_int32), ("page_size", c.c_int32),
                        *[(n, c.c_uint64) for n in (
                            "resident_size", "resident_size_peak", "device", "device_peak", "internal",
                            "internal_peak", "external", "external_peak", "reusable", "reusable_peak",
                            "purgeable_volatile_pmap", "purgeable_volatile_resident",
                            "purgeable_volatile_virtual", "compressed", "compressed_peak",
                            "compressed_lifetime", "phys_footprint")]]

        class VmStatistics64(c.Structure):
            _fields_ = [*[(n, c.c_uint32) for n in ("free_count", "active_count", "inactive_count", "wire_count")],
                        *[(n, c.c_uint64) for n in ("zero_fill_count", "reactivations", "pageins", "pageouts",
                                                    "faults", "cow_faults", "lookups", "hits", "purges")],
                        ("purgeable_count", c.c_uint32), ("speculative_count", c.c_uint32),
                        *[(n, c.c_uint64) for n in ("decompressions", "compressions", "swapins", "swapouts")],
                        *[(n, c.c_uint32) for n in ("compressor_page_count", "throttled_count",
                                                    "external_page_count", "internal_page_count")],
                        ("total_uncompressed_pages_in_compressor", c.c_uint64)]

        self.TaskVmInfo, self.VmStatistics64 = TaskVmInfo, VmStatistics64
        self._task_info = self._host_stats = None
        self._task = self._host = None
        self.page = _PAGE
        try:
            libc = c.CDLL("/usr/lib/libSystem.B.dylib")
            self._task = c.c_uint32.in_dll(libc, "mach_task_self_").value  # mach_task_self() is this global
            libc.mach_host_self.restype = c.c_uint32
            self._host = libc.mach_host_self()
            self._task_info, self._host_stats = libc.task_info, libc.host_statistics64
            page = c.c_uint64(0)
            if libc.host_page_size(self._host, c.byref(page)) == 0 and page.value:
                self.page = int(page.value)  # the VM page size (16 KiB on Apple Silicon)
        except (OSError, AttributeError, ValueError):
            pass

    @staticmethod
    def counts(struct: type) -> int:
        """The ``*_COUNT`` a Mach call takes for ``struct``: its size in 32-bit words."""
        import ctypes

        return ctypes.sizeof(struct) // 4

    def read(self) -> tuple[dict[str, int | None], dict[str, int | None]]:
        c = self._c
        proc: dict[str, int | None] = {"phys_footprint": None, "compressed_process": None}
        system: dict[str, int | None] = {"compressed": None, "swapped_in": None, "swapped_out": None}
        if self._task_info is not None:
            info, n = self.TaskVmInfo(), c.c_uint32(self.counts(self.TaskVmInfo))
            if self._task_info(self._task, self.TASK_VM_INFO, c.byref(info), c.byref(n)) == 0:
                proc = {"phys_footprint": int(info.phys_footprint), "compressed_process": int(info.compressed)}
        if self._host_stats is not None:
            vm, n = self.VmStatistics64(), c.c_uint32(self.counts(self.VmStatistics64))
            if self._host_stats(self._host, self.HOST_VM_INFO64, c.byref(vm), c.byref(n)) == 0:
                system = {"compressed": int(vm.compressor_page_count) * self.page,
                          "swapped_in": int(vm.swapins) * self.page, "swapped_out": int(vm.swapouts) * self.page}
        return proc, system


def _parse_psi(text: bytes) -> tuple[float | None, float | None]:
    """``some avg10=0.00 ...`` / ``full avg10=...`` lines of /proc/pressure/memory -> percents."""
    some = full = None
    for line in text.splitlines():
        i = line.find(b"avg10=")
        if i < 0:
            continue
        try:
            v = float(line[i + 6 :].split()[0])
        except (ValueError, IndexError):
            continue
        if line.startswith(b"some"):
            some = v
        elif line.startswith(b"full"):
            full = v
    return some, full


# what NVML counts beyond the allocator's reserved bytes that a sample can name: paged optimizer
# state (bitsandbytes, unified memory), the CUDA context (measured when it was created), other
# processes on the device
NON_ALLOCATOR_PARTS = ("paged_optimizer_state", "cuda_context", "other_processes_used")


def reconcile_nvml(used: int | None, reserved: int | None, known: list[int | None]) -> tuple[int | None, int | None]:
    """NVML's view against the allocator's: (non_allocator = NVML used - reserved, the part of
    it no known cause covers: ``known``, the bytes of ``NON_ALLOCATOR_PARTS`` where measured);
    (None, None) where either reading is missing. One device's row, or sums over ranks."""
    if used is None or reserved is None:
        return None, None
    na = used - reserved
    return na, na - sum(v for v in known if v is not None)


class NvmlProbe:
    """NVML per-device figures for the CUDA devices this process uses.

    Handles are opened once. The CUDA index -> NVML device mapping uses the UUID or PCI bus id
    when the backend gives one, else CUDA_VISIBLE_DEVICES (integers or GPU-UUID prefixes), else
    the same index (right when CUDA_DEVICE_ORDER=PCI_BUS_ID or with one GPU). If NVML is missing or fails, every figure is None and it is not retried.
    """

    def __init__(self) -> None:
        self.ok: bool | None = None  # None: not tried yet
        self.error: str | None = None
        self._nv: Any = None
        self._handles: dict[int, Any] = {}
        self._v2 = True

    def _init(self) -> bool:
        if self.ok is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nv = pynvml
                self.ok = True
            except Exception as e:  # no driver, no library: NVML figures stay None
                self.ok, self.error = False, f"{type(e).__name__}: {e}"
        return bool(self.ok)

    def _handle(self, cuda_index: int, pci_bus_id: str | None, uuid: str | None = None) -> Any:
        if cuda_index in self._handles:
            return self._handles[cuda_index]
        nv, h = self._nv, None
        try:
            if uuid:
                u = str(uuid)
                h = nv.nvmlDeviceGetHandleByUUID((u if u.startswith(("GPU-", "MIG-")) else "GPU-" + u).encode())
            elif pci_bus_id:
                h = nv.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode() if isinstance(pci_bus_id, str) else pci_bus_id)
            else:
                vis = os.environ.get("CUDA_VISIBLE_DEVICES")
                entries = [e.strip() for e in vis.split(",") if e.strip()] if vis else None
                if entries is None:
                    h = nv.nvmlDeviceGetHandleByIndex(cuda_index)
                elif cuda_index < len(entries):
                    e = entries[cuda_index]
                    if e.isdigit():
                        h = nv.nvmlDeviceGetHandleByIndex(int(e))
                    elif e.startswith("GPU-"):
                        for i in range(nv.nvmlDeviceGetCount()):
                            cand = nv.nvmlDeviceGetHandleByIndex(i)
                            uuid = nv.nvmlDeviceGetUUID(cand)
                            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                            if uuid.startswith(e):
                                h = cand
                                break
                    # MIG-... slices: device-wide NVML figures would describe the whole GPU; leave None
        except Exception:
            h = None
        self._handles[cuda_index] = h
        return h

    def read(self, cuda_index: int, pci_bus_id: str | None = None, processes: bool = True,
             own_context: bool = True, uuid: str | None = None) -> dict[str, int | None]:
        """NVML figures for one CUDA device, bytes.

        Args:
            cuda_index: the device index as CUDA numbers it in this process.
            pci_bus_id: optional bus id from the backend, an exact way to find the device.
            uuid: optional device UUID from the backend (torch's device properties ``uuid``,
                with or without the "GPU-" prefix), the other exact way.
            processes: also read the per-process list (slower than the memory figures).
            own_context: this process holds a CUDA context on the device (so it is one of the
                listed compute processes).

        Returns:
            device_used (v2: excluding driver-reserved memory), device_total, process_used
            (this process), other_processes_used (every other listed process); None each where
            NVML cannot say, e.g. per-process figures inside a container's pid namespace.
        """
        out: dict[str, int | None] = {"device_used": None, "device_total": None,
                                      "process_used": None, "other_processes_used": None}
        if not self._init():
            return out
        h = self._handle(cuda_index, pci_bus_id, uuid)
        if h is None:
            return out
        nv = self._nv
        try:
            if self._v2:
                try:
                    mi = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
                except Exception:
                    self._v2 = False
            if not self._v2:
                mi = nv.nvmlDeviceGetMemoryInfo(h)
            out["device_used"], out["device_total"] = int(mi.used), int(mi.total)
        except Exception:
            return out
        if processes:
            try:
                procs = list(nv.nvmlDeviceGetComputeRunningProcesses(h))
                mem = {int(p.pid): p.usedGpuMemory for p in procs}
                me = os.getpid()
                if me not in mem and own_context and len(mem) == 1:
                    # Our pid is not visible (pid namespace of a container), but we hold a
                    # context on this device, so the only compute process listed is us.
                    me = next(iter(mem))
                if me in mem and all(v is not None for v in mem.values()):
                    out["process_used"] = int(mem[me])
                    out["other_processes_used"] = int(sum(v for p, v in mem.items() if p != me))
            except Exception:
                pass
        return out
