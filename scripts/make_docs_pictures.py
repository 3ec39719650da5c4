"""The README's pictures, drawn from the recorded runs in tests/data/timelines/ (made by
scripts/record_timelines.py) with the same code a run uses, at a small size for the page:

    python scripts/make_docs_pictures.py            # writes docs/*.png (a few seconds)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMELINES = REPO / "tests" / "data" / "timelines"
DPI = 56  # memory.png is 11 x 7 in at 110 dpi; half of that keeps the page light

MEMORY = {"memory_cuda_cpu": "cuda_cpu", "memory_mlx_cpu": "mlx_cpu", "memory_governed": "governor",
          "memory_two_ranks": "two_rank", "memory_gpu": "h200"}
SWEEPS = {"sweep_memory_2": "sweep2", "sweep_memory_12": "sweep12"}


def main(out: Path = REPO / "docs") -> list[Path]:
    from finetune.accounting.render import device_title, draw_plot, save_png
    from finetune.report import draw_chart

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, src in MEMORY.items():
        d = json.loads((TIMELINES / f"{src}.json").read_text())
        title = device_title(d["backend"], d["samples"], d["rank"], d["world"])
        fig = draw_plot(d["samples"], f"{title}: memory, {len(d['samples'])} samples", budget=d["budget"],
                        events=d["events"], phase_every=d["phase_every"])
        save_png(fig, out / f"{name}.png", dpi=DPI)
        written.append(out / f"{name}.png")
    for name, src in SWEEPS.items():
        path = TIMELINES / f"{src}.json"
        if not path.is_file():
            continue
        fig = draw_chart(json.loads(path.read_text())["rows"])
        save_png(fig, out / f"{name}.png", dpi=DPI)
        written.append(out / f"{name}.png")
    return written


if __name__ == "__main__":
    for p in main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs"):
        print(p)
