"""``finetune-report DIR``: one run or a whole sweep side by side.

Prints a table (at most 120 columns wide: one unit per column, named in its header; what every
job shares on a line below it; the step-1 plan check as its planned and measured peak and the error
between those two) and writes ``sweep_summary.csv``, ``sweep_summary.md`` (a Markdown table to paste)
and ``sweep_memory.png`` (a bar per job: the census at the first optimizer step stacked, the peak
marked, the budget as a line) into DIR, then names the winner for what the sweep varied: the
fastest job that fits the budget, and the one needing least memory among the jobs whose loss is
equal to the best within noise. Jobs an Optuna search pruned by plan (``pruned.json``) are rows
too, with their planned peak. Runs from both backends share the same columns.

A sweep whose jobs ran ``eval.tasks`` after training has a column per task and metric (the
adapter's value, summary.json ``eval``). Reads only ``summary.json``, ``metrics.jsonl``, ``pruned.json`` and ``.hydra/overrides.yaml``,
so it never imports torch or mlx. Rows are sorted by job name, so the report does not depend
on the order jobs finished.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from finetune.accounting.render import save_png, unit_for
from finetune.config import GROUPS
from finetune.io import atomic_write_text
from finetune.redact import redact_overrides

GIB = 1 << 30

# (row key, summary.json path or None when derived, header) of sweep_summary.md and .csv
COLUMNS: list[tuple[str, str | None, str]] = [
    ("job", None, "job"),
    ("status", None, "status"),
    ("backend", "backend", "backend"),
    ("method", "method", "method"),
    ("optim", "optim", "optim"),
    ("precision", "precision", "precision"),
    ("micro_batch", "micro_batch", "micro-batch"),
    ("params_trainable", "params_trainable", "trainable params"),
    ("tokens_per_sec", "tokens_per_sec", "tok/s"),
    ("final_train_loss", "final_train_loss", "train loss"),
    ("final_val_loss", "final_val_loss", "val loss"),
    ("peak_allocated_bytes", "memory.peaks.allocated_bytes", "whole-run peak alloc"),
    ("peak_reserved_bytes", "memory.peaks.reserved_bytes", "whole-run peak reserved"),
    ("peak_device_bytes", "memory.peaks.device_used_bytes", "whole-run peak device"),
    ("peak_rss_bytes", "memory.peaks.rss_bytes", "whole-run peak RSS"),
    ("swap_growth_bytes", "memory.peaks.swap_growth_bytes", "swap growth"),
    ("weights_bytes", None, "weights"),
    ("trainable_weights_bytes", "memory.census_first_optimizer.trainable_weights_bytes", "trainable weights"),
    ("grads_bytes", "memory.census_first_optimizer.grads_bytes", "grads"),
    ("optimizer_state_bytes", "memory.census_first_optimizer.optimizer_state_bytes", "optim state"),
    ("optimizer_state_paged_bytes", "memory.census_first_optimizer.optimizer_state_paged_bytes", "paged state"),
    ("activations_bytes", "memory.census_first_optimizer.activations_and_other_bytes", "activations + other"),
    # the plan's check at step 1 (summary.json plan_error.peak_allocated): the planned and the
    # measured figure of one quantity, the step's peak allocated, and the error between them
    ("planned_peak_bytes", None, "step-1 peak alloc: planned"),
    ("step1_peak_bytes", None, "step-1 peak alloc: measured"),
    ("plan_error_pct", None, "step-1 peak alloc: plan error (%)"),
    ("planned_fit_bytes", None, "planned peak vs budget"),  # a pruned trial's: what ran out first in its plan
    ("adaptations", None, "adapted"),
    ("budget_bytes", "budget_bytes", "budget"),
]


@dataclass(frozen=True)
class Console:
    """A column of the console table: its header words (top to bottom; the unit goes on a line
    below), the header spanning it and its neighbours, and its rank when 120 columns cannot
    hold every column (the lowest rank leaves first, for sweep_summary.md)."""

    key: str
    head: tuple[str, ...]
    group: str = ""
    rank: int = 50
    unit: str = ""  # a non-byte column's unit ("" none); byte columns get theirs from the values


# The console table's columns, in order. A group's byte columns share one unit, so they
# compare across as well as down.
MEASURED, PLAN_CHECK, CENSUS = "whole-run peak", "step-1 peak alloc", "step-1 census"
CONSOLE = (
    Console("job", ("job",), rank=100), Console("status", ("status",), rank=95),
    Console("backend", ("backend",), rank=20), Console("method", ("method",), rank=20),
    Console("optim", ("optim",), rank=20), Console("precision", ("precision",), rank=20),
    Console("micro_batch", ("micro-", "batch"), rank=55), Console("params_trainable", ("trainable", "params"), rank=25),
    Console("tokens_per_sec", ("speed",), rank=80, unit="(tok/s)"), Console("final_train_loss", ("train", "loss"), rank=80),
    Console("final_val_loss", ("val", "loss"), rank=70),
    Console("peak_allocated_bytes", ("alloc",), MEASURED, 75), Console("peak_reserved_bytes", ("reserved",), MEASURED, 74),
    Console("peak_device_bytes", ("device",), MEASURED, 60), Console("peak_rss_bytes", ("RSS",), MEASURED, 72),
    Console("planned_peak_bytes", ("planned",), PLAN_CHECK, 73), Console("step1_peak_bytes", ("measured",), PLAN_CHECK, 73),
    Console("plan_error_pct", ("error",), PLAN_CHECK, 73, unit="(%)"),
    Console("planned_fit_bytes", ("planned", "vs budget"), rank=65),
    Console("weights_bytes", ("weights",), CENSUS, 45), Console("trainable_weights_bytes", ("trainable", "weights"), CENSUS, 40),
    Console("grads_bytes", ("grads",), CENSUS, 42), Console("optimizer_state_bytes", ("optim", "state"), CENSUS, 50),
    Console("optimizer_state_paged_bytes", ("paged", "state"), CENSUS, 41),
    Console("activations_bytes", ("activ.", "+ other"), CENSUS, 43),
    Console("swap_growth_bytes", ("swap", "growth"), rank=58), Console("adaptations", ("adapted",), rank=65),
    Console("budget_bytes", ("budget",), rank=30),
)
JOINED = (PLAN_CHECK,)  # shown whole or not at all: the error is read off the two figures beside it
CONSOLE_WIDTH = 120
JOB_WIDTH = 48  # a longer job name is cut (sweep_summary.md has it whole)
CENSUS_STACK = (("weights_bytes", "weights (frozen + trainable)", "#c7c7c7"), ("grads_bytes", "grads", "#ffbb78"),
                ("optimizer_state_bytes", "optimizer state", "#98df8a"),
                ("optimizer_state_paged_bytes", "paged optimizer state (outside the allocator)", "#dbdb8d"),
                ("activations_bytes", "activations and other", "#f7b6d2"))


def _get(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


EVAL_KEY = "eval:"  # a row's eval.tasks metric: eval:TASK/METRIC, as search_objective names it


# a preference objective's validation metrics the report shows (summary.json pair_metrics.eval)
PAIR_COLUMNS = {"eval_rewards/accuracies": "val reward acc", "eval_rewards/margins": "val reward margin"}


def eval_columns(rs: list[dict[str, Any]]) -> list[tuple[str, str | None, str]]:
    """The eval.tasks metrics the jobs report (summary.json ``eval``), then a preference
    objective's validation reward accuracy and margin, one column each, in the report's COLUMNS
    shape: (row key, None, header)."""
    keys = sorted({k for r in rs for k in r if k.startswith(EVAL_KEY)})
    pairs = [k for k in PAIR_COLUMNS if any(r.get(k) is not None for r in rs)]
    cols: list[tuple[str, str | None, str]] = [(k, None, f"eval {k[len(EVAL_KEY):]}") for k in keys]
    return cols + [(k, None, PAIR_COLUMNS[k]) for k in pairs]


# what makes a directory a job of the report: a run's result, a pruned trial, a failed job
# (finetune/sweep.py writes failed.json: its error line, exit code and log)
JOB_FILES = ("summary.json", "pruned.json", "failed.json")


def find_runs(root: Path) -> list[Path]:
    """Every directory under ``root`` (itself included) holding one of JOB_FILES, less those
    inside another (a logger's copy of summary.json: MLflow's ``mlruns/.../artifacts/``)."""
    found = {p.parent for name in JOB_FILES for p in root.rglob(name)}
    return sorted(d for d in found if not any(a in found for a in d.parents))


def _overrides(run: Path) -> list[str]:
    f = run / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return []
    import yaml

    try:  # masked again here: a job name never shows a secret-named key's value
        return redact_overrides([str(o) for o in (yaml.safe_load(f.read_text()) or [])
                                 if not str(o).startswith("hydra.")])
    except yaml.YAMLError:
        return []


def _peak(row: dict[str, Any]) -> int | None:
    """The job's measured peak: the allocator's where it has one (reserved, else allocated), RSS
    where it has none (torch on CPU)."""
    for k in ("peak_reserved_bytes", "peak_allocated_bytes", "peak_rss_bytes"):
        if row.get(k) is not None:
            return int(row[k])
    return None


def _loss_noise(run: Path) -> float | None:
    """Standard error of the mean of the last 10 step losses (what final_train_loss averages)."""
    m = run / "metrics.jsonl"
    if not m.is_file():
        return None
    losses = []
    for line in m.read_text(errors="replace").splitlines():
        if not line.startswith('{"step"'):
            continue
        try:
            losses.append(json.loads(line)["loss"])
        except (ValueError, KeyError):  # a torn last line (a power cut mid-write): the steps before it count
            continue
    tail = losses[-10:]
    return statistics.stdev(tail) / math.sqrt(len(tail)) if len(tail) >= 3 else None


def rows(root: Path) -> list[dict[str, Any]]:
    runs = find_runs(root)
    overrides = {r: _overrides(r) for r in runs}
    common = set.intersection(*(set(o) for o in overrides.values())) if overrides else set()
    out = []
    for run in runs:
        differ = [o for o in overrides[run] if o not in common]
        name = " ".join(differ) or (str(run.relative_to(root)) if run != root else run.name)
        row: dict[str, Any] = {"job": name, "dir": str(run)}
        s = None
        failed = _failed(run)
        if failed is not None:  # failed.json wins: a summary beside it is an earlier attempt's
            row.update(status=f"failed (exit {failed.get('exit_code')})", error=failed.get("error"),
                       log=failed.get("log"))
        elif (run / "summary.json").is_file():
            try:
                s = json.loads((run / "summary.json").read_text())
            except (OSError, ValueError) as e:  # a torn or edited file: list the run, go on
                row["status"] = f"damaged summary.json ({type(e).__name__})"
            if s is not None and not isinstance(s, dict):
                row["status"] = "damaged summary.json (not a JSON object)"
        if isinstance(s, dict):
            row["status"] = "ran"
            for key, path, _ in COLUMNS:
                if path:
                    row[key] = _get(s, path)
            c = _get(s, "memory.census_first_optimizer") or {}
            if c:
                row["weights_bytes"] = (c.get("frozen_weights_bytes") or 0) + (c.get("trainable_weights_bytes") or 0) \
                    + (c.get("quant_buffers_bytes") or 0)
            # plan error of the step peak: predicted vs the allocator's (where it measured one)
            peak_err = (s.get("plan_error") or {}).get("peak_allocated") or {}
            row["planned_peak_bytes"] = peak_err.get("predicted")
            row["step1_peak_bytes"] = peak_err.get("measured")
            rel = peak_err.get("relative_error")
            row["plan_error_pct"] = None if rel is None else 100.0 * rel
            row["adaptations"] = len([e for e in s.get("adaptations") or []
                                      if e.get("action") in ("lower_micro_batch", "enable_grad_checkpointing",
                                                             "enable_loss_chunk")])
            row["loss_noise"] = _loss_noise(run)
            # eval.tasks after training (finetune/evaluate.py): TASK/METRIC -> the adapter's value
            for k, v in (s.get("eval") or {}).items():
                row[EVAL_KEY + k] = v
            # a preference objective's last validation, TRL's names (search_objective ranks by them)
            for k, v in (_get(s, "pair_metrics.eval") or {}).items():
                if k in PAIR_COLUMNS:
                    row[k] = v
        elif "status" not in row:
            p = json.loads((run / "pruned.json").read_text())
            row.update(status="pruned (plan)", backend=p.get("backend"), method=p.get("method"), optim=p.get("optim"),
                       precision=p.get("precision"), micro_batch=p.get("batch_size"),
                       planned_fit_bytes=p.get("planned_peak_bytes"), budget_bytes=p.get("budget_bytes"))
        row["peak_bytes"] = _peak(row)
        out.append(row)
    out.sort(key=lambda r: (_natural(r["job"]), r["dir"]))
    names = [r["job"] for r in out]
    for r in out:  # the same overrides twice (a search that sampled a point again): tell them apart
        if names.count(r["job"]) > 1:
            r["job"] += f" [{Path(r['dir']).name.split('_', 1)[0]}]"
    return out


def _failed(run: Path) -> dict[str, Any] | None:
    """A failed job's record (``failed.json``), None where the job did not fail."""
    f = run / "failed.json"
    if not f.is_file():
        return None
    try:
        rec = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        return {"error": f"failed.json unreadable ({type(e).__name__})"}
    return rec if isinstance(rec, dict) else {"error": "failed.json is not a JSON object"}


