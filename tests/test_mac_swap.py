"""The Mac user's question, answered from the accounting: "Peak mem 201 GB on a 192 GB machine,
how is this possible, will it be a problem?"

The rule is a pure function over samples, so a timeline shaped like that run (a 72B LoRA on a
192 GB Mac; recorded shape, figures chosen to be distinct so each can be asserted) is explained
here exactly as a live one would be. The readers are tested on the platform they run on: the
Linux ones against the kernel's own counters here, the macOS ones (ctypes Mach calls) for their
struct layouts here and for real values only on macOS.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

import pytest

from finetune.accounting import explain
from finetune.accounting.probes import DarwinVM, SystemProbe, _count_field, _parse_majflt

GiB = 1 << 30
RAM = 192 * GiB
STEPS = 20
SWAP_STEPS = range(6, 13)  # the OS swapped in steps 6..12
CALM_S, SWAP_S = 12.0, 30.0  # seconds per step outside / inside them


def _timeline(governor_acted: bool = True) -> tuple[list[dict], list[dict]]:
    tl, t, out = [], 0.0, 0
    common = {"backend": "mlx", "system_total": RAM, "mlx_recommended_working_set": 144 * GiB, "system_fresh": True}
    tl.append({**common, "step": 0, "phase": "load", "time_s": 0.0, "allocated": 136 * GiB, "mlx_peak": 137 * GiB,
               "peak_scope": "since_load", "swapped_out": 5 * GiB, "swap_used": 1 * GiB, "phys_footprint": 137 * GiB,
               "compressed": 1 * GiB, "swap_growth": 0})
    for step in range(1, STEPS + 1):
        t += SWAP_S if step in SWAP_STEPS else CALM_S
        if step in SWAP_STEPS:
            out += 11 * GiB // len(SWAP_STEPS)
        peak = 201 * GiB if step >= 2 else 180 * GiB
        tl.append({**common, "step": step, "phase": "optimizer", "time_s": t, "allocated": 137 * GiB,
                   "mlx_peak": peak, "step_peak_allocated": peak, "peak_scope": "step",
                   "swapped_out": 5 * GiB + out, "swap_used": 1 * GiB + out, "swap_growth": out,
                   "phys_footprint": 205 * GiB if step in SWAP_STEPS else 190 * GiB,
                   "compressed": 14 * GiB if step in SWAP_STEPS else 3 * GiB})
    events = [{"step": 7, "trigger": "swap_growth", "action": "lower_micro_batch",
               "before": {"batch_size": 4, "grad_accum": 1}, "after": {"batch_size": 2, "grad_accum": 2}}]
    return tl, events if governor_acted else []


def test_mac_swap_sentence_names_ram_peak_footprint_swap_and_slowdown() -> None:
    tl, events = _timeline()
    ex = {e["rule"]: e for e in explain(tl, {"adaptations": events, "adapt": True, "budget_set": True})}
    m = ex["mlx_peak_over_ram"]
    f, text = m["figures"], m["text"]
    swapped = 7 * (11 * GiB // 7)
    assert m["severity"] == "warning"
    assert (f["peak"], f["ram"], f["over"]) == (201 * GiB, RAM, 9 * GiB)
    assert "201 GiB (step 2)" in text and "192 GiB of RAM by 9.00 GiB" in text
    assert f["phys_footprint"] == 205 * GiB and "footprint of 205 GiB" in text
    assert f["compressed"] == 14 * GiB and "14.0 GiB compressed" in text
    assert f["swapped_out"] == swapped and f"swapped {swapped / GiB:.1f} GiB out to disk" in text
    # the step-time change from the run's own timings: 7 swapping steps at 30 s against 12 s
    assert f["swapping_steps_count"] == 7 and f["step_ms_swapping"] == 30000 and f["step_ms_other"] == 12000
    assert f["slowdown_pct"] == pytest.approx(150.0)
    assert "a step took 30.00 s against 12.00 s" in text and "(2.50x): training slowed" in text
    assert "lowered the micro-batch 4 -> 2 at step 7 (swap_growth)" in text
    assert "swap_growth" not in ex  # the MLX rule says it once


def test_mac_swap_sentence_without_governor_and_without_slowdown() -> None:
    tl, _ = _timeline(governor_acted=False)
    calm = [{**s, "time_s": s["step"] * CALM_S} for s in tl]  # swapping steps took no longer
    m = next(e for e in explain(calm, {"adaptations": [], "adapt": True, "budget_set": False})
             if e["rule"] == "mlx_peak_over_ram")
    assert ": training did not slow" in m["text"] and m["figures"]["slowdown_pct"] == pytest.approx(0.0)
    assert "the governor changed nothing; set memory.budget" in m["text"]


def test_no_sentence_when_the_peak_fits() -> None:
    tl, _ = _timeline()
    small = [{**s, "mlx_peak": 100 * GiB, "step_peak_allocated": 100 * GiB} for s in tl]
    assert not [e for e in explain(small) if e["rule"].startswith("mlx_peak")]


# ---- the readers ----------------------------------------------------------------------------

def test_proc_parsers_on_recorded_text() -> None:
    # a comm with a space and a ")" in it: the fields are counted after the last ")"
    stat = b"4242 (py (x) y) S 1 4242 4242 0 -1 4194560 1234 0 77 0 5 3 0 0 20 0 4 0 99 1 2\n"
    assert _parse_majflt(stat) == 77
    vm = b"nr_free_pages 100\npswpin 12\npswpout 34\nswap_ra 9\n"
    assert (_count_field(vm, b"pswpin "), _count_field(vm, b"pswpout "), _count_field(vm, b"nope ")) == (12, 34, None)
    assert _count_field(b"pswpin 5\n", b"pswpin ") == 5  # the first line too


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc readers")
def test_linux_readers_match_the_kernel() -> None:
    r = SystemProbe().read()
    # majflt of /proc/self/stat is getrusage's ru_majflt for this process
    assert r["major_faults"] == resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    vm = dict(line.split() for line in open("/proc/vmstat").read().splitlines())
    page = os.sysconf("SC_PAGE_SIZE")
    assert r["swapped_in"] == int(vm["pswpin"]) * page and r["swapped_out"] == int(vm["pswpout"]) * page
    assert r["phys_footprint"] is None and r["compressed_process"] is None  # macOS figures: unknown here


def test_darwin_structs_have_the_mach_sizes() -> None:
    """HOST_VM_INFO64_COUNT is 38 words (osfmk/mach/vm_statistics.h) and task_vm_info up to
    phys_footprint (rev1) is 38 words under #pragma pack(4) (osfmk/mach/task_info.h)."""
    d = DarwinVM()
    assert d.counts(d.VmStatistics64) == 38 and d.counts(d.TaskVmInfo) == 38
    assert d.TaskVmInfo.phys_footprint.offset == 144 and d.TaskVmInfo.compressed.offset == 120
    assert d.VmStatistics64.swapins.offset == 112 and d.VmStatistics64.compressor_page_count.offset == 128
    if sys.platform != "darwin":  # no libSystem: every figure unknown, never 0
        proc, system = d.read()
        assert set(proc.values()) == {None} and set(system.values()) == {None}


@pytest.mark.skipif(sys.platform != "darwin", reason="Mach calls exist on macOS only")
def test_darwin_readers_on_a_mac() -> None:
    proc, system = DarwinVM().read()
    assert proc["phys_footprint"] and proc["phys_footprint"] > 1 << 20
    assert system["compressed"] is not None and system["swapped_out"] is not None
    blob = ctypes.create_string_buffer(64 << 20)  # touching 64 MiB raises the footprint
    ctypes.memset(blob, 1, len(blob))
    assert DarwinVM().read()[0]["phys_footprint"] >= proc["phys_footprint"] + (48 << 20)
