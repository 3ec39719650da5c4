"""Metal's working set on Apple silicon, mlx-free: what an mlx plan's peak is judged against on
a Mac, what happens past it, and what brings the peak under it.

MLX on an Apple GPU works within Metal's recommended working set
(``mx.device_info()["max_recommended_working_set_size"]``, MTLDevice.recommendedMaxWorkingSetSize):

- MLX refuses ``mx.set_wired_limit`` above it ("Setting a wired limit larger than the maximum
  working set size is not allowed"), so at most that much of a run is kept wired (resident);
- its allocator starts releasing cached buffers at 0.95 of it and, unless
  ``mx.set_memory_limit`` says otherwise, lets a run allocate up to min(1.5 x it, 0.95 x RAM)
  (mlx/backend/metal/allocator.cpp, ``MetalAllocator::MetalAllocator``: gc_limit_, block_limit_);
- so a peak past the working set still runs, but what is not wired may be compressed and
  swapped out by macOS and the steps slow down (a 72B LoRA reporting "Peak mem 201 GB" on a
  192 GB Mac); a peak past the Mac's RAM ends with a Metal command buffer failing for memory,
  which kills the process.

macOS sets the working set: its default, or ``sysctl iogpu.wired_limit_mb`` when that is not 0
(Metal then reports exactly that figure: AlexsJones/llmfit#754, antirez/ds4#893). It is read
from ``mx.device_info()``: this Mac's by a child process (the plan itself never imports mlx), or
a recorded one the user names (``memory.device_info``); else it is estimated from
``memory.budget`` taken as the Mac's RAM with macOS's rule (``finetune.budget``). Every figure is
an int of bytes.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.budget import apple_silicon, apple_working_set_rule, parse_budget
from finetune.errors import UserError

GIB = 2**30
MIB = 2**20
WORKING_SET_KEY = "max_recommended_working_set_size"
RAM_KEY = "memory_size"

# The iogpu.wired_limit_mb lever: the working set it asks for covers the peak with 5% over
# (MLX starts releasing its cache at 0.95 of the working set, and the plan's activations are
# calibrated to ~10%), rounded up to a whole GiB ...
SYSCTL_PEAK_MARGIN = 1.05
# ... and leaves macOS, the window server and the trainer's own CPU-side memory (Python, the
# tokenizer and data, the safetensors pages while loading) the larger of 8 GiB and 1/16 of RAM:
# 12 GiB on a 192 GB Mac, 8 GiB on 128 GB and below. Those who raise it on large Macs leave
# 12-16 GiB (mlx's author ran a 192 GB M2 Ultra at 180000 MiB, ml-explore/mlx#1060; a 128 GB
# M5 Max at 112 GiB, antirez/ds4#893); Apple's own default leaves a quarter to a third.
OS_HEADROOM_MIN_BYTES = 8 * GIB
OS_HEADROOM_RAM_FRACTION = 16

PAST_WORKING_SET = ("it runs, but MLX keeps at most the working set wired: macOS may compress and swap out the "
                    "rest and the steps slow down; past the Mac's RAM a Metal command buffer fails for memory and "
                    "the process is killed")
WIRED_LIMIT_HOW = ("finetune calls mx.set_wired_limit(min(budget, working set)) when memory.adapt=true "
                   "(backends/mlx/runtime.py set_memory_limits); MLX refuses more than the working set, so only "
                   "sudo sysctl iogpu.wired_limit_mb raises it")

# Run in a child process on a Mac, so that mode=plan never imports mlx itself; mlx before 0.30
# has only mx.metal.device_info.
_PROBE = ("import json, mlx.core as mx; "
          "f = getattr(mx, 'device_info', None) or mx.metal.device_info; print(json.dumps(dict(f())))")


@dataclass(frozen=True)
class WorkingSet:
    """Metal's working set for the Mac a plan is for, and where the figure came from."""

    bytes: int | None  # None: unknown (not on a Mac, and nothing says which Mac)
    ram_bytes: int | None  # the Mac's unified memory (device_info memory_size), None where unknown
    source: str
    estimate: bool  # True where a rule gave it rather than Metal