def _natural(name: str) -> list[Any]:
    """Sort key that orders rank=2 before rank=16."""
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def short_label(job: str) -> str:
    """A chart label: group choices by their option (optim=adamw -> adamw), other keys by their
    last part (method.lora.rank=16 -> rank=16)."""
    parts = []
    for tok in job.split(" "):
        key, eq, val = tok.partition("=")
        parts.append(val if eq and key in GROUPS else (f"{key.rsplit('.', 1)[-1]}={val}" if eq else tok))
    return " ".join(parts)


def winners(rs: list[dict[str, Any]]) -> list[str]:
    """Sentences naming the fastest job that fits the budget and the leanest job at equal loss."""
    ran = [r for r in rs if r["status"] == "ran"]
    out = []
    def budget_peak(r: dict[str, Any]) -> tuple[int | None, str]:
        # against the budget: the allocator's peak where measured, else the plan's (the process
        # RSS of a CPU run counts the interpreter and libraries, which no device budget does)
        for key, label in (("peak_reserved_bytes", "peak reserved"), ("peak_allocated_bytes", "peak allocated"),
                           ("planned_peak_bytes", "planned peak allocated")):
            if r.get(key) is not None:
                return int(r[key]), label
        return None, "peak"

    def fits(r: dict[str, Any]) -> bool:
        peak = budget_peak(r)[0]
        return r.get("budget_bytes") is None or peak is None or peak <= r["budget_bytes"]

    fits_ = [r for r in ran if r.get("tokens_per_sec") and fits(r)]
    if fits_:
        best = max(fits_, key=lambda r: r["tokens_per_sec"])
        peak, label = budget_peak(best)
        out.append(f"fastest that fits the budget: {best['job']} ({best['tokens_per_sec']:,.0f} tokens/s, "
                   f"{label} {_gib(peak)} GiB"
                   + (f" of {_gib(best['budget_bytes'])} GiB" if best.get("budget_bytes") else "") + ")")
    with_loss = [r for r in ran if r.get("final_train_loss") is not None and r["peak_bytes"] is not None]
    if len(with_loss) >= 2:
        lo = min(with_loss, key=lambda r: r["final_train_loss"])
        # equal within noise: within two combined standard errors of the best's loss (1% if unknown)
        def tol(r: dict[str, Any]) -> float:
            a, b = lo.get("loss_noise"), r.get("loss_noise")
            return 2 * math.hypot(a, b) if a is not None and b is not None else 0.01 * abs(lo["final_train_loss"])
        equal = [r for r in with_loss if r["final_train_loss"] - lo["final_train_loss"] <= tol(r)]
        lean = min(equal, key=lambda r: r["peak_bytes"])
        out.append(f"least memory at equal loss: {lean['job']} (peak {_gib(lean['peak_bytes'])} GiB, train loss "
                   f"{lean['final_train_loss']:.4f}; {len(equal)} of {len(with_loss)} jobs within noise of the best "
                   f"{lo['final_train_loss']:.4f})")
    failed = [r for r in rs if r["status"].startswith("failed")]
    if failed:
        out.append(f"failed: {len(failed)} job(s) ("
                   + "; ".join(f"{r['job']}: {r.get('error')}, log {r.get('log')}" for r in failed) + ")")
    pruned = [r for r in rs if r["status"].startswith("pruned")]
    if pruned:
        out.append(f"pruned by plan before loading: {len(pruned)} job(s) ("
                   + ", ".join(f"{r['job']}: planned {_gib(r['planned_fit_bytes'])} GiB" for r in pruned) + ")")
    return out


