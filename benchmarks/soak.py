"""Leak watch: 2,000 optimizer steps on the tiny model on each backend, and the trend of the
process's memory over them. A leak is a steady climb: the least-squares slope of RSS (bytes
per step) over the second half of the run, after allocator caches and lazy state settle.

    python benchmarks/soak.py                      # both backends, 2000 steps each
    python benchmarks/soak.py --steps 500 --leak-bytes 262144   # with the planted leak

--leak-bytes N turns on the test-only switch FINETUNE_FAULT_LEAK_BYTES (finetune/loop.py
keeps an N-byte array alive per step), which this script must flag with its rate. Prints the
table; writes it to benchmarks/results/soak_<backend>_cpu.txt. Measures, never asserts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

LEAK_BYTES_PER_STEP = 4096  # flagged above this slope: 2,000 steps would keep >8 MiB


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def soak(backend: str, steps: int, leak_bytes: int) -> dict:
    from finetune.config import compose
    from finetune.loop import train

    if leak_bytes:
        os.environ["FINETUNE_FAULT_LEAK_BYTES"] = str(leak_bytes)
    else:
        os.environ.pop("FINETUNE_FAULT_LEAK_BYTES", None)
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        train(compose(run, f"backend={backend}", f"train.steps={steps}", "train.eval_every=0", "train.progress=false",
                      "data.num_samples=400", "train.schedule=constant", "memory.sample_every=1"))
        recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]
    pts = [(r["step"], r["rss_bytes"]) for r in recs if r.get("rss_bytes") is not None]
    half = pts[len(pts) // 2:]
    s = slope([p[0] for p in half], [p[1] for p in half])
    return {"backend": backend, "steps": steps, "planted_leak_bytes_per_step": leak_bytes,
            "rss_first_bytes": pts[0][1], "rss_mid_bytes": half[0][1], "rss_last_bytes": pts[-1][1],
            "slope_bytes_per_step": s, "leak": s > LEAK_BYTES_PER_STEP}


def line(r: dict) -> str:
    mib = 2**20
    verdict = (f"LEAK flagged: {r['slope_bytes_per_step'] / 1024:.1f} KiB/step" if r["leak"]
               else f"no leak ({r['slope_bytes_per_step']:.0f} B/step <= {LEAK_BYTES_PER_STEP} B/step)")
    return (f"{r['backend']:5s} steps={r['steps']:5d} planted={r['planted_leak_bytes_per_step']:7d} B/step  RSS MiB "
            f"first {r['rss_first_bytes'] / mib:7.1f} mid {r['rss_mid_bytes'] / mib:7.1f} "
            f"last {r['rss_last_bytes'] / mib:7.1f}  slope(2nd half) {r['slope_bytes_per_step']:9.0f} B/step  {verdict}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", action="append", choices=["cuda", "mlx"])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--leak-bytes", type=int, default=0)
    ap.add_argument("--leak-steps", type=int, default=500, help="steps of the planted-leak run (0: none)")
    a = ap.parse_args()
    backends = a.backend or [b for b, mod in (("cuda", "torch"), ("mlx", "mlx")) if importlib.util.find_spec(mod)]
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    for b in backends:
        path = out / f"soak_{b}_cpu.txt"
        path.write_text(f"# python benchmarks/soak.py --backend {b} (CPU, {os.cpu_count()} cores)\n")
        runs = [(a.steps, a.leak_bytes)] + ([(a.leak_steps, 262144)] if a.leak_steps and not a.leak_bytes else [])
        for steps, leak in runs:  # the planted leak: 256 KiB a step
            text = line(soak(b, steps, leak))
            print(text, flush=True)
            with path.open("a") as f:  # row by row: a run cut short keeps what it measured
                f.write(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
