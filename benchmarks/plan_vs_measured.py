"""Predicted vs measured peak memory on the MLX backend (CPU or Apple GPU).

    python benchmarks/plan_vs_measured.py            # the full grid (~2-4 min on 2 CPU cores)
    python benchmarks/plan_vs_measured.py --quick    # a handful of points

For each configuration: `finetune mode=plan` arithmetic (no weights) against the MLX allocator's
measured peak (mx.get_peak_memory over the run, after load, through 3 optimizer steps). Prints
one row per configuration and the worst relative error. MLX is measured because its allocator
counts every byte the computation holds; on CPU torch there is no allocator to read.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

GIB = 1 << 30
MODELS = {
    "tiny": [],
    "small": ["model.config.hidden_size=256", "model.config.num_hidden_layers=4", "model.config.num_attention_heads=8",
              "model.config.num_key_value_heads=2", "model.config.intermediate_size=704", "model.config.vocab_size=2048"],
}


def long_texts(path: Path, n: int = 300) -> Path:
    """Records longer than any seq_len in the grid, so every sample is exactly seq_len tokens
    (the planner plans for full-length micro-batches, the worst case a run meets)."""
    import json

    from finetune.synthetic import generate

    recs = generate(n * 12, seed=7)
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(r["prompt"] + r["completion"] for r in recs[i * 12:(i + 1) * 12])}) + "\n")
    return path


def measure(overrides: list[str]) -> tuple[int, int]:
    from conftest import make_cfg

    from finetune import planner
    from finetune.run.loop import train
    from finetune.resolver import resolve

    with tempfile.TemporaryDirectory() as d:
        data = long_texts(Path(d) / "long.jsonl")
        cfg = make_cfg(Path(d) / "run", "backend=mlx", "train.steps=3", "train.eval_every=0", "train.progress=false",
                       "data=jsonl", f"data.path={data}", "memory.adapt=false", *overrides)
        spec = resolve(cfg)
        predicted = planner.plan(spec)["peak_bytes"]
        summary = train(spec)
    return int(predicted), int(summary["memory"]["peaks"]["allocated_bytes"])


def grid(quick: bool) -> list[tuple[str, list[str]]]:
    points = []
    batches, seqs, ranks, layers, ckpt = ([1, 8], [64, 256], [8], [-1, 1], [False, True]) if quick else \
        ([1, 4, 16], [64, 256], [4, 32], [-1, 1], [False, True])
    for model, b, t, r, n, c in itertools.product(MODELS, batches, seqs, ranks, layers, ckpt):
        if quick and model == "small" and b == 8:
            continue
        o = MODELS[model] + [f"train.batch_size={b}", f"train.seq_len={t}", f"method.lora.rank={r}",
                             f"method.lora.num_layers={n}", f"train.grad_checkpointing={str(c).lower()}"]
        points.append((f"{model} b={b} T={t} r={r} layers={n} ckpt={int(c)}", o))
    for model, m in itertools.product(MODELS, ["full", "dora"]):
        points.append((f"{model} method={m} b=4 T=128", MODELS[model] + [f"method={m}", "train.batch_size=4", "train.seq_len=128"]))
    return points


def measure_fresh(overrides: list[str]) -> tuple[int, int]:
    """Measure in a fresh process: MLX's peak counter and its buffers are process-wide, so a
    previous configuration's arrays would otherwise count in this one's peak."""
    import json
    import subprocess

    r = subprocess.run([sys.executable, __file__, "--one", json.dumps(overrides)], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    p, m = json.loads(r.stdout.strip().splitlines()[-1])
    return int(p), int(m)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one configuration, JSON list of overrides
    a = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    if a.one:
        import contextlib
        import io
        import json

        with contextlib.redirect_stderr(io.StringIO()):
            p, m = measure(json.loads(a.one))
        print(json.dumps([p, m]))
        return 0
    rows, worst = [], 0.0
    print(f"{'configuration':52s} {'predicted MiB':>14s} {'measured MiB':>13s} {'error':>8s}")
    for name, o in grid(a.quick):
        p, m = measure_fresh(o)
        err = (p - m) / m
        worst = max(worst, abs(err))
        rows.append((name, p, m, err))
        print(f"{name:52s} {p / 2**20:14.2f} {m / 2**20:13.2f} {err:+8.1%}", flush=True)
    print(f"worst |error| over {len(rows)} configurations: {worst:.1%} (target: under 10%)")
    return 0 if worst < 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
