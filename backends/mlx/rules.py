"""The mlx backend's memory explanations (unified memory, MLX's buffer cache), registered into
the shared rules (finetune/accounting/rules.py). Pure functions over recorded samples, as the
shared ones; nothing here imports mlx.
"""

from __future__ import annotations

import statistics
from typing import Any

from finetune import rulebase as rules
from finetune.rulebase import (
    Explanation,
    _ex,
    _governor_said,
    _max_of,
    _step_times,
    _swapping_steps,
)
from finetune.units import fmt_bytes as fb


def rule_mlx_peak_over_ram(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """MLX (unified memory) peak above the machine's RAM or Metal's recommended working set:
    what the OS did about it (footprint, compression, swap), what it cost in step time (the
    run's own timings, steps that swapped against those that did not) and what the governor did."""
    if not any(s.get("backend") == "mlx" or s.get("mlx_peak") is not None for s in samples):
        return []
    p1, at1 = _max_of(samples, "mlx_peak")
    p2, at2 = _max_of(samples, "peak_allocated")
    peak, at = (p1, at1) if (p1 or 0) >= (p2 or 0) else (p2, at2)
    if peak is None or at is None:
        return []
    ram = ctx.get("system_total") or at.get("system_total")
    rws = _max_of(samples, "mlx_recommended_working_set")[0]
    over_ram = bool(ram and peak > ram)
    limit = ram if over_ram else rws  # the one exceeded: RAM, else Metal's working set
    if not limit or peak <= limit:
        return []
    swap = _max_of(samples, "swap_growth")[0]
    footprint = _max_of(samples, "phys_footprint")[0]
    compressed = _max_of(samples, "compressed")[0]
    swapping, swapped_out = _swapping_steps(samples)
    times = _step_times(samples)
    fix = ("lower train.batch_size (raising train.grad_accum keeps the batch) or train.seq_len, turn on "
           "train.grad_checkpointing, or set memory.budget so the governor does it")
    if over_ram:
        text = (f"MLX peak memory {fb(peak)} (step {at['step']}) is above the {fb(ram)} of RAM by {fb(peak - limit)}: "
                "unified memory cannot hold it, so the OS kept the run going by compressing and swapping")
        rule = "mlx_peak_over_ram"
    else:
        text = (f"MLX peak memory {fb(peak)} (step {at['step']}) is above Metal's recommended working set "
                f"{fb(rws)} by {fb(peak - limit)}" + (f" (RAM {fb(ram)})" if ram else "")
                + ": the GPU may have to page memory")
        rule = "mlx_peak_over_working_set"
    seen = []
    if footprint is not None:
        seen.append(f"charged the process a footprint of {fb(footprint)}")
    if compressed:
        seen.append(f"held {fb(compressed)} compressed")
    if swapped_out:
        seen.append(f"swapped {fb(swapped_out)} out to disk")
    elif swap:
        seen.append(f"grew swap by {fb(swap)}")
    if seen:
        text += "; the OS " + ", ".join(seen)
    figs: dict[str, Any] = {"peak": peak, "ram": ram, "over": peak - limit,
                            "recommended_working_set": rws, "phys_footprint": footprint, "compressed": compressed,
                            "swapped_out": swapped_out, "swap_growth": swap}
    slow = [times[st] for st in sorted(swapping) if st in times]
    calm = [t for st, t in times.items() if st not in swapping and st > 2]  # steps 1-2 include warm-up
    if slow and calm:
        ms, mc = statistics.median(slow), statistics.median(calm)
        ratio = ms / mc if mc > 0 else None
        slowed = ratio is not None and ratio > 1.1
        text += (f". In the {len(slow)} step(s) where it swapped a step took {ms:.2f} s against {mc:.2f} s in the "
                 f"{len(calm)} others" + (f" ({ratio:.2f}x): training slowed" if slowed else ": training did not slow"))
        figs.update(swapping_steps_count=len(slow), step_ms_swapping=ms * 1000, step_ms_other=mc * 1000,
                    slowdown_pct=(ratio - 1) * 100 if ratio else None)
    elif swapping:
        text += f". The OS swapped in {len(swapping)} step(s)"
        figs["swapping_steps_count"] = len(swapping)
    first = min(swapping) if swapping else at["step"]
    text += f"; {_governor_said(ctx, first)}. To stay in RAM: {fix}."
    return [_ex(rule, "warning", text, **figs)]


def _cache_growth(limit: int | None) -> str:
    return ("MLX keeps freed buffers of each new size in its cache (batches of varying length need new "
            "sizes), so this is cache, not live data"
            + (f"; it can grow up to the cache limit {fb(limit)}, which memory.budget sets" if limit else "")
            + ".")


def _fragmentation(split: int | None) -> str:
    return ("MLX keeps freed buffers in its cache for reuse; mx.set_cache_limit (or memory.budget, which "
            "sets it) caps it, and mx.clear_cache returns it.")


rules.register(rule_mlx_peak_over_ram, after="rule_pressure", explains_swap=("mlx_peak_over_ram",))
rules.register_allocator_words(rules.AllocatorWords("mlx", "mlx_cache", "mlx_cache_limit", _cache_growth,
                                                    _fragmentation))
