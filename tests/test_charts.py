"""Every chart the project draws, checked as a picture at the size it is written, from recorded
timelines (tests/data/timelines/, made by scripts/record_timelines.py from real runs; the GPU one
rebuilt from the H200 run's recorded figures): no text box intersects another, no text sits
inside a plotting area (where it would cover data) or outside the figure, the title names what
ran, and every legend entry has data or is a note. Then the end-of-run table's first lines."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import pytest

from finetune.accounting.render import device_title, draw_plot, render_summary_table, render_table

TIMELINES = Path(__file__).resolve().parent / "data" / "timelines"

# recorded run -> the words its title must carry
RUNS = {"cuda_cpu": "cuda backend on CPU", "mlx_cpu": "mlx on CPU", "governor": "mlx on CPU",
        "two_rank": "cuda backend on CPU, rank 0 of 2", "h200": "cuda backend on GPU"}


def load(name: str) -> dict:
    return json.loads((TIMELINES / f"{name}.json").read_text())


def texts(fig):
    """Every visible, non-empty text of a drawn figure with its window extent (pixels)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    hidden = set()  # tick labels of ticks outside the view limits: matplotlib does not draw them
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = min(lo, hi), max(lo, hi)
            for tick in axis.get_major_ticks():
                if not lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    hidden |= {id(tick.label1), id(tick.label2)}
    out = []
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and t.figure is fig and id(t) not in hidden:
            out.append((t, t.get_window_extent(r)))
    return out, r


def check_layout(fig) -> None:
    from matplotlib.axis import Tick

    found, r = texts(fig)
    W, H = fig.bbox.width, fig.bbox.height
    for t, bb in found:  # inside the figure: nothing cut off
        assert bb.x0 >= -1 and bb.y0 >= -1 and bb.x1 <= W + 1 and bb.y1 <= H + 1, (t.get_text(), bb)
    for (a, ba), (b, bb) in combinations(found, 2):  # no two texts over each other
        overlap_w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
        overlap_h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
        assert overlap_w <= 1 or overlap_h <= 1, (a.get_text(), b.get_text())
    ticks = {id(x) for ax in fig.axes for tk in ax.xaxis.get_major_ticks() + ax.yaxis.get_major_ticks()
             if isinstance(tk, Tick) for x in (tk.label1, tk.label2)}
    for ax in fig.axes:  # no text inside a plotting area, where it would cover the data
        area = ax.get_window_extent(r)
        for t, bb in found:
            if id(t) in ticks:
                continue
            inside_w = min(area.x1, bb.x1) - max(area.x0, bb.x0)
            inside_h = min(area.y1, bb.y1) - max(area.y0, bb.y0)
            assert inside_w <= 1 or inside_h <= 1, (t.get_text(), "inside a plot")


def check_legends(fig) -> None:
    """Every legend entry has data drawn under its label, or is a note saying why not."""
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is None:
            continue
        drawn = {}
        for line in ax.get_lines():
            drawn[line.get_label()] = len(line.get_xdata()) > 0
        for coll in ax.collections:
            drawn[coll.get_label()] = len(coll.get_paths()) > 0 or len(getattr(coll, "get_offsets")()) > 0
        for cont in ax.containers:
            drawn[cont.get_label()] = any(p.get_height() > 0 for p in cont.patches)
        for text in leg.get_texts():
            label = text.get_text()
            if label.startswith("note:") or label.startswith("phase:") or label[:1].isdigit():
                continue  # notes; the phase strip's colours; numbered governor actions
            assert drawn.get(label) or "(0 B throughout)" in label, (label, drawn.get(label))