def _gib(v: Any) -> str:
    return "n/a" if v is None else f"{v / GIB:.3f}"


def _units(rs: list[dict[str, Any]]) -> dict[str, tuple[float, str]]:
    """One unit per byte column, the largest its biggest value reaches (a tiny model's state is
    KiB, a 7B's GiB), so the column reads without a row of 0.000s; the byte columns of one
    console group (CONSOLE) share the unit of the group's biggest value, so the step-1 planned
    and measured peaks read side by side."""
    group = {c.key: c.group for c in CONSOLE}
    keys = [k for k, _, _ in COLUMNS if k.endswith("_bytes")]
    top: dict[str, int] = {}
    for k in keys:
        vmax = max((abs(r[k]) for r in rs if r.get(k) is not None), default=0)
        g = group.get(k) or k
        top[g] = max(top.get(g, 0), vmax)
    return {k: unit_for(top[group.get(k) or k]) for k in keys}


def _fmt(key: str, v: Any, unit: float = GIB) -> str:
    if v is None:
        return "n/a"
    if key.endswith("_bytes"):
        return f"{v / unit:.3f}" if unit > 1 else str(v)
    if key == "tokens_per_sec":
        return f"{v:,.0f}"
    if key == "plan_error_pct":
        return f"{v:+.1f}"
    if key.startswith(EVAL_KEY):  # a perplexity runs to 1e11 on a random tiny model
        return f"{v:.6g}"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def _shown(rs: list[dict[str, Any]]) -> list[tuple[str, str | None, str]]:
    """Columns with at least one value (a CPU sweep has no allocator or NVML figures)."""
    return [c for c in COLUMNS if c[0] in ("job", "status") or any(r.get(c[0]) is not None for r in rs)]


