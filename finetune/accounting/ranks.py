"""Memory of every rank of a run of several processes, gathered on rank 0: a row per rank,
then Overall (sums), min and max, for the allocator, NVML and the process.

Each rank hands in a report (``rank_report``) built from its own Accountant; rank 0 merges
them with ``gather.gather`` (which counts a device two ranks share once and a host's system
figures once) and prints ``render_rank_table``. Pure functions over the reports, so the table
is tested on recorded figures too.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

from finetune.accounting.gather import gather
from finetune.units import fmt_bytes

# (column, key in the merged per-rank sample, what it is)
COLUMNS = (
    ("peak alloc", "peak_allocated", "allocator: most bytes in live tensors at once"),
    ("peak reserved", "peak_reserved", "allocator: most bytes held from the device, cached blocks included"),
    ("NVML peak", "device_used", "driver: most bytes used on the rank's device(s), every process"),
    ("peak RSS", "peak_rss", "OS: the process's resident set at its largest"),
    ("MLX peak", "mlx_peak", "MLX: the allocator's peak"),
    ("swap growth", "swap_growth", "OS: system swap grown since the run started (per host)"),
)


def rank_report(rank: int, device: str, summary: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """What rank ``rank`` sends to rank 0: its run peaks as one sample-shaped dict (the keys
    ``gather`` merges), its devices, and its explanations."""
    peaks = summary.get("peaks") or {}
    last = samples[-1] if samples else {}
    dev_rows = []
    for d in summary.get("devices") or []:
        dev_rows.append({"index": d.get("index", 0), "device_used": d.get("peak_device_used_bytes"),
                         "device_total": d.get("device_total_bytes"), "other_processes_used": None})
    return {
        "rank": rank, "host": last.get("host") or socket.gethostname(), "device": device,
        "peak_allocated": peaks.get("allocated_bytes"), "peak_reserved": peaks.get("reserved_bytes"),
        "allocated": last.get("allocated"), "reserved": last.get("reserved"),
        "device_used": peaks.get("device_used_bytes"), "device_total": last.get("device_total"),
        "peak_rss": peaks.get("rss_bytes"), "rss": last.get("rss"),
        "mlx_peak": peaks.get("mlx_peak_bytes"), "swap_growth": peaks.get("swap_growth_bytes"),
        "swap_used": last.get("swap_used"), "system_total": last.get("system_total"),
        "devices": dev_rows,
        "explanations": summary.get("explanations") or [],
    }


def merge(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Overall over ranks: {"ranks": [...], "overall": {key: {sum, min, max, max_rank}},
    "num_devices", "num_hosts"} (``gather.gather`` semantics: a sum is None when any rank
    could not measure the figure)."""
    g = gather(list(reports))
    # gather() sums process keys; peak figures of different ranks happen at different
    # moments, so their sum bounds the simultaneous total from above (said in the table)
    return {"ranks": [{k: v for k, v in r.items() if k != "explanations"} for r in reports],
            "overall": g["overall"], "num_devices": g["num_devices"], "num_hosts": g["num_hosts"]}


def explanations(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's explanations, each naming its rank."""
    out = []
    for r in reports:
        for ex in r.get("explanations") or []:
            out.append({**ex, "rank": r["rank"], "text": f"rank {r['rank']}: {ex.get('text', '')}"})
    return out


def merge_into(summary: dict[str, Any], reports: Sequence[dict[str, Any]], world_size: int, strategy: str) -> None:
    """Rank 0's summary with every rank's ``rank_report``: summary["ranks"],
    summary["memory"]["per_rank"] (rows and Overall) and explanations that name their rank."""
    merged = merge(reports)
    summary["world_size"] = world_size
    summary["strategy"] = strategy
    summary["ranks"] = merged["ranks"]
    summary["memory"]["per_rank"] = merged
    summary["memory"]["explanations"] = explanations(reports)


def render_rank_table(merged: dict[str, Any]) -> str:
    """A row per rank, then Overall (sum), min and max; a column only where some rank measured it."""
    ranks, ov = merged["ranks"], merged["overall"]
    cols = [(name, key) for name, key, _ in COLUMNS if any(r.get(key) is not None for r in ranks)]
    head = ["rank", "host", "device"] + [c for c, _ in cols]
    rows = [[str(r["rank"]), str(r.get("host", "")), str(r.get("device", ""))]
            + [fmt_bytes(r.get(k)) if r.get(k) is not None else "-" for _, k in cols] for r in ranks]

    def stat(which: str) -> list[str]:
        out = []
        for _, k in cols:
            v = (ov.get(k) or {}).get(which)
            cell = fmt_bytes(v) if v is not None else "-"
            if which == "max" and v is not None and (ov.get(k) or {}).get("max_rank") is not None:
                cell += f" (r{ov[k]['max_rank']})"
            out.append(cell)
        return out

    n_dev, n_host = merged["num_devices"], merged["num_hosts"]
    rows.append(["Overall", f"{n_host} host(s)", f"{n_dev} device(s)" if n_dev else ""] + stat("sum"))
    rows.append(["min", "", ""] + stat("min"))
    rows.append(["max", "", ""] + stat("max"))
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [f"memory per rank ({len(ranks)} ranks)", line(head), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    out.append("Overall: sums over ranks (NVML once per physical device, swap once per host); peaks of different "
               "ranks need not coincide, so summed peaks bound the simultaneous total from above")
    return "\n".join(out)


# what the governor decides on under several ranks (every rank's figure, merged: the largest)
GOVERNOR_KEYS = ("step_peak_reserved", "step_peak_allocated", "peak_reserved", "peak_allocated", "allocated",
                 "reserved", "swap_used", "psi_some_avg10", "inactive_split")


def governor_view(sample: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The part of one rank's sample the governor reads, as the ranks gather it."""
    if sample is None:
        return None
    return {**{k: sample.get(k) for k in GOVERNOR_KEYS}, "system_fresh": sample.get("system_fresh", True)}


def merge_governor_views(views: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Every rank's ``governor_view`` as one sample: the largest of each figure (None where no
    rank knows it), fresh only when every rank's reading is; None when no rank sampled."""
    got = [g for g in views if g is not None]
    if not got:
        return None
    merged: dict[str, Any] = {"system_fresh": all(g["system_fresh"] for g in got)}
    for k in GOVERNOR_KEYS:
        vals = [g[k] for g in got if g.get(k) is not None]
        merged[k] = max(vals) if vals else None
    return merged