@pytest.mark.parametrize("name", list(RUNS))
def test_memory_png_layout(name):
    d = load(name)
    title = device_title(d["backend"], d["samples"], d["rank"], d["world"])
    assert title == RUNS[name]
    fig = draw_plot(d["samples"], f"{title}: memory, {len(d['samples'])} samples", budget=d["budget"],
                    events=d["events"], phase_every=d["phase_every"])
    assert tuple(fig.get_size_inches()) == (11, 7) and fig.dpi == 110  # the size memory.png is written at
    assert RUNS[name] in fig.axes[0].get_title()
    check_layout(fig)
    check_legends(fig)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    if name == "governor":  # the budget is drawn, each action numbered and described
        assert any(lab.startswith("memory budget") for lab in labels)
        assert sum(lab[:1].isdigit() for lab in labels) == len(d["events"]) >= 1
    if d["phase_every"] > 1 and max(s["step"] for s in d["samples"]) > 2:
        assert any("memory.phase_every" in lab for lab in labels)  # a sparse band says why
    if not any(s.get("allocated") is not None for s in d["samples"]):
        assert any(lab.startswith("note: no allocator figures") for lab in labels)


@pytest.mark.parametrize("name", ["sweep2", "sweep12"])
def test_sweep_memory_png_layout(name):
    from finetune.report import draw_chart

    rs = load(name)["rows"]
    fig = draw_chart(rs)
    assert len(fig.axes[1].get_xticklabels()) == len(rs)
    assert "cuda backend on CPU" in fig.axes[0].get_title()
    check_layout(fig)
    check_legends(fig)


def test_end_table_on_cpu_leads_with_measured_figures():
    """cuda on a CPU: the first lines after the header are the census and the process; no row
    is made of n/a only, and one line says why the device rows are absent."""
    d = load("cuda_cpu")
    lines = render_table(d["samples"], device="cuda backend on CPU").splitlines()
    assert lines[1].startswith("census: frozen weights") and lines[2].startswith("process: RSS")
    assert not any(set(line.split()[1:]) == {"n/a"} for line in lines)
    assert "no allocator figures for the cuda backend on CPU" in lines[-1]


def test_end_table_on_mlx_drops_what_mlx_cannot_measure():
    d = load("mlx_cpu")
    lines = render_table(d["samples"], device="mlx on CPU").splitlines()
    assert lines[1].split() == ["allocated", "reserved", "peak", "alloc", "peak", "resv"]
    assert lines[2].startswith("Device 0") and "n/a" not in lines[3]
    assert lines[4] == "not measurable here: NVML used, NVML total, non-alloc, unexplained"


def test_end_table_on_a_gpu_keeps_every_column():
    """The H200 run's recorded end figures, every column measured, as the run printed them."""
    d = load("h200")
    lines = render_table(d["samples"], device="cuda backend on GPU").splitlines()
    assert lines[2].split() == ["Device", "0", "768", "MiB", "1.39", "GiB", "1.25", "GiB", "1.39", "GiB",
                                "2.13", "GiB", "140", "GiB", "753", "MiB", "229", "MiB"]
    assert lines[4].startswith("non-allocator (NVML used - reserved) 753 MiB")


def test_report_table_of_a_cpu_run_collapses_the_device_rows(tmp_path):
    """finetune-report's table of a finished run: the same rule from summary.json's memory."""
    memory = {"last": {"memory_step": 2, "memory_phase": "optimizer", "rss_bytes": 5 << 20,
                       "census_frozen_weights_bytes": 1024},
              "peaks": {"rss_bytes": 6 << 20, "swap_growth_bytes": 0}, "devices": [{"index": 0}]}
    lines = render_summary_table(memory, device="cuda backend on CPU").splitlines()
    assert lines[1].startswith("census: frozen weights 1.00 KiB") and lines[2].startswith("process: RSS 5.00 MiB")
    assert lines[3].startswith("no allocator figures for the cuda backend on CPU")


def test_readme_pictures_are_made_by_the_script(tmp_path):
    """scripts/make_docs_pictures.py redraws every picture the README shows from the recorded
    runs, in seconds (CI runs it here); the README names each one it makes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_docs_pictures",
                                                  Path(__file__).resolve().parents[1] / "scripts" / "make_docs_pictures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    written = mod.main(tmp_path)
    assert {p.name for p in written} >= {"memory_cuda_cpu.png", "memory_mlx_cpu.png", "memory_governed.png",
                                         "memory_two_ranks.png", "memory_gpu.png", "sweep_memory_2.png"}
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for p in written:
        assert p.stat().st_size > 5000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"docs/{p.name}" in readme, p.name