def read_working_set(info: Mapping[str, Any]) -> int:
    """The working set a ``mx.device_info()`` dict holds, exactly as it holds it.

    Raises:
        UserError: for a dict without a positive int ``max_recommended_working_set_size``.
    """
    value = info.get(WORKING_SET_KEY)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"memory.device_info: {WORKING_SET_KEY} must be a positive int of bytes, as "
                        f"mx.device_info() prints it; got {value!r}")
    return value


def working_set_of(info: Mapping[str, Any], source: str) -> WorkingSet:
    """The working set and RAM of a ``mx.device_info()`` dict (RAM None where the record has none)."""
    ram = info.get(RAM_KEY)
    ram = ram if isinstance(ram, int) and not isinstance(ram, bool) and ram > 0 else None
    return WorkingSet(read_working_set(info), ram, source, False)


def load_record(ref: str) -> tuple[dict[str, Any], str]:
    """``memory.device_info``: (the device_info dict, a label saying where it came from).

    Args:
        ref: ``FILE``, a JSON file holding one ``mx.device_info()`` dict (``python -c "import json,
            mlx.core as mx; print(json.dumps(mx.device_info()))" > mac.json``); or ``FILE:NAME``,
            one record of a file of several (``{"macs": {NAME: {"device_info": {...}}}}``, as
            tests/data/mac_device_info.json).

    Raises:
        UserError: for a file that cannot be read, is not JSON, or holds no such record.
    """
    path, name = Path(ref), None
    if not path.is_file() and ":" in ref:
        head, _, name = ref.rpartition(":")
        path = Path(head)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"memory.device_info={ref}: cannot read {path} ({e.strerror or e})") from None
    except ValueError as e:
        raise UserError(f"memory.device_info={ref}: {path} is not JSON ({e})") from None
    if isinstance(data, dict) and WORKING_SET_KEY in data and name is None:
        return data, f"recorded mx.device_info(): {path}"
    macs = data.get("macs") if isinstance(data, dict) else None
    if not isinstance(macs, dict) or not macs:
        raise UserError(f"memory.device_info={ref}: {path} holds neither a mx.device_info() dict nor "
                        '{"macs": {NAME: {"device_info": {...}}}}')
    if name is None:
        if len(macs) != 1:
            raise UserError(f"memory.device_info={ref}: {path} records several Macs; name one as "
                            f"{path}:NAME, NAME one of: {', '.join(macs)}")
        name = next(iter(macs))
    if name not in macs:
        raise UserError(f"memory.device_info={ref}: no Mac named {name!r} in {path}; choose one of: {', '.join(macs)}")
    record = macs[name]
    info = record.get("device_info", record) if isinstance(record, dict) else None
    if not isinstance(info, dict):
        raise UserError(f"memory.device_info={ref}: the record {name!r} holds no device_info dict")
    return info, f"recorded mx.device_info() of {name} ({path})"


@functools.lru_cache(maxsize=1)
def device_info_here() -> dict[str, Any] | None:
    """This Mac's ``mx.device_info()``, read by a child Python (None off Apple silicon, without
    mlx, or when the child fails): exact where the sysctl rule only estimates."""
    if not apple_silicon() or importlib.util.find_spec("mlx") is None:
        return None
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return None
    try:
        info = json.loads(lines[-1])
    except ValueError:
        return None
    return info if isinstance(info, dict) and WORKING_SET_KEY in info else None


def _absolute_size(text: Any) -> int | None:
    """``memory.budget`` in bytes where it is a size (a percentage needs the device: None)."""
    if text is None:
        return None
    try:
        return parse_budget(text, None)
    except UserError:
        return None


