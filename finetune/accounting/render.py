"""Printed and drawn views of the timeline: the end-of-run table and memory.png.

Text uses binary units (GiB = 2^30 bytes) and says so; matplotlib is imported only when a
plot is written, through its object API with the Agg canvas (no pyplot global state).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from finetune.io import umask_mode
from finetune.records import SampleCensusKey
from finetune.units import fmt_bytes as fb
from finetune.units import fmt_delta as fd

TABLE_COLUMNS = (
    ("allocated", "allocated"), ("reserved", "reserved"), ("peak_allocated", "peak alloc"),
    ("peak_reserved", "peak resv"), ("device_used", "NVML used"), ("device_total", "NVML total"),
    ("non_allocator", "non-alloc"), ("non_allocator_unexplained", "unexplained"),
)
# the census's stacking order in memory.png, bottom up
CENSUS_ORDER: tuple[SampleCensusKey, ...] = ("frozen_weights", "quant_buffers", "trainable_weights", "grads",
                                             "optimizer_state", "activations_and_other", "optimizer_state_paged")


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
    return [fmt(header), *(fmt(r) for r in rows)]


def _device_grid(rows: list[list[Any]], unmeasured_why: str) -> list[str]:
    """The device rows with only the columns something measured; a grid nobody could fill
    collapses into one line saying why, and the dropped columns are named."""
    measured = [j for j, _ in enumerate(TABLE_COLUMNS) if any(r[j + 1] is not None for r in rows)]
    if not measured:
        return [unmeasured_why]
    header = ["", *(TABLE_COLUMNS[j][1] for j in measured)]
    out = _grid(header, [[r[0], *(fb(r[j + 1]) for j in measured)] for r in rows])
    dropped = [label for j, (_, label) in enumerate(TABLE_COLUMNS) if j not in measured]
    if dropped:
        out.append(f"not measurable here: {', '.join(dropped)}")
    return out


def render_table(samples: list[dict[str, Any]], run_peak: dict[str, int | None] | None = None,
                 dev_peak: dict[int, dict[str, int | None]] | None = None,
                 sampling_seconds: float | None = None, device: str = "this device") -> str:
    """The end-of-run table, leading with what was measured here: a row per device and an
    Overall row (allocator columns beside NVML's, only the columns measured), then the
    breakdown of the non-allocator gap, the census and process/system figures. Where no
    allocator figure exists (the cuda backend on a CPU) the census and process lines lead and
    the device rows collapse into one line saying why.

    Args:
        samples: the timeline; the last sample gives the current figures.
        run_peak: run peaks {"allocated", "reserved"} (else the last sample's peak_* fields).
        dev_peak: per device index {"allocated", "reserved"} run peaks.
        sampling_seconds: total time spent sampling, reported on the last line.
        device: what ran, in words (``device_title``), for the line that says what is unmeasured.
    """
    if not samples:
        return "memory: no samples were taken (memory.sample_every=0 turns sampling off)"
    s = samples[-1]
    run_peak = run_peak or {"allocated": s.get("peak_allocated"), "reserved": s.get("peak_reserved")}
    dev_peak = dev_peak or {}
    rows: list[list[Any]] = []
    for d in s.get("devices") or []:
        pk = dev_peak.get(d["index"], {})
        vals = {**d, "peak_allocated": pk.get("allocated", d.get("peak_allocated")),
                "peak_reserved": pk.get("reserved", d.get("peak_reserved"))}
        rows.append([f"Device {d['index']}", *(vals.get(k) for k, _ in TABLE_COLUMNS)])
    overall = {**s, "peak_allocated": run_peak.get("allocated"), "peak_reserved": run_peak.get("reserved")}
    rows.append(["Overall", *(overall.get(k) for k, _ in TABLE_COLUMNS)])
    where = "after load" if s["phase"] == "load" else f"step {s['step']}, {s['phase']} phase"
    grid = _device_grid(rows, f"no allocator figures for the {device}: the census and process figures "
                              "above are what was measured")
    lines = [f"Memory at the end ({where}); peaks over the whole run. GiB = 2^30 bytes."]
    figures: list[str] = []
    if s.get("non_allocator") is not None:
        figures.append(
            f"non-allocator (NVML used - reserved) {fb(s['non_allocator'])} = paged optimizer state "
            f"{fb(s.get('paged_optimizer_state'))} + CUDA context {fb(s.get('cuda_context'))} + other processes "
            f"{fb(s.get('other_processes_used'))} + unexplained {fb(s.get('non_allocator_unexplained'))}")
    c = s.get("census") or {}
    if c:
        figures.append("census: " + " | ".join(f"{k.replace('_', ' ')} {fb(c.get(k))}" for k in CENSUS_ORDER
                                               if k in c and c.get(k) is not None)
                       + (f" (taken at step {s['census_step']})" if s.get("census_step") not in (None, s["step"]) else ""))
    figures.append(
        f"process: RSS {fb(s.get('rss'))}, peak RSS {fb(s.get('peak_rss'))}, in swap {fb(s.get('swap_process'))} | "
        f"system: swap used {fb(s.get('swap_used'))} of {fb(s.get('swap_total'))} ({fd(s.get('swap_growth'))} this run), "
        f"RAM available {fb(s.get('system_available'))} of {fb(s.get('system_total'))}"
        + (f" | PSI some/full {s['psi_some_avg10']:.1f}%/{s['psi_full_avg10'] or 0:.1f}%"
           if s.get("psi_some_avg10") is not None else "")
        + (f" | pressure level {s['pressure_level']}" if s.get("pressure_level") is not None else ""))
    if any(s.get(k) is not None for k in ("phys_footprint", "compressed", "swapped_out", "major_faults")):
        first = next((x for x in samples if x.get("swapped_out") is not None), None)
        out = (s["swapped_out"] - first["swapped_out"]) if first is not None and s.get("swapped_out") is not None else None
        mf0 = next((x["major_faults"] for x in samples if x.get("major_faults") is not None), None)
        parts = [f"process footprint {fb(s['phys_footprint'])}" if s.get("phys_footprint") is not None else None,
                 f"compressed {fb(s.get('compressed'))}" if s.get("compressed") is not None else None,
                 f"swapped out this run {fb(out)}" if out is not None else None,
                 f"this process's major faults this run {s['major_faults'] - mf0}"
                 if s.get("major_faults") is not None and mf0 is not None else None]
        if any(parts):
            figures.append("OS: " + ", ".join(p for p in parts if p))
    if any(k.startswith("mlx_") for k in s):
        figures.append(
            f"mlx: active {fb(s.get('mlx_active'))}, cache {fb(s.get('mlx_cache'))}, peak {fb(s.get('mlx_peak'))} | "
            f"limits: memory {fb(s.get('mlx_memory_limit'))}, cache {fb(s.get('mlx_cache_limit'))}, wired "
            f"{fb(s.get('mlx_wired_limit'))}, recommended working set {fb(s.get('mlx_recommended_working_set'))}")
    if any(s.get(k) is not None for k in ("inactive_split", "alloc_retries", "num_ooms")):
        r, o = s.get("alloc_retries"), s.get("num_ooms")
        figures.append(f"allocator health: inactive split {fb(s.get('inactive_split'))}, alloc retries "
                       f"{'n/a' if r is None else r}, OOMs {'n/a' if o is None else o}")
    measured_grid = len(grid) > 1 or grid[0] != grid[-1] or not grid[0].startswith("no allocator")
    lines += [*grid, *figures] if measured_grid else [*figures, *grid]
    if sampling_seconds is not None:
        lines.append(f"accounting: {len(samples)} samples, {sampling_seconds * 1e6 / len(samples):.0f} us per sample")
    return "\n".join(lines)


def render_gather_table(gathered: dict[str, Any]) -> str:
    """Table of a gather() result: a row per rank, then Overall (sum), min and max over ranks."""
    header = ["", *(label for _, label in TABLE_COLUMNS), "RSS"]
    keys = [k for k, _ in TABLE_COLUMNS] + ["rss"]
    rows = [[f"Rank {r.get('rank', i)}", *(fb(r.get(k)) for k in keys)] for i, r in enumerate(gathered["ranks"])]
    ov = gathered["overall"]
    for stat, label in (("sum", "Overall"), ("min", "min"), ("max", "max")):
        rows.append([label, *(fb((ov.get(k) or {}).get(stat)) for k in keys)])
    return "\n".join(_grid(header, rows))


# -- plot ----------------------------------------------------------------------------------
def unit_for(vmax: float) -> tuple[float, str]:
    """(bytes per unit, its name): the largest binary unit ``vmax`` reaches (B below 1 KiB)."""
    for size, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if vmax >= size:
            return float(size), name
    return 1.0, "B"


PHASE_COLORS = {"load": "#7f7f7f", "forward": "#1f77b4", "backward": "#ff7f0e", "optimizer": "#2ca02c"}
CENSUS_COLORS: dict[SampleCensusKey, str] = {
    "frozen_weights": "#c7c7c7", "quant_buffers": "#9edae5", "trainable_weights": "#aec7e8", "grads": "#ffbb78",
    "optimizer_state": "#98df8a", "activations_and_other": "#f7b6d2", "optimizer_state_paged": "#dbdb8d"}
LINES = (("allocated", "allocated", "black", "-"), ("reserved", "reserved", "#444444", "--"),
         ("step_peak_allocated", "step peak allocated", "#d62728", ":"),
         ("device_used", "NVML device used", "#9467bd", "-"))
HOST_LINES = (("rss", "process RSS", "#17becf", "-"), ("peak_rss", "process peak RSS", "#17becf", ":"),
              ("swap_growth", "system swap growth since start", "#8c564b", "-."),
              ("swap_process", "process in swap", "#e377c2", "--"),
              ("phys_footprint", "process footprint (macOS)", "#1f3b73", "-"),
              ("compressed", "system compressed", "#bcbd22", "--"))
_ACTION_LABEL = {"lower_micro_batch": "micro-batch {b[batch_size]}->{a[batch_size]}",
                 "enable_grad_checkpointing": "grad checkpointing on", "release_cache": "cache released",
                 "enable_loss_chunk": "loss in chunks of {a[loss_chunk]}",
                 "set_mlx_cache_limit": "cache limit {a_cache_limit}", "set_mlx_limits": "mlx limits"}


def _lines(ax: Any, samples: list[dict[str, Any]], spec: tuple, scale: float) -> None:
    n = len(samples)
    for key, label, color, style in spec:
        pts = [(i, s[key] / scale) for i, s in enumerate(samples) if s.get(key) is not None
               and (key != "step_peak_allocated" or s.get("peak_scope") == "step")]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, lw=1.6, label=label,
                    marker="." if n <= 80 else None, ms=4)


def _ylabel(ax: Any, what: str, unit: str) -> None:
    ax.set_ylabel(f"{what}, {unit}\n({unit} = 2^{ {'GiB': 30, 'MiB': 20, 'KiB': 10}.get(unit, 0)} bytes)", fontsize=9)


def _event_label(ev: dict[str, Any]) -> str:
    b, a = ev.get("before") or {}, ev.get("after") or {}
    tpl = _ACTION_LABEL.get(ev.get("action", ""), ev.get("action", "?"))
    try:
        return tpl.format(b=b, a=a, a_cache_limit=fb(a.get("cache_limit")))
    except (KeyError, IndexError):
        return str(ev.get("action"))


def device_title(backend: str, samples: list[dict[str, Any]], rank: int = 0, world: int = 1) -> str:
    """What ran, in words, for a chart's title: "cuda backend on GPU", "cuda backend on CPU",
    "mlx on Apple GPU", "mlx on CPU" (from what the samples measured), with the rank where
    several ran."""
    last = samples[-1] if samples else {}
    if any(k.startswith("mlx_") for k in last):  # unified memory: Metal's working set is known on a GPU
        gpu = any(s.get("mlx_recommended_working_set") for s in samples)
        where = f"{backend} on Apple GPU" if gpu else f"{backend} on CPU"
    else:  # a device row with allocator figures is a GPU's
        n = max((sum(d.get("allocated") is not None for d in s.get("devices") or []) for s in samples), default=0)
        where = f"{backend} backend on {n} GPUs" if n > 1 else f"{backend} backend on {'GPU' if n else 'CPU'}"
    if world > 1:
        where += f", rank {rank} of {world}"
    return where


def _wrap(text: str, width: int = 44) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


def _legend_label(label: str, values: list[float]) -> str:
    """A line's legend entry says why where it shows nothing (all zero) or little."""
    if values and not any(values):
        return f"{label} (0 B throughout)"
    return label


def write_plot(samples: list[dict[str, Any]], path: str | Path, title: str = "memory",
               budget: int | None = None, events: list[dict[str, Any]] | None = None,
               phase_every: int = 1) -> None:
    """Write ``draw_plot``'s figure to ``path`` (a temporary name, then renamed into place)."""
    save_png(draw_plot(samples, title, budget, events, phase_every), path)


def _allocator_panel(ax: Any, samples: list[dict[str, Any]], budget: int | None) -> list[str]:
    """The top panel: the census as stacked areas under the allocator's and NVML's lines, and
    the budget where it is near the figures. Returns the legend's notes on what it cannot show."""
    n = len(samples)
    notes: list[str] = []
    vals: list[float] = []
    for key, *_ in LINES:
        vals += [s[key] for s in samples if s.get(key) is not None]
    stack_keys = [k for k in CENSUS_ORDER if any((s.get("census") or {}).get(k) for s in samples)]
    stacks = [[max(0, (s.get("census") or {}).get(k) or 0) for s in samples] for k in stack_keys]
    if stacks:
        vals.append(max(sum(col) for col in zip(*stacks)))
    top = max(vals) if vals else 0
    # the budget joins the scale only when it is near the figures: a 24 GiB budget over a
    # 300 MiB run would flatten everything, so it is then named instead of drawn
    draw_budget = budget is not None and (not top or budget <= 3 * top)
    scale, unit = unit_for(max(top, budget if draw_budget and budget else 0))
    if stacks and n:
        ax.stackplot(list(range(n)), *[[v / scale for v in row] for row in stacks],
                     labels=[f"census: {k.replace('_', ' ')}" for k in stack_keys],
                     colors=[CENSUS_COLORS[k] for k in stack_keys], alpha=0.9)
    _lines(ax, samples, LINES, scale)
    if budget is not None and draw_budget:
        ax.axhline(budget / scale, color="#d62728", lw=1.2, ls="-", alpha=0.7, label=f"memory budget {fb(budget)}")
    elif budget is not None:
        notes.append(f"memory budget {fb(budget)}: above the chart's scale, not drawn")
    if not any(s.get("allocated") is not None for s in samples):
        notes.append("no allocator figures on this device: the census (what the tensors hold) only"
                     if stacks else "no allocator figures on this device")
    _ylabel(ax, "allocator / device", unit)
    return notes


def _host_panel(hax: Any, samples: list[dict[str, Any]]) -> None:
    """The middle panel: host memory (RSS, peak RSS, swap growth, process swap) in its own unit."""
    hvals = [s[k] for k, *_ in HOST_LINES for s in samples if s.get(k) is not None]
    hscale, hunit = unit_for(max(hvals) if hvals else 0)
    _lines(hax, samples, HOST_LINES, hscale)
    _ylabel(hax, "host", hunit)


def _step_starts(samples: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(sample index, step) of the first sample of each step."""
    firsts: list[tuple[int, int]] = []
    for i, s in enumerate(samples):
        if i == 0 or s["step"] != samples[i - 1]["step"]:
            firsts.append((i, s["step"]))
    return firsts


def _mark_events(ax: Any, hax: Any, events: list[dict[str, Any]] | None, firsts: list[tuple[int, int]],
                 n: int) -> tuple[bool, list[tuple[Any, str]]]:
    """Governor actions: a numbered dashed line each at its step's first sample; the numbers
    above the chart (one where several crowd together), the words in the legend. Returns
    whether any number was drawn and the legend's (handle, label) of each action."""
    from matplotlib.lines import Line2D

    marks: dict[float, list[int]] = {}
    event_handles = []
    for k, ev in enumerate(events or [], start=1):
        at = next((i for i, st in firsts if st >= ev.get("step", 0)), None)
        if at is None:
            continue
        x = at - 0.5 if at else 0
        for a in (ax, hax):
            a.axvline(x, color="#d62728", lw=1.0, ls="--", alpha=0.8, zorder=3)
        marks.setdefault(x, []).append(k)
        event_handles.append((Line2D([], [], color="#d62728", ls="--", lw=1.0),
                              _wrap(f"{k}: step {ev.get('step')}, {_event_label(ev)} ({ev.get('trigger')})")))
    placed: list[float] = []
    for x, ks in sorted(marks.items()):
        if any(abs(x - p) < max(n, 1) / 40 for p in placed):
            continue  # too close to the last number: its legend entry still names the step
        placed.append(x)
        ax.annotate(",".join(map(str, ks)), (x, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=7, color="#d62728")
    return bool(marks), event_handles


def _step_axis(ax: Any, hax: Any, strip: Any, samples: list[dict[str, Any]], firsts: list[tuple[int, int]]) -> None:
    """The shared x axis: step labels (at most about 15) under the phase strip, a bar per
    sample coloured by its phase."""
    n = len(samples)
    every = max(1, len(firsts) // 15)
    ticks = firsts[::every]
    for a in (ax, hax):
        a.set_xticks([i for i, _ in ticks])
        a.set_xticklabels([])
    strip.set_xticks([i for i, _ in ticks])
    strip.set_xticklabels(["load" if st == 0 else str(st) for _, st in ticks], fontsize=8)
    strip.set_xlabel("step (each step's samples in phase order; strip: phase of each sample)")
    strip.bar(list(range(n)), [1] * n, width=1.0, color=[PHASE_COLORS.get(s["phase"], "#dddddd") for s in samples])
    strip.set_xlim(ax.get_xlim())
    strip.set_yticks([])


def _main_legend(ax: Any, samples: list[dict[str, Any]], notes: list[str],
                 event_handles: list[tuple[Any, str]], phase_every: int) -> None:
    """The top panel's legend, beside the chart: its lines and areas, the phases present, each
    governor action, then the notes (what the chart cannot show, a sparse phase band)."""
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels()
    present = {s["phase"] for s in samples}
    for ph, col in PHASE_COLORS.items():
        if ph in present:
            handles.append(Patch(color=col))
            labels.append(f"phase: {ph}")
    last_step = max((s["step"] for s in samples), default=0)
    if phase_every > 1 and last_step > 2 and {"forward", "backward"} & present:
        notes.append(f"forward/backward sampled on steps 1, 2 and every {phase_every}th step after "
                     "(memory.phase_every); the other steps show their optimizer phase only")
    for h, label in event_handles:
        handles.append(h)
        labels.append(label)
    for note in notes:
        handles.append(Patch(color="none"))
        labels.append(_wrap("note: " + note))
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _host_legend(hax: Any, samples: list[dict[str, Any]]) -> None:
    """The host panel's legend; a line that stays at zero says so."""
    hh, hl = hax.get_legend_handles_labels()
    if hh:
        hl = [_legend_label(lab, [s.get(key) or 0 for s in samples if s.get(key) is not None])
              for lab, (key, *_) in zip(hl, [spec for spec in HOST_LINES
                                             if any(s.get(spec[0]) is not None for s in samples)])]
        hax.legend(hh, hl, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def draw_plot(samples: list[dict[str, Any]], title: str = "memory", budget: int | None = None,
              events: list[dict[str, Any]] | None = None, phase_every: int = 1) -> Any:
    """The memory.png figure (11 x 7 in at 110 dpi), a PNG timeline. Top: the census as stacked areas (allocator-held categories,
    then paged optimizer state, which lives outside the allocator) under lines for allocated,
    reserved, the step peak and NVML used. Middle: host memory (RSS, peak RSS, swap growth,
    process swap). Bottom strip: the phase of each sample.

    No text is drawn inside a plotting area: what the chart cannot show (no allocator here, a
    budget above the scale, sparse phase samples) is said in the legend's notes, governor
    actions are numbered above the chart and described in the legend, and every legend entry
    has data or says why it has none.

    Args:
        samples: the timeline.
        title: figure title (name what ran: ``device_title``).
        budget: the run's memory budget in bytes (drawn as a line), None where it has none.
        events: governor actions ({step, trigger, action, before, after}), each marked at its step.
        phase_every: memory.phase_every: forward/backward were sampled on every N-th step after step 2.

    Returns:
        The matplotlib Figure (Agg canvas).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(samples)
    fig = Figure(figsize=(11, 7), dpi=110)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(3, 1, height_ratios=[10, 4, 0.8], hspace=0.12)
    ax, hax, strip = fig.add_subplot(gs[0]), fig.add_subplot(gs[1]), fig.add_subplot(gs[2])
    notes = _allocator_panel(ax, samples, budget)
    _host_panel(hax, samples)
    for a in (ax, hax):
        a.set_ylim(bottom=0)
        a.set_xlim(-0.5, max(n - 0.5, 0.5))
        a.grid(alpha=0.3)
    firsts = _step_starts(samples)
    if len(firsts) <= 60:  # step boundaries, where they stay apart
        for i, _ in firsts[1:]:
            for a in (ax, hax):
                a.axvline(i - 0.5, color="#bbbbbb", lw=0.6, zorder=0)
    numbered, event_handles = _mark_events(ax, hax, events, firsts, n)
    ax.set_title(title, pad=14 if numbered else 6)
    _step_axis(ax, hax, strip, samples, firsts)
    _main_legend(ax, samples, notes, event_handles, phase_every)
    _host_legend(hax, samples)
    fig.subplots_adjust(left=0.09, right=0.70, top=0.93, bottom=0.08)
    return fig


def save_png(fig: Any, path: str | Path, dpi: float | None = None) -> None:
    """Write a matplotlib figure to ``path`` under a temporary name, then rename it into place
    (a chart is never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd_, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".png", dir=path.parent)
    os.close(fd_)
    try:
        fig.savefig(tmp, format="png", dpi=dpi or fig.dpi)
        os.chmod(tmp, umask_mode())  # mkstemp made it 0600: a chart is as readable as any file the run writes
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def render_summary_table(memory: dict[str, Any], device: str = "run's device") -> str:
    """The end-of-run table rebuilt from a summary.json ``memory`` section (for reports on
    finished runs), leading with what was measured: a row per device and Overall (measured
    columns only), then the non-allocator breakdown and census; where no allocator was
    measured, the census and process lines first and one line saying so."""
    last = memory.get("last") or {}
    peaks = memory.get("peaks") or {}
    rows: list[list[Any]] = []
    for d in memory.get("devices") or []:
        rows.append([f"Device {d.get('index', '?')}", *(d.get(k + "_bytes") for k, _ in TABLE_COLUMNS)])
    ov = {k: last.get(k + "_bytes") for k, _ in TABLE_COLUMNS}
    ov["peak_allocated"], ov["peak_reserved"] = peaks.get("allocated_bytes"), peaks.get("reserved_bytes")
    rows.append(["Overall", *(ov.get(k) for k, _ in TABLE_COLUMNS)])
    grid = _device_grid(rows, f"no allocator figures for the {device}: the census and process figures above "
                              "are what was measured")
    figures: list[str] = []
    if last.get("non_allocator_bytes") is not None:
        figures.append(
            f"non-allocator (NVML used - reserved) {fb(last['non_allocator_bytes'])} = paged optimizer state "
            f"{fb(last.get('paged_optimizer_state_bytes'))} + CUDA context {fb(last.get('cuda_context_bytes'))} + "
            f"other processes {fb(last.get('other_processes_used_bytes'))} + unexplained "
            f"{fb(last.get('non_allocator_unexplained_bytes'))}")
    cen = {k[len("census_"):-len("_bytes")]: v for k, v in last.items() if k.startswith("census_")}
    if cen:
        figures.append("census: " + " | ".join(f"{k.replace('_', ' ')} {fb(cen.get(k))}" for k in CENSUS_ORDER
                                               if k in cen and cen.get(k) is not None))
    figures.append(f"process: RSS {fb(last.get('rss_bytes'))}, peak RSS {fb(peaks.get('rss_bytes'))} | swap growth "
                   f"{fd(peaks.get('swap_growth_bytes'))}")
    head = (f"Memory at step {last.get('memory_step')} ({last.get('memory_phase')} phase); peaks over the run. "
            "GiB = 2^30 bytes")
    measured_grid = not (len(grid) == 1 and grid[0].startswith("no allocator"))
    return "\n".join([head, *grid, *figures] if measured_grid else [head, *figures, *grid])
