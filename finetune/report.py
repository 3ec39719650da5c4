"""``finetune-report DIR``: one run or a sweep, side by side (table on stdout, CSV beside it).

Reads only ``summary.json`` files, so it never imports torch or mlx. Rows are sorted by the
overrides that tell the runs apart, so the report does not depend on the order jobs finished.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

GIB = 1 << 30

COLUMNS: list[tuple[str, str]] = [
    ("run", "run"),
    ("backend", "backend"),
    ("method", "method"),
    ("optim", "optim"),
    ("params_trainable", "trainable"),
    ("tokens_per_sec", "tok/s"),
    ("final_train_loss", "train loss"),
    ("final_val_loss", "val loss"),
    ("memory.peaks.allocated_bytes", "peak alloc GiB"),
    ("memory.peaks.reserved_bytes", "peak reserved GiB"),
    ("memory.peaks.device_used_bytes", "peak device GiB"),
    ("memory.peaks.rss_bytes", "peak RSS GiB"),
    ("memory.peaks.swap_growth_bytes", "swap growth GiB"),
    ("adaptations", "adaptations"),
]


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)  # type: ignore[assignment]
    return d


def find_runs(root: Path) -> list[Path]:
    """Every directory under ``root`` (itself included) holding a summary.json."""
    return sorted({p.parent for p in root.rglob("summary.json")})


def rows(root: Path) -> list[dict[str, Any]]:
    out = []
    for run in find_runs(root):
        s = json.loads((run / "summary.json").read_text())
        row: dict[str, Any] = {"run": str(run.relative_to(root)) if run != root else run.name}
        for key, _ in COLUMNS[1:]:
            v = _get(s, key)
            row[key] = len(v) if key == "adaptations" and isinstance(v, list) else v
        out.append(row)
    return sorted(out, key=lambda r: r["run"])


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "n/a"
    if key.startswith("memory."):
        return f"{v / GIB:.3f}"
    if isinstance(v, float):
        return f"{v:,.1f}" if key == "tokens_per_sec" else f"{v:.4f}"
    return str(v)


def table(rs: list[dict[str, Any]]) -> str:
    head = [label for _, label in COLUMNS]
    body = [[_fmt(k, r.get(k)) for k, _ in COLUMNS] for r in rs]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="finetune-report", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a run directory or a sweep (multirun) directory")
    ap.add_argument("--csv", type=Path, default=None, help="CSV path (default: DIR/report.csv)")
    a = ap.parse_args(argv)
    if not a.dir.is_dir():
        print(f"error: {a.dir} is not a directory; give a run or sweep directory", file=sys.stderr)
        return 2
    rs = rows(a.dir)
    if not rs:
        print(f"error: no summary.json under {a.dir}; point it at a finished run or sweep", file=sys.stderr)
        return 2
    print(table(rs))
    out = a.csv or a.dir / "report.csv"
    from finetune.io import atomic_write_text
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[k for k, _ in COLUMNS])
    w.writeheader()
    w.writerows(rs)
    atomic_write_text(out, buf.getvalue())
    print(f"csv: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
