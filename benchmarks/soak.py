"""Leak watch: 2,000 optimizer steps on the tiny model on each backend, and the trend of the
process's memory over them. A leak is a steady climb: the least-squares slope (bytes per step)
over the second half of the run, after allocator caches and lazy state settle.

    python benchmarks/soak.py --backend mlx        # 2,000 steps, then 500 with the planted leak
    python benchmarks/soak.py --backend cuda
    python benchmarks/soak.py --steps 500 --leak-bytes 262144   # the planted leak alone

What grows by design is measured and taken out before judging, each term printed:

- ``timeline``: the Accountant's samples (memory.sample_every=1: an optimizer sample a step,
  plus the forward/backward ones memory.phase_every keeps on mlx; torch on CPU has no
  allocator to read inside a step), kept for summary.json and memory.png, bounded by ``max_samples``
  (20,000; past it older samples are thinned). Its bytes are measured in place at mid-run and
  at the last step (every object reachable from the timeline as the run holds it, inner
  samples still as raw records, ``sys.getsizeof``, each object once) and spread over the
  sample count at each step. That is the objects' own bytes: the allocator's rounding and
  pool slack are not in it, a few hundred B/step either way on these runs.
- ``heap_free``: bytes glibc's malloc holds free for reuse (``mallinfo2().fordblks``; Linux
  glibc only, else not subtracted and said so). Freed buffers stay resident there and their
  amount swings by ~10 MiB over hundreds of steps as MLX's buffer cache evicts and refills,
  which alone tilts a 1,000-step RSS slope by a few KiB/step either way.
- ``mlx_cache``: MLX's buffer cache (``mx.get_cache_memory()``), bounded by its cache limit.

``net = RSS - timeline - heap_free - mlx_cache`` is judged: above LEAK_BYTES_PER_STEP it is
flagged. Why these terms: the first mlx soak's raw RSS slope (6.4 KiB/step, flagged) was, by
tracemalloc between steps 500 and 2,000, 3.7 KB/step of Python objects in the timeline plus
~180 B/step in the Accountant's per-step counter (unbounded; fixed since), with MLX's active
memory flat (0.47 MB) and its cache at its 32 MiB limit from step 100; the rest was the free
heap's swing (RSS minus heap_free, the timeline trimmed, rose 0.3 MiB in 1,800 steps). At its
bound the timeline holds 20,000 samples: 37-50 MiB at the 1.9-2.6 KB a sample measured here. --leak-bytes N turns on the test-only switch FINETUNE_FAULT_LEAK_BYTES (finetune/run/faults.py
keeps an N-byte array alive per step), which must be flagged with about N bytes/step. RSS is
read by this script from /proc after each step's optimizer sample (the run's own metrics
repeat a reading between fresh ones). Writes benchmarks/results/soak_<backend>.txt. Measures,
never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib.util
import os
import platform
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LEAK_BYTES_PER_STEP = 4096  # flagged above this net slope: 2,000 steps would keep >8 MiB
PLANTED_BYTES = 262144  # the planted-leak run: 256 KiB a step
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_free_reader() -> Any:
    """A function returning glibc malloc's free bytes (all arenas), or None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return lambda: int(fn().fordblks)


def deep_bytes(root: Any) -> int:
    """sys.getsizeof of every object reachable from ``root`` through dicts, lists and tuples,
    each object once (keys shared by every sample count once, as they are stored once)."""
    seen: set[int] = set()
    stack, total = [root], 0
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
    return total


@contextlib.contextmanager
def watched(rows: list[dict[str, Any]], heap_free: Any, weigh_at: set[int]) -> Iterator[None]:
    """Run ``finetune.run.loop.train`` as it is, with one reading after each optimizer sample: the
    loop's Trainer is swapped for a subclass whose setup() wraps its Accountant's sample()
    (the loop has no per-step observer; this keeps its connect, run log and cleanup as they
    are). At the steps in ``weigh_at`` the timeline's bytes are measured too."""
    from finetune.run import loop

    plain = loop.Trainer

    class Watched(plain):  # type: ignore[misc, valid-type]
        def setup(self) -> None:
            super().setup()
            acct = self.acct
            take = acct.sample

            def sample(step: int, phase: str) -> dict[str, Any] | None:
                s = take(step, phase)
                if phase == "optimizer" and s is not None:
                    # index: the sample's place in the timeline, so index + 1 samples are held
                    rows.append({"step": step, "rss": rss_bytes(), "samples": s["index"] + 1,
                                 "heap_free": heap_free() if heap_free else None, "mlx_cache": s.get("mlx_cache")})
                    if step in weigh_at:
                        # read in place: acct.samples would build the raw inner samples into
                        # dicts, which the run itself does only at its end
                        rows[-1]["timeline_bytes"] = deep_bytes(acct._timeline)
                return s

            acct.sample = sample

    loop.Trainer = Watched
    try:
        yield
    finally:
        loop.Trainer = plain


