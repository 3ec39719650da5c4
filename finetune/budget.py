"""Memory budgets: parse ``memory.budget`` and find how much memory the run's device has.

Nothing here imports torch or mlx: ``mode=plan`` must stay light. The device size comes from
NVML (nvidia-ml-py, imported lazily, absent driver handled), ``sysctl`` on macOS, or psutil.
"""

from __future__ import annotations

import functools
import platform
import re
import subprocess
import sys
from dataclasses import dataclass

from finetune.errors import UserError

# Decimal units are powers of 1000, binary ones powers of 1024 (GB = 1e9 B, GiB = 2^30 B).
UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
VALID_FORMS = 'bytes (e.g. 42949672960 or "42949672960"), "40GiB", "40GB", "512MiB", "1.5TB", or "90%" of the device'
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*%\s*$")


def parse_budget(text: str | int | None, device_total: int | None, key: str = "memory.budget") -> int | None:
    """Turn a ``memory.budget`` value (or another size setting, ``key``) into bytes.

    Args:
        text: None (use the device's size), an int of bytes, or a string: a number of bytes
            ("123"), a number with a unit ("40GiB" = 40 * 2^30, "40GB" = 40 * 10^9, "512MiB",
            also KB/MB/TB and KiB/TiB, case-insensitive), or a percentage of the device ("90%").
        device_total: bytes of the device the budget applies to, None where unknown.

    Returns:
        The budget in bytes (rounded down), or ``device_total`` (possibly None) when ``text`` is None.

    Raises:
        UserError: for text in none of the valid forms, a budget that is not positive, a bare
            fraction ("0.9": the message names "90%"), or a percentage when the device size is
            unknown; the message names the valid forms.
    """
    if text is None:
        return device_total
    if isinstance(text, bool):  # bool is an int: true/false is not a size
        raise UserError(f"{key}={text} is not a size; use {VALID_FORMS}")
    if isinstance(text, (int, float)):
        _check_fraction(text, float(text), key)
        value = int(text)
        if value <= 0:
            raise UserError(f"{key}={text} must be positive; use {VALID_FORMS}")
        _check_unitless(text, value, key)
        return value
    s = str(text)
    m = _PERCENT.match(s)
    if m:
        pct = float(m.group(1))
        if not 0 < pct <= 100:
            raise UserError(f"{key}={s}: a percentage must be in (0, 100]; use {VALID_FORMS}")
        if device_total is None:
            raise UserError(f"{key}={s} needs the device's size, which is unknown here; "
                            'give bytes or a unit instead (e.g. "40GiB")')
        return int(device_total * pct / 100)
    m = _NUMBER_UNIT.match(s)
    if not m or m.group(2).lower() not in UNITS:
        raise UserError(f"{key}={s} is not a size; use {VALID_FORMS}")
    if not m.group(2):
        _check_fraction(m.group(1), float(m.group(1)), key)
    value = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if value <= 0:
        raise UserError(f"{key}={s} must be positive; use {VALID_FORMS}")
    if not m.group(2):
        _check_unitless(m.group(1), value, key)
    return value


# No model trains in less than 1 MiB (the tiny test model's weights alone are ~0.4 MiB), so a
# bare number below it is a unit left out ("40" meant as 40 GB), not a budget.
MIN_UNITLESS_BYTES = 2**20


def _check_fraction(shown: object, number: float, key: str) -> None:
    """UserError for a bare number between 0 and 1 (``memory.budget=0.9``): a share meant as a
    fraction, which a size never is; the fix names the percentage form. Refused rather than read
    as a share: a bare number counts bytes everywhere else in these keys, and reading 0.99 as
    99% beside 1 as one byte would put a cliff at 1."""
    if 0 < number < 1:
        of = " of the device" if key == "memory.budget" else ""
        raise UserError(f"{key}={shown} is a fraction, not a size; for {number * 100:g}%{of} write "
                        f"{key}={number * 100:g}%")


def _check_unitless(shown: object, value: int, key: str = "memory.budget") -> None:
    """UserError for a budget given without a unit that is too small to be one in bytes,
    naming the unit the user most likely meant (GB below 1000, MB above: "8000" is 8000MB)."""
    if value >= MIN_UNITLESS_BYTES:
        return
    meant = "GB" if value < 1000 else "MB"
    raise UserError(f"{key}={shown} is {value:,} bytes: did you mean {shown}{meant}? "
                    "(a number without a unit counts bytes)")


@dataclass
class DeviceMemory:
    """How much memory one device of the run has, and where the figure came from."""

    total_bytes: int | None  # per device (per GPU where there are several)
    count: int  # devices of this kind visible (GPUs for cuda; 1 otherwise)
    source: str  # e.g. "nvml", "psutil", "sysctl hw.memsize * 0.75 (estimate)"
    estimate: bool  # True where the figure is derived by a rule rather than read


@functools.lru_cache(maxsize=1)
def cuda_devices() -> tuple[int, int | None]:
    """(number of NVIDIA GPUs, total bytes of GPU 0) via NVML; (0, None) without a driver.

    NVML is what nvidia-smi reads; importing it loads no CUDA context and no torch.
    """
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return 0, None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: no GPU here
        return 0, None
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        total = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total) if count else None
        return count, total
    except Exception:
        return 0, None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def _sysctl_int(name: str) -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=False)
        return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=1)
def apple_working_set() -> tuple[int | None, str, bool]:
    """Metal's recommended working set (the most the GPU should keep wired), without mlx.

    mlx reports it as ``mx.device_info()["max_recommended_working_set_size"]`` and documents it
    as the system wired limit (mlx.core.set_wired_limit: raise it with
    ``sysctl iogpu.wired_limit_mb``). If that sysctl is set we read it; otherwise macOS's default
    is about 2/3 of RAM on machines up to 36 GB and 3/4 above (Metal's
    recommendedMaxWorkingSetSize as reported on M-series Macs) - a rule, labelled as an estimate.
    """
    wired_mb = _sysctl_int("iogpu.wired_limit_mb")
    if wired_mb:
        return wired_mb * 2**20, "sysctl iogpu.wired_limit_mb", False
    ram = _sysctl_int("hw.memsize")
    if ram is None:
        return None, "unknown", True
    total, label = apple_working_set_rule(ram)
    return total, f"sysctl hw.memsize * {label} (estimate of Metal's recommended working set)", True


def apple_working_set_rule(ram_bytes: int) -> tuple[int, str]:
    """(bytes, fraction as text): macOS's default working set for a Mac of ``ram_bytes`` of
    unified memory when ``iogpu.wired_limit_mb`` is 0, as the rule above states it (2/3 up to
    36 GB, 3/4 above). A rule, not a reading: recorded ``mx.device_info()`` outputs
    (tests/data/mac_device_info.json) show recent macOS giving large Macs more (0.84 of RAM
    on a 192 GB M2 Ultra and a 128 GB M5 Max), so it errs low there."""
    frac, label = (0.75, "3/4") if ram_bytes > 36 * 10**9 else (2 / 3, "2/3")
    return int(ram_bytes * frac), label


def system_ram() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def host_memory() -> DeviceMemory:
    """The machine's RAM as a device (a CPU run)."""
    ram = system_ram()
    return DeviceMemory(ram, 1, "psutil (system RAM)" if ram else "unknown", False)