_TEXT_KEYS = ("job", "status", "backend", "method", "optim", "precision")


def _console_cell(c: Console, r: dict[str, Any], units: dict[str, tuple[float, str]]) -> str:
    if c.key == "job":
        job = str(r["job"])
        return job if len(job) <= JOB_WIDTH else job[:JOB_WIDTH - 1] + "…"
    return _fmt(c.key, r.get(c.key), units[c.key][0] if c.key in units else GIB)


def _unit_label(c: Console, units: dict[str, tuple[float, str]]) -> str:
    return f"({units[c.key][1]})" if c.key in units else c.unit


def _spans(cols: list[Console]) -> list[tuple[int, int]]:
    """(first, last) index of each run of neighbouring columns under one group header (a
    column without a group is a run of its own)."""
    out, i = [], 0
    while i < len(cols):
        j = i
        while cols[i].group and j + 1 < len(cols) and cols[j + 1].group == cols[i].group:
            j += 1
        out.append((i, j))
        i = j + 1
    return out


def _layout(cols: list[Console], cells: dict[str, list[str]], units: dict[str, tuple[float, str]]) -> list[int]:
    """Each column's width: its header words, its unit and its cells. A group's header fits
    above its columns: over several, on one line between dashes ("- step-1 peak alloc -"), the
    last column widened for it; over one, wrapped to the column's width (its longest word)."""
    widths = [max([len(w) for w in c.head] + [len(_unit_label(c, units))] + [len(x) for x in cells[c.key]])
              for c in cols]
    for i, j in _spans(cols):
        span = sum(widths[i:j + 1]) + 2 * (j - i)
        need = len(cols[i].group) + 4 if j > i else max((len(w) for w in cols[i].group.split()), default=0)
        widths[j] += max(0, need - span)
    return widths