def find_working_set(device_info: str | None, budget_text: Any) -> WorkingSet:
    """The working set a plan is judged against: a named record first, then this Mac's own
    ``mx.device_info()``, then ``memory.budget`` as the Mac's RAM with macOS's default rule.

    Args:
        device_info: ``memory.device_info`` (see ``load_record``), or None.
        budget_text: ``memory.budget`` as configured, or None.
    """
    if device_info:
        return working_set_of(*load_record(str(device_info)))
    here = device_info_here()
    if here is not None:
        return working_set_of(here, "mx.device_info() of this Mac")
    ram = _absolute_size(budget_text)
    if ram is not None:
        ws, fraction = apple_working_set_rule(ram)
        return WorkingSet(ws, ram, f"memory.budget={budget_text} as the Mac's RAM x {fraction}, macOS's default: "
                                   "an estimate", True)
    return WorkingSet(None, None, "unknown: no mx.device_info() here, and neither memory.device_info nor memory.budget "
                                  "says which Mac", True)


def os_headroom_bytes(ram_bytes: int) -> int:
    """What the iogpu.wired_limit_mb lever leaves macOS on a Mac of ``ram_bytes``."""
    return max(OS_HEADROOM_MIN_BYTES, ram_bytes // OS_HEADROOM_RAM_FRACTION)


def wired_limit_mb_for(peak_bytes: int, ram_bytes: int) -> tuple[int, int]:
    """(the iogpu.wired_limit_mb that holds ``peak_bytes``, the most this Mac should be given),
    both in MiB: the peak + 5% rounded up to a whole GiB; RAM less ``os_headroom_bytes``."""
    want_mib = math.ceil(peak_bytes * SYSCTL_PEAK_MARGIN / GIB) * (GIB // MIB)
    most_mib = (ram_bytes - os_headroom_bytes(ram_bytes)) // MIB
    return want_mib, most_mib


def judge(peak_bytes: int, ws: WorkingSet) -> dict[str, Any]:
    """The peak against the working set (and the Mac's RAM where known), for plan.json."""
    total = ws.bytes
    over = None if total is None else peak_bytes - total
    return {
        "working_set_bytes": ws.bytes,
        "source": ws.source,
        "estimate": ws.estimate,
        "ram_bytes": ws.ram_bytes,
        "peak_bytes": peak_bytes,  # the plan's max_device_peak_bytes: the largest device's (rank's) peak
        "over_bytes": over,  # peak_bytes - working_set_bytes; negative: under it by that much
        "over_percent": None if total is None or over is None else round(100 * over / total, 2),  # of the working set
        "fits_working_set": None if over is None else over <= 0,
        "exceeds_ram": None if ws.ram_bytes is None else peak_bytes > ws.ram_bytes,
        "past_working_set": PAST_WORKING_SET,
    }


def sysctl_lever(peak_bytes: int, ws: WorkingSet) -> dict[str, Any] | None:
    """``sudo sysctl iogpu.wired_limit_mb=N`` where N holds the peak and leaves macOS its
    headroom; None where the Mac's RAM is unknown or it has no room for that."""
    if ws.ram_bytes is None:
        return None
    want, most = wired_limit_mb_for(peak_bytes, ws.ram_bytes)
    if want > most:
        return None
    return {"change": f"sudo sysctl iogpu.wired_limit_mb={want}", "kind": "system",
            "working_set_bytes": want * MIB, "os_headroom_bytes": ws.ram_bytes - want * MIB,
            "why": (f"Metal's working set becomes {want} MiB ({want * MIB / GIB:.0f} GiB): the peak + "
                    f"{SYSCTL_PEAK_MARGIN - 1:.0%} rounded up to a GiB, leaving {(ws.ram_bytes - want * MIB) / GIB:.1f} "
                    f"GiB of the Mac's {ws.ram_bytes / GIB:.0f} GiB to macOS (this lever leaves at least "
                    f"max(8 GiB, RAM/16)); until reboot, or sudo sysctl iogpu.wired_limit_mb=0")}


def metal_check(device_info: str | None, budget_text: Any, adapt: bool, peak_bytes: int, budget_bytes: int | None,
                levers_under: Callable[[int], list[dict[str, Any]]] | None) -> tuple[dict[str, Any], bool]:
    """plan.json's ``metal`` object, and whether the peak passes the Mac's RAM (the run is killed).

    Args:
        device_info: ``memory.device_info``.
        budget_text: ``memory.budget`` as configured.
        adapt: ``memory.adapt`` (finetune sets the wired limit only then).
        peak_bytes: the plan's ``max_device_peak_bytes``.
        budget_bytes: the plan's budget (the run's memory limit; the wired limit is the smaller of
            it and the working set).
        levers_under: the planner's own levers that bring the peak under a number of bytes
            (``[{"change", "peak_bytes"}]``); None: not searched (a plan without recommendations).
    """
    ws = find_working_set(device_info, budget_text)
    m = judge(peak_bytes, ws)
    wired = min(budget_bytes, ws.bytes) if adapt and budget_bytes and ws.bytes else None
    m["wired_limit"] = {"bytes": wired, "how": WIRED_LIMIT_HOW if adapt else
                        "memory.adapt=false: finetune sets no wired limit (MLX's default wires nothing)"}
    if ws.ram_bytes is not None:
        m["wired_limit"]["sysctl_most_mb"] = wired_limit_mb_for(peak_bytes, ws.ram_bytes)[1]  # the most the sysctl lever gives this Mac
    levers: list[dict[str, Any]] | None = None
    if ws.bytes is not None and m["fits_working_set"]:
        levers = []
    elif ws.bytes is not None and levers_under is not None:
        system = sysctl_lever(peak_bytes, ws)
        levers = ([system] if system else []) + [
            {"change": lv["change"], "kind": "plan", "peak_bytes": lv["peak_bytes"],
             "under_by_bytes": ws.bytes - lv["peak_bytes"]} for lv in levers_under(ws.bytes)]
    m["levers"] = levers  # each alone brings the peak under the working set; None: not searched
    return m, bool(m["exceeds_ram"])


def _gib(b: int) -> str:
    return f"{b / GIB:.3f} GiB ({b:,d} bytes)"


def report_lines(m: Mapping[str, Any]) -> tuple[str, list[str]]:
    """(what the table's head adds after ``fits``, the lines under the budget) for a ``metal``
    object: the working set as a row of the table (GiB = 2^30 bytes), the peak against it, and
    the levers that bring it under."""
    ws = m["working_set_bytes"]
    if ws is None:
        return "", [(f"  {'Metal working set':32s}{'?':>9s} {'?':>16s}  ({m['source']}): name the Mac's "
                     "mx.device_info() with memory.device_info=FILE (or FILE:NAME), or give its RAM as memory.budget")]
    row = f"  {'Metal working set':32s}{ws / GIB:9.3f} {ws:16,d}  ({m['source']})"
    over = m["over_bytes"]
    if over <= 0:
        return "", [row, f"  peak under Metal's working set by {_gib(-over)}, {-m['over_percent']:.2f}% of it"]
    ram = m["ram_bytes"]
    if m["exceeds_ram"]:
        past = (f"and past the Mac's {ram / GIB:.3f} GiB of RAM: a Metal command buffer fails for memory and the "
                "process is killed")
    else:
        past = ("it runs, but macOS may compress and swap out what MLX cannot wire and the steps slow down; past "
                + (f"the Mac's {ram / GIB:.3f} GiB of RAM" if ram else "the Mac's RAM") + " the process is killed")
    lines = [row, f"  peak OVER Metal's working set by {_gib(over)}, {m['over_percent']:.2f}% of it: {past}"]
    levers = m["levers"]
    most = m["wired_limit"].get("sysctl_most_mb")
    short = (f"; sudo sysctl iogpu.wired_limit_mb cannot alone (at most {most} MiB on this Mac, leaving macOS "
             "max(8 GiB, RAM/16))") if most and not any(lv["kind"] == "system" for lv in levers or []) else ""
    if levers:
        lines.append("  under Metal's working set with any one of: " + ", ".join(
            f"{lv['change']} ({lv['working_set_bytes'] / GIB:.0f} GiB working set, "
            f"{lv['os_headroom_bytes'] / GIB:.1f} GiB left to macOS)" if lv["kind"] == "system"
            else f"{lv['change']} ({lv['peak_bytes'] / GIB:.2f} GiB)" for lv in levers) + short)
    elif levers is not None:
        lines.append("  no single change brings the peak under Metal's working set" + short)
    suffix = " (past the Mac's RAM)" if m["exceeds_ram"] else " (over Metal's working set: may swap)"
    return suffix, lines
