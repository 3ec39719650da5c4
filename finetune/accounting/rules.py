"""Rules that turn memory samples into plain sentences with figures.

Each explanation is ``{"rule": id, "severity": "info" | "warning", "text": sentence,
"figures": {name: bytes}}`` (figures named ``*_count`` or ``*_pct`` are counts/percents).
The rules read only the samples (see accounting.accountant for the schema) and a small context,
so recorded samples from another machine (an H100 with paged optimizer state, a 192 GB Mac that
swapped) are explained exactly as live ones.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import finetune.backends  # noqa: F401  the registry imports each backend's rules module, which registers its own
from finetune.rulebase import (  # noqa: F401  (re-exported: the rules' shared vocabulary)
    ALLOCATOR_WORDS,
    BACKEND_RULES,
    SWAP_EXPLAINED_BY,
    AllocatorWords,
    Explanation,
    Rule,
    _ex,
    _governor_said,
    _max_of,
    _step_times,
    _swapping_steps,
    _where,
    allocator_words,
    register,
    register_allocator_words,
)
from finetune.records import CENSUS_KEYS
from finetune.units import fmt_bytes as fb
from finetune.units import fmt_delta as fd

MiB = 1 << 20
GiB = 1 << 30

DEFAULTS: dict[str, Any] = {
    # leak: a least-squares slope over the last `leak_window` optimizer-phase samples after
    # warm-up (steps 1-2 allocate lazily); flagged when steeper than this and growing in most steps
    "leak_window": 20,
    "leak_min_points": 5,
    "leak_min_bytes_per_step": 1 * MiB,  # allocator figures are exact: 1 MiB/step is real growth
    "leak_min_bytes_per_step_rss": 2 * MiB,  # RSS moves in malloc arena chunks: a coarser floor
    "leak_min_up_fraction": 0.6,
    # step 1 -> step 2 growth worth a sentence: at least this, and at least 2 % of step 1's figure
    "growth_min_bytes": 64 << 10,
    "growth_min_fraction": 0.02,
    # cache held beyond what the step peak needed, worth a sentence
    "frag_min_bytes": 256 * MiB,
    "frag_min_fraction": 0.3,
    "swap_min_bytes": 64 * MiB,  # swap growth below this is noise from other processes
    "unexplained_warn_bytes": 1 * GiB,
    "psi_full_warn_pct": 5.0,
    "psi_some_warn_pct": 20.0,
}

def _census(s: dict[str, Any], key: str) -> int | None:
    c = s.get("census") or {}
    return c.get(key)


def _opt_state(s: dict[str, Any]) -> int | None:
    c = s.get("census") or {}
    if "optimizer_state" not in c and "optimizer_state_paged" not in c:
        return None
    return (c.get("optimizer_state") or 0) + (c.get("optimizer_state_paged") or 0)


def _last_of(samples: list[dict[str, Any]], step: int, phase: str) -> dict[str, Any] | None:
    for s in reversed(samples):
        if s["step"] == step and s["phase"] == phase:
            return s
    return None


def _optimizer_series(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last optimizer-phase sample of each step, in step order (the state between steps)."""
    by_step: dict[int, dict[str, Any]] = {}
    for s in samples:
        if s["phase"] == "optimizer":
            by_step[s["step"]] = s
    return [by_step[k] for k in sorted(by_step)]