def soak(backend: str, steps: int, leak_bytes: int) -> dict[str, Any]:
    from finetune.config import compose
    from finetune.run.loop import train
    from finetune.resolver import resolve

    if leak_bytes:
        os.environ["FINETUNE_FAULT_LEAK_BYTES"] = str(leak_bytes)
    else:
        os.environ.pop("FINETUNE_FAULT_LEAK_BYTES", None)
    rows: list[dict[str, Any]] = []
    heap_free = _heap_free_reader()
    mid = steps // 2 + 1  # the second half's first step
    with tempfile.TemporaryDirectory() as d, watched(rows, heap_free, {mid, steps}):
        train(resolve(compose(Path(d) / "run", f"backend={backend}", f"train.steps={steps}", "train.eval_every=0",
                      "train.progress=false", "data.num_samples=400", "train.schedule=constant",
                      "memory.sample_every=1")))
    os.environ.pop("FINETUNE_FAULT_LEAK_BYTES", None)
    half = [r for r in rows if r["step"] >= mid]
    first, last = half[0], half[-1]
    per_sample = (last["timeline_bytes"] - first["timeline_bytes"]) / max(1, last["samples"] - first["samples"])
    xs = [r["step"] for r in half]
    terms = {"rss": [r["rss"] for r in half],
             "timeline": [first["timeline_bytes"] + (r["samples"] - first["samples"]) * per_sample for r in half],
             "heap_free": [r["heap_free"] or 0 for r in half], "mlx_cache": [r["mlx_cache"] or 0 for r in half]}
    net = [r - t - h - c for r, t, h, c in zip(*terms.values())]
    slopes = {k: slope(xs, v) for k, v in terms.items()}
    s_net = slope(xs, net)
    return {"backend": backend, "steps": steps, "planted_leak_bytes_per_step": leak_bytes,
            "rss_first_bytes": rows[0]["rss"], "rss_mid_bytes": half[0]["rss"], "rss_last_bytes": rows[-1]["rss"],
            "net_mid_bytes": net[0], "net_last_bytes": net[-1],
            "timeline_samples": last["samples"], "timeline_bytes": last["timeline_bytes"],
            "timeline_bytes_per_sample": per_sample,
            "heap_free_known": heap_free is not None,
            **{f"slope_{k}_bytes_per_step": v for k, v in slopes.items()},
            "slope_net_bytes_per_step": s_net, "leak": s_net > LEAK_BYTES_PER_STEP}


def line(r: dict[str, Any]) -> str:
    mib = 2**20
    s = {k: r[f"slope_{k}_bytes_per_step"] for k in ("rss", "timeline", "heap_free", "mlx_cache", "net")}
    if r["leak"]:
        verdict = f"LEAK flagged: {s['net'] / 1024:.1f} KiB/step"
        if r["planted_leak_bytes_per_step"]:
            verdict += f" ({s['net'] / r['planted_leak_bytes_per_step']:.2f}x the planted {r['planted_leak_bytes_per_step']} B/step)"
    else:
        verdict = f"no leak (net {s['net']:.0f} B/step <= {LEAK_BYTES_PER_STEP} B/step)"
    heap = "" if r["heap_free_known"] else " (heap_free unknown off glibc: not subtracted)"
    return (f"{r['backend']:5s} steps={r['steps']:5d} planted={r['planted_leak_bytes_per_step']:7d} B/step  "
            f"RSS MiB first {r['rss_first_bytes'] / mib:6.1f} mid {r['rss_mid_bytes'] / mib:6.1f} "
            f"last {r['rss_last_bytes'] / mib:6.1f}  net MiB mid {r['net_mid_bytes'] / mib:6.1f} "
            f"last {r['net_last_bytes'] / mib:6.1f}\n"
            f"      slopes over the 2nd half, B/step: rss {s['rss']:8.0f} - timeline {s['timeline']:6.0f} "
            f"({r['timeline_samples']} samples, {r['timeline_bytes'] / mib:.1f} MiB, {r['timeline_bytes_per_sample']:.0f} "
            f"B each) - heap_free "
            f"{s['heap_free']:7.0f} - mlx_cache {s['mlx_cache']:5.0f} = net {s['net']:8.0f}{heap}\n"
            f"      {verdict}")


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"python {platform.python_version()}"]
    for pkg in ("torch", "transformers", "peft", "mlx", "mlx-lm"):
        try:
            parts.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            pass
    libc = " ".join(platform.libc_ver())
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, check=False,
                          capture_output=True, text=True).stdout.strip() or "unknown"
    return (", ".join(parts) + f"; {platform.system()} {platform.machine()}, {libc}, {os.cpu_count()} CPU cores; "
            f"at commit {head}")


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
        path = out / f"soak_{b}.txt"
        cmd = " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]])
        path.write_text(f"# {cmd}\n# {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {versions()}\n"
                        f"# backend={b} on CPU; net = RSS - timeline - heap_free - mlx_cache (see the docstring); "
                        f"flagged above {LEAK_BYTES_PER_STEP} B/step\n")
        runs = [(a.steps, a.leak_bytes)] + ([(a.leak_steps, PLANTED_BYTES)] if a.leak_steps and not a.leak_bytes else [])
        for steps, leak in runs:
            text = line(soak(b, steps, leak))
            print(text, flush=True)
            with path.open("a") as f:  # row by row: a run cut short keeps what it measured
                f.write(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