def _render(cols: list[Console], cells: dict[str, list[str]], units: dict[str, tuple[float, str]]) -> list[str]:
    """The table's lines: the group headers (wrapped to the columns they span, dashed across
    several), the header words (bottom-aligned), the units, then a row per job; numbers right-
    aligned, so they compare down."""
    widths = _layout(cols, cells, units)
    numeric = [c.key not in _TEXT_KEYS for c in cols]

    def line(parts: list[str]) -> str:
        return "  ".join(p.rjust(w) if num else p.ljust(w) for p, w, num in zip(parts, widths, numeric)).rstrip()

    spans = _spans(cols)
    span_w = [sum(widths[i:j + 1]) + 2 * (j - i) for i, j in spans]
    groups = []  # per span: its header lines
    for (i, j), w in zip(spans, span_w):
        if j > i:  # a dashed span: "--- name ---"
            pad = w - len(cols[i].group) - 2
            groups.append(["-" * (pad // 2) + f" {cols[i].group} " + "-" * (pad - pad // 2)])
        else:
            text = textwrap.wrap(cols[i].group, w) if cols[i].group else []
            groups.append([t.rjust(w) if numeric[i] else t.ljust(w) for t in text])
    top = max((len(g) for g in groups), default=0)
    groups = [[""] * (top - len(g)) + g for g in groups]  # bottom-aligned over the header words
    out = ["  ".join(g[d].ljust(w) for g, w in zip(groups, span_w)).rstrip() for d in range(top)]
    depth = max(len(c.head) for c in cols)
    heads = [("",) * (depth - len(c.head)) + c.head for c in cols]
    out += [line([h[d] for h in heads]) for d in range(depth)]
    if any(_unit_label(c, units) for c in cols):
        out.append(line([_unit_label(c, units) for c in cols]))
    out += [line([cells[c.key][n] for c in cols]) for n in range(len(next(iter(cells.values()))))]
    return out


def table(rs: list[dict[str, Any]], width: int = CONSOLE_WIDTH) -> str:
    """The console table, at most ``width`` characters wide: one unit per column, named in the
    header; a figure every job shares goes to a line below ("same in every job"), and where
    the columns still do not fit, the lowest-ranked leave (named below; sweep_summary.md and
    .csv keep every column)."""
    units = _units(rs)
    evals = eval_columns(rs)  # after the losses they sit beside, ranked with them
    at = next(i for i, c in enumerate(CONSOLE) if c.key == "final_val_loss") + 1
    console = [*CONSOLE[:at], *(Console(k, tuple(k[len(EVAL_KEY):].split("/", 1)), "eval", rank=82)
                                if k.startswith(EVAL_KEY) else Console(k, tuple(h.split(" ", 1)[1].split()), "val", rank=82)
                                for k, _, h in evals),
               *CONSOLE[at:]]
    cols = [c for c in console if c.key == "job" or any(r.get(c.key) is not None for r in rs)]
    cells = {c.key: [_console_cell(c, r, units) for r in rs] for c in cols}
    name = {k: h for k, _, h in COLUMNS + evals}
    same = []
    if len(rs) >= 2:
        for c in list(cols):
            if c.key != "job" and c.group not in JOINED and len(set(cells[c.key])) == 1:
                unit = units[c.key][1] if c.key in units else ""
                same.append(f"{name[c.key]} {cells[c.key][0]}{' ' + unit if unit else ''}")
                cols.remove(c)
    dropped: list[Console] = []
    while sum(_layout(cols, cells, units)) + 2 * (len(cols) - 1) > width and len(cols) > 1:
        low = min(c.rank for c in cols if c.key != "job")
        dropped += [c for c in cols if c.rank == low]
        cols = [c for c in cols if c.rank != low or c.key == "job"]
    lines = _render(cols, cells, units)
    if same:
        lines += textwrap.wrap("same in every job: " + "; ".join(same), width, subsequent_indent="  ")
    if dropped:
        lines += textwrap.wrap("not shown for width (in sweep_summary.md): " + ", ".join(name[c.key] for c in dropped),
                               width, subsequent_indent="  ")
    return "\n".join(lines)


def console_note(text: str, width: int = CONSOLE_WIDTH) -> str:
    """A sentence of the report as printed under the table: wrapped to the table's width."""
    return "\n".join(textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False))


def markdown(rs: list[dict[str, Any]], notes: list[str]) -> str:
    cols = _shown(rs) + eval_columns(rs)
    units = _units(rs)
    head = [h + (f" ({units[k][1]})" if k in units else "") for k, _, h in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rs:
        lines.append("| " + " | ".join(_fmt(k, r.get(k), units[k][0] if k in units else GIB).replace("|", "\\|")
                                      for k, _, _ in cols) + " |")
    lines.append("")
    lines += [f"- {n}" for n in notes]
    lines.append("")
    lines.append("KiB/MiB/GiB = 2^10/2^20/2^30 bytes. whole-run peak: measured over the whole run. Census at the first "
                 "optimizer step. step-1 peak alloc: the plan's peak allocated for step 1, the allocator's measured "
                 "peak in that step, and the plan error (planned - measured) / measured; peak in the sentences = "
                 "the allocator's reserved (else allocated, else process RSS where no allocator is measured).")
    return "\n".join(lines) + "\n"


def write_chart(rs: list[dict[str, Any]], path: Path) -> None:
    """Write ``draw_chart``'s figure to ``path`` (a temporary name, then renamed into place)."""
    save_png(draw_chart(rs), path)


def _device_panel(ax: Any, rs: list[dict[str, Any]]) -> None:
    """The top panel, in one unit for the tallest figure: the census at the first optimizer
    step stacked per job, a pruned job's planned peak hatched, each job's peak as a marker, the
    budget as a line where it is near the figures (else named in the legend), and the title."""
    n = len(rs)
    xs = list(range(n))
    ran = [r["status"] == "ran" for r in rs]
    stacks = [(key, label, color, [(r.get(key) or 0) if ok else 0 for r, ok in zip(rs, ran)])
              for key, label, color in CENSUS_STACK]
    stacks = [st for st in stacks if any(st[3])]
    alloc = [(i, v) for i, r in enumerate(rs) if (v := r.get("peak_reserved_bytes") or r.get("peak_allocated_bytes"))]
    planned = [(i, r["planned_peak_bytes"]) for i, r in enumerate(rs) if r.get("planned_peak_bytes")]
    pruned = [(i, r["planned_fit_bytes"]) for i, r in enumerate(rs) if r.get("planned_fit_bytes")]
    top = max([sum(col) for col in zip(*[st[3] for st in stacks])] + [v for _, v in alloc + planned + pruned] + [0]) \
        if n else 0
    budgets = {r["budget_bytes"] for r in rs if r.get("budget_bytes")}
    budget = budgets.pop() if len(budgets) == 1 else None
    drawn = budget if budget is not None and top and budget <= 3 * top else None  # the budget as a line
    scale, unit = unit_for(max(top, drawn or 0))
    bottoms = [0.0] * n
    for _, label, color, vals in stacks:
        ax.bar(xs, [v / scale for v in vals], bottom=bottoms, color=color, label=label, width=0.7,
               edgecolor="white", lw=0.5)
        bottoms = [b + v / scale for b, v in zip(bottoms, vals)]
    if pruned:
        ax.bar([i for i, _ in pruned], [v / scale for _, v in pruned], width=0.7, fill=False, hatch="//",
               edgecolor="#d62728", label="pruned by plan (its planned peak)")
    _peak_markers(ax, ran, alloc, planned, scale)
    if drawn is not None:
        ax.axhline(drawn / scale, color="#d62728", lw=1.2, label=f"memory budget {drawn / GIB:.2f} GiB")
    elif budget is not None:  # named in the legend: a text inside or beside the chart could cover data
        ax.bar([0], [0], color="none", label=f"note: memory budget {budget / GIB:.2f} GiB,\nabove the chart's scale")
    ax.set_ylabel(f"{unit}\n(device / allocator)", fontsize=9)
    # what ran: a backend on a GPU where an allocator was measured, on the CPU (census only) elsewhere
    backends = sorted({str(r.get("backend")) for r in rs if r.get("backend")})
    where = ", ".join(f"{b} {'backend ' if b == 'cuda' else ''}on {'GPU' if alloc else 'CPU'}" for b in backends)
    ax.set_title(f"sweep memory, {where or 'no job ran'}: {n} job(s)\n"
                 "census at the first optimizer step, peaks per job", fontsize=10)


def _peak_markers(ax: Any, ran: list[bool], alloc: list[tuple[int, int]], planned: list[tuple[int, int]],
                  scale: float) -> None:
    """Each job's peak as a bar-wide marker: the allocator's measured peak, else (no allocator
    measured) the plan's."""
    marker = dict(marker="_", s=min(900, 9000 / max(len(ran), 1)), lw=2.5, zorder=4)
    if alloc:
        ax.scatter([i for i, _ in alloc], [v / scale for _, v in alloc], color="black",
                   label="measured peak (allocator)", **marker)
    plan_only = [(i, v) for i, v in planned if ran[i] and i not in {j for j, _ in alloc}]
    if plan_only:
        ax.scatter([i for i, _ in plan_only], [v / scale for _, v in plan_only], color="#1f77b4",
                   label="planned peak (no allocator measured)", **marker)


def _rss_panel(hax: Any, rs: list[dict[str, Any]]) -> None:
    """The bottom panel: each job's process peak RSS (what the OS saw), in its own unit."""
    rss = [(r.get("peak_rss_bytes") or 0) for r in rs]
    hscale, hunit = unit_for(max(rss + [0]))
    hax.bar(list(range(len(rs))), [v / hscale for v in rss], width=0.7, color="#17becf", label="process peak RSS")
    hax.set_ylabel(f"{hunit}\n(process)", fontsize=9)


def _job_axis(ax: Any, hax: Any, rs: list[dict[str, Any]], labels: list[str], rotate: bool) -> None:
    """The shared job axis and both legends: a tick per job, labelled under the bottom panel
    (slanted for a few jobs, upright for many); failed jobs named in the top legend."""
    from matplotlib.patches import Patch

    n = len(rs)
    for a in (ax, hax):
        a.set_xticks(list(range(n)))
        a.set_xlim(-0.6, n - 0.4)
        a.set_ylim(bottom=0)
        a.grid(axis="y", alpha=0.3)
        a.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    failed = [i for i, r in enumerate(rs) if r.get("status") == "failed"]
    if failed:  # no bar to show: the legend says which jobs and why they are empty
        handles, labels_ = ax.get_legend_handles_labels()
        ax.legend([*handles, Patch(color="none")], [*labels_, f"note: {len(failed)} job(s) failed: no figures"],
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_xticklabels([])
    # a few labels slant; many stand upright, where slanted ones would cover their neighbours
    angle = (90 if n > 4 else 35) if rotate else 0
    hax.set_xticklabels(labels, rotation=angle, ha="right" if angle == 35 else "center",
                        fontsize=7 if n > 12 else 8)


def draw_chart(rs: list[dict[str, Any]]) -> Any:
    """The sweep_memory.png figure: a bar per job. Top: the census at the first optimizer step
    stacked, the allocator's measured peak as a marker (the plan's where no allocator is measured), the budget as a
    line; pruned jobs as a hatched bar at their planned peak. Bottom: the process's peak RSS
    (what the OS saw). Each panel has its own unit; readable from 2 to 30 jobs."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(rs)
    width = min(max(8.0, 2.5 + 0.55 * n), 24.0)
    fig = Figure(figsize=(width, 6.4), dpi=110)
    FigureCanvasAgg(fig)
    ax, hax = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2, sharex=None)
    _device_panel(ax, rs)
    _rss_panel(hax, rs)
    labels = [short_label(r["job"]) for r in rs]
    labels = [x if len(x) <= 32 else x[:31] + "…" for x in labels]
    rotate = n > 2 or max((len(x) for x in labels), default=0) > 14
    _job_axis(ax, hax, rs, labels, rotate)
    # room for the legends on the right and the job labels below
    right = 1.0 - 2.6 / width
    longest = max((len(x) for x in labels), default=0)
    bottom = min(0.34, 0.08 + 0.0105 * longest) if rotate else 0.1
    fig.subplots_adjust(left=max(0.9, 0.055 * longest if rotate else 0.9) / width, right=right, bottom=bottom,
                        top=0.90, hspace=0.12)
    return fig


def report(root: Path, out_dir: Path | None = None, chart: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """Build and write the report for ``root``; returns (rows, winner sentences)."""
    rs = rows(root)
    notes = winners(rs)
    out = out_dir or root
    buf = io.StringIO()
    fields = [k for k, _, _ in COLUMNS + eval_columns(rs)] + ["peak_bytes", "loss_noise", "dir", "error", "log"]
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    w.writerows(rs)
    atomic_write_text(out / "sweep_summary.csv", buf.getvalue())
    atomic_write_text(out / "sweep_summary.md", markdown(rs, notes))
    if chart:
        write_chart(rs, out / "sweep_memory.png")
    return rs, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="finetune-report", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a run directory or a sweep (multirun) directory")
    ap.add_argument("--out", type=Path, default=None, help="where the files go (default: DIR)")
    a = ap.parse_args(argv)
    if not a.dir.is_dir():
        print(f"error: {a.dir} is not a directory; give a run or sweep directory", file=sys.stderr)
        return 2
    if not find_runs(a.dir):
        print(f"error: no summary.json under {a.dir}; point it at a finished run or sweep", file=sys.stderr)
        return 2
    try:
        rs, notes = report(a.dir, a.out)
    except OSError as e:  # each file is written whole or not at all (atomic_write_text)
        print(f"error: cannot write {e.filename or (a.out or a.dir)} ({e.strerror or e}); free space or choose "
              "another --out", file=sys.stderr)
        return 2
    print(table(rs))
    for n in notes:
        print(console_note(n))
    print(f"written: {(a.out or a.dir) / 'sweep_summary.csv'}, sweep_summary.md, sweep_memory.png", file=sys.stderr)
    return 0


class SweepReportCallback(Callback):
    """Hydra callback: at the end of ``finetune -m ...`` the report is written into the sweep
    directory by itself (conf/config.yaml ``hydra.callbacks``)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self.write(Path(str(config.hydra.sweep.dir)))

    def write(self, root: Path) -> None:
        """Write and print the report of the sweep in ``root`` (also after fail_fast stopped it)."""
        if not root.is_dir() or not find_runs(root):
            return
        try:
            rs, notes = report(root)
        except Exception as e:  # a report must never fail the sweep it describes
            print(f"[sweep] report not written: {e}", file=sys.stderr)
            return
        print(f"[sweep] {len(rs)} job(s) side by side (each column's unit in its header; every column in "
              "sweep_summary.md and .csv):", file=sys.stderr)
        print(table(rs), file=sys.stderr)
        for n in notes:
            print(console_note(f"[sweep] {n}"), file=sys.stderr)
        print(f"[sweep] report: {root / 'sweep_summary.md'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