# -- rules ---------------------------------------------------------------------------------
def rule_lazy_optimizer_state(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """Optimizer state that appears at the first optimizer step rather than at load."""
    prev = None
    for s in samples:
        st = _opt_state(s)
        if st is None:
            continue
        if st > 0:
            if prev is None:
                return []  # created eagerly, before the first sample: nothing lazy to explain
            step = s["step"]
            paged = _census(s, "optimizer_state_paged") or 0
            held = _census(s, "optimizer_state") or 0
            a0, a1 = prev.get("allocated"), s.get("allocated")
            p1 = _step_peak(samples, step)
            p2 = _step_peak(samples, step + 1)
            text = (f"Optimizer state ({fb(st)}"
                    + (f", of which {fb(paged)} paged in unified memory outside the allocator" if paged else "")
                    + f") was created lazily {_where(s)}: the census shows {fb(_opt_state(prev))} {_where(prev)}")
            if a0 is not None and a1 is not None:
                text += f", and allocated went from {fb(a0)} to {fb(a1)}"
            text += ". From the next step on it is held together with weights, gradients and activations"
            if p1 is not None and p2 is not None and p2 > p1:
                text += (f", so the step peak went from {fb(p1)} (step {step}) to {fb(p2)} (step {step + 1}), "
                         f"{fd(p2 - p1)}: plan memory for the second step, not the first.")
            elif p1 is not None and p2 is not None:
                text += (f"; the step peak was {fb(p1)} in step {step} and {fb(p2)} in step {step + 1}: there the "
                         "batches' shapes weigh more than the state.")
            else:
                text += ": plan memory for the second step, not the first."
            return [_ex("lazy_optimizer_state", "info", text, optimizer_state=held, optimizer_state_paged=paged,
                        allocated_before=a0, allocated_after=a1, step_peak_first=p1, step_peak_second=p2)]
        prev = s
    return []


def _step_peak(samples: list[dict[str, Any]], step: int) -> int | None:
    s = _last_of(samples, step, "optimizer")
    if s is None or s.get("peak_scope") != "step":
        return None
    return s.get("step_peak_allocated")


def rule_step_growth(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """Locate and attribute growth between step 1 and step 2, phase by phase."""
    rows = []
    for phase in ("forward", "backward", "optimizer"):
        a, b = _last_of(samples, 1, phase), _last_of(samples, 2, phase)
        if a is None or b is None:
            continue
        dr = (b["reserved"] - a["reserved"]) if a.get("reserved") is not None and b.get("reserved") is not None else None
        da = (b["allocated"] - a["allocated"]) if a.get("allocated") is not None and b.get("allocated") is not None else None
        rows.append((phase, a, b, da, dr))
    by_r = [r for r in rows if r[4] is not None]
    by_a = [r for r in rows if r[3] is not None]
    if not by_r and not by_a:
        return []
    # reserved growth (largest jump) unless allocated grew with it; else the largest allocated jump
    # (r[4] and r[3] are never None in by_r and by_a)
    phase, a, b, da, dr = max(by_r, key=lambda r: r[4] or 0) if by_r else max(by_a, key=lambda r: r[3] or 0)
    floor = max(ctx["growth_min_bytes"], ctx["growth_min_fraction"] * ((a.get("reserved") or a.get("allocated")) or 0))
    if not (dr is not None and dr >= floor and (da is None or abs(da) < 0.25 * dr)) and by_a:
        phase, a, b, da, dr = max(by_a, key=lambda r: r[3] or 0)
        floor = max(ctx["growth_min_bytes"], ctx["growth_min_fraction"] * (a.get("allocated") or 0))
    dcen = {k: (b["census"].get(k) or 0) - (a["census"].get(k) or 0)
            for k in CENSUS_KEYS if a.get("census") and b.get("census") and k in a["census"]}
    parts = [f"{k.replace('_', ' ')} {fd(v)}" + (" (created lazily at the first optimizer step)"
                                                 if k == "optimizer_state" and (a["census"].get(k) or 0) == 0 else "")
             for k, v in dcen.items() if v]
    attributed = sum(v for k, v in dcen.items() if k != "optimizer_state_paged")
    if dr is not None and dr >= floor and (da is None or abs(da) < 0.25 * dr):
        text = (f"Reserved grew by {fb(dr)} between step 1 and step 2 (at the {phase} phase) while allocated "
                f"changed by only {fd(da) if da is not None else 'an unknown amount'}: the caching allocator keeps "
                "blocks freed during step 1 (activations, temporaries) for reuse instead of returning them, "
                "so this is cache, not new live data")
        if parts:
            text += "; the census changed by " + ", ".join(parts)
        return [_ex("reserved_growth_step2", "info", text + ".", reserved_delta=dr, allocated_delta=da,
                    **{k + "_delta": v for k, v in dcen.items() if v})]
    if da is not None and da >= floor:
        text = f"Allocated grew by {fb(da)} between step 1 and step 2 at the {phase} phase"
        if parts:
            text += ": " + ", ".join(parts) + f"; unattributed {fd(da - attributed)}"
        else:
            text += ", with no change in the census (activations or buffers kept across steps)"
        if dr is not None:
            text += f" (reserved {fd(dr)})"
        return [_ex("allocated_growth_step2", "info", text + ".", allocated_delta=da, reserved_delta=dr,
                    unattributed=da - attributed, **{k + "_delta": v for k, v in dcen.items() if v})]
    return []


def _fit(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def rule_leak(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """Allocated (or RSS, where no allocator is measured) growing step after step."""
    series = [s for s in _optimizer_series(samples) if s["step"] > 2]  # steps 1-2: lazy allocations
    if not series:
        return []
    key, floor, what = "allocated", ctx["leak_min_bytes_per_step"], "allocated"
    if any(s.get("allocated") is None for s in series):
        key, floor, what = "rss", ctx["leak_min_bytes_per_step_rss"], "RSS"
        # only fresh readings: between them a sample repeats the last one (Accountant io_budget)
        series = [s for s in series if s.get("system_fresh", True)]
    pts = [(s["step"], s[key]) for s in series if s.get(key) is not None][-ctx["leak_window"]:]
    if len(pts) < ctx["leak_min_points"]:
        return []
    xs, ys = [float(p[0]) for p in pts], [float(p[1]) for p in pts]
    slope = _fit(xs, ys)  # bytes per step
    diffs = [b - a for a, b in pairwise(ys)]
    up = sum(d > 0 for d in diffs) / len(diffs)
    total = ys[-1] - ys[0]
    if slope < floor or up < ctx["leak_min_up_fraction"] or total < 0.5 * slope * (xs[-1] - xs[0]):
        return []
    text = (f"{what} keeps growing after each optimizer step: {fd(slope)} per step (linear fit over steps "
            f"{pts[0][0]}-{pts[-1][0]}), {fd(total)} in total, up in {up:.0%} of steps. Something keeps "
            "memory alive across steps (a leak): e.g. a loss or output tensor appended to a list, "
            "a growing cache, or a graph kept by a tensor that was not detached.")
    return [_ex("leak", "warning", text, bytes_per_step=slope, growth=total, first=ys[0], last=ys[-1])]


def rule_cache_growth(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """Reserved growing step after step while allocated stays flat: the allocator's cache
    collects blocks of new sizes (e.g. variable sequence lengths), not a leak of live data."""
    pts = [s for s in _optimizer_series(samples) if s["step"] > 2
           and s.get("reserved") is not None and s.get("allocated") is not None][-ctx["leak_window"]:]
    if len(pts) < ctx["leak_min_points"]:
        return []
    xs = [float(s["step"]) for s in pts]
    rs, al = [float(s["reserved"]) for s in pts], [float(s["allocated"]) for s in pts]
    slope_r, slope_a = _fit(xs, rs), _fit(xs, al)
    up = sum(b > a for a, b in pairwise(rs)) / (len(rs) - 1)
    if slope_r < ctx["leak_min_bytes_per_step"] or up < 0.5 or slope_a > 0.25 * slope_r:
        return []
    last = pts[-1]
    words = allocator_words(last)
    limit = last.get(words.cache_limit_key) if words.cache_limit_key else None
    text = (f"Reserved grows by {fd(slope_r)} per step (linear fit over steps {pts[0]['step']}-{last['step']}, "
            f"now {fb(last['reserved'])}) while allocated stays near {fb(last['allocated'])} "
            f"({fd(slope_a)} per step): ")
    text += words.cache_growth(limit)
    return [_ex("cache_growth", "info", text, reserved_bytes_per_step=slope_r, allocated_bytes_per_step=slope_a,
                reserved=last["reserved"], allocated=last["allocated"], cache_limit=limit)]


def rule_fragmentation(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """Reserved far above both allocated and what the step's peak needed."""
    series = _optimizer_series(samples) or samples
    s = series[-1] if series else None
    if s is None or s.get("reserved") is None or s.get("allocated") is None:
        return []
    res, al = s["reserved"], s["allocated"]
    peak = s.get("step_peak_allocated") if s.get("peak_scope") == "step" else None
    need = max(al, peak or 0)
    excess = res - need
    if excess < max(ctx["frag_min_bytes"], ctx["frag_min_fraction"] * res):
        return []
    split = s.get("inactive_split")
    text = (f"Reserved {fb(res)} is {fb(res - al)} above allocated {fb(al)} {_where(s)}"
            + (f" and {fb(excess)} above the step peak {fb(peak)}" if peak else "") + ": ")
    text += allocator_words(s).fragmentation(split)
    sev = "warning" if split and split > max(ctx["frag_min_bytes"], 0.1 * res) else "info"
    return [_ex("fragmentation", sev, text, reserved=res, allocated=al, step_peak_allocated=peak,
                excess_over_peak=excess, inactive_split=split)]


def rule_swap(samples: list[dict[str, Any]], ctx: dict[str, Any], skip: bool = False) -> list[Explanation]:
    """System swap that grew during the run; peak RSS above physical memory."""
    g, at = _max_of(samples, "swap_growth")
    if g is None or at is None or g < ctx["swap_min_bytes"] or skip:
        return []
    first = next(s for s in samples if (s.get("swap_growth") or 0) >= ctx["swap_min_bytes"])
    ram = ctx.get("system_total") or at.get("system_total")
    prss = _max_of(samples, "peak_rss")[0]
    pswap = _max_of(samples, "swap_process")[0]
    text = f"System swap grew by {fb(g)} during the run (first {_where(first)})"
    figs: dict[str, Any] = {"swap_growth": g, "swap_process": pswap, "ram": ram, "peak_rss": prss}
    if prss is not None and ram and prss > ram:
        text += f" and this process's peak RSS {fb(prss)} exceeded the {fb(ram)} of physical memory by {fb(prss - ram)}"
        figs["over"] = prss - ram
    if pswap:
        text += f"; {fb(pswap)} of this process is in swap"
    text += ": the OS moved memory pages to disk, so expect slow steps."
    return [_ex("swap_growth", "warning", text, **figs)]


def rule_pressure(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """Memory pressure: Linux PSI (share of time tasks stalled on memory) or the macOS level."""
    full, at_f = _max_of(samples, "psi_full_avg10")
    some, at_s = _max_of(samples, "psi_some_avg10")
    lvl, at_l = _max_of(samples, "pressure_level")
    if full is not None and full >= ctx["psi_full_warn_pct"] and at_f is not None:
        return [_ex("memory_pressure", "warning",
                    f"Memory pressure: all tasks were stalled on memory {full:.1f}% of a 10 s window {_where(at_f)} "
                    "(Linux PSI full avg10): the system is reclaiming or swapping, so expect slow steps.",
                    psi_full_avg10_pct=full)]
    if some is not None and some >= ctx["psi_some_warn_pct"] and at_s is not None:
        return [_ex("memory_pressure", "warning",
                    f"Memory pressure: some task was stalled on memory {some:.1f}% of a 10 s window {_where(at_s)} "
                    "(Linux PSI some avg10).", psi_some_avg10_pct=some)]
    if lvl is not None and lvl >= 2 and at_l is not None:
        name = "critical" if lvl >= 4 else "warn"
        return [_ex("memory_pressure", "warning",
                    f"macOS reported memory pressure '{name}' {_where(at_l)}: it is compressing and swapping memory, "
                    "so expect slow steps.", pressure_level_count=lvl)]
    return []


def rule_census_mismatch(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """The census claims more than the allocator holds: a category is counted twice or is
    not allocator-held (a backend accounting error worth fixing)."""
    worst = None
    for s in samples:
        ao, al = _census(s, "activations_and_other"), s.get("allocated")
        if ao is None or al is None:
            continue
        if ao < -max(MiB, 0.02 * al) and (worst is None or ao < worst[0]):
            worst = (ao, s)
    if worst is None:
        return []
    ao, s = worst
    return [_ex("census_mismatch", "warning",
                f"The census adds up to {fb(-ao)} more than allocated {fb(s['allocated'])} {_where(s)}: some category "
                "is counted twice (e.g. tied weights) or lives outside the allocator.",
                allocated=s["allocated"], census_excess=-ao)]


def rule_peak(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """Where the highest step peak was, with the census of that step's backward phase."""
    best = None
    for s in samples:
        p = s.get("step_peak_allocated") if s.get("peak_scope") == "step" else None
        if p is not None and (best is None or p > best[0]):
            best = (p, s)
    if best is None:
        return []
    p, s = best
    ref = _last_of(samples, s["step"], "backward") or s
    c = ref.get("census") or {}
    parts = [f"{k.replace('_', ' ')} {fb(v)}" for k, v in c.items() if v]
    text = f"The highest step peak of allocated memory was {fb(p)} in step {s['step']}"
    if parts:
        text += f"; {_where(ref)} allocated was {fb(ref.get('allocated'))}: " + ", ".join(parts)
    return [_ex("peak", "info", text + ".", step_peak_allocated=p,
                **{k: v for k, v in c.items() if v is not None})]


SHARED_RULES: list[Rule] = [
    rule_peak, rule_lazy_optimizer_state, rule_step_growth, rule_leak, rule_cache_growth, rule_fragmentation,
    rule_census_mismatch, rule_pressure,
]


def rules_in_order() -> list[Rule]:
    """The shared rules, each backend's registered rules right after the shared one it names."""
    out = list(SHARED_RULES)
    for rule, after in BACKEND_RULES:
        out.insert(next(i for i, r in enumerate(out) if r.__name__ == after) + 1, rule)
    return out


def explain(samples: list[dict[str, Any]], context: dict[str, Any] | None = None) -> list[Explanation]:
    """Explain a timeline of samples in plain sentences.

    Args:
        samples: samples as Accountant.sample returns them (live or read back from a file).
        context: run facts and thresholds overriding DEFAULTS, e.g. {"system_total": bytes}.

    Returns:
        Explanations, most specific first: [{"rule", "severity", "text", "figures"}].
    """
    ctx = {**DEFAULTS, **(context or {})}
    samples = [s for s in samples if s]
    if not samples:
        return []
    out: list[Explanation] = []
    for rule in rules_in_order():
        out.extend(rule(samples, ctx))
    out.extend(rule_swap(samples, ctx, skip=any(e["rule"] in SWAP_EXPLAINED_BY for e in out)))
    return out
