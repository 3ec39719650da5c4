"""Chunked loss on and off, side by side: peak memory and step time of a large-vocabulary step.

The model is the built-in tiny Qwen2 body (hidden 64, 2 layers) with Qwen2's vocabulary size,
151,936, tied, so the logits dominate the step: one micro-batch of 2 x 257 tokens has 512
targets and 512 x 151,936 x 4 B = 297 MiB of fp32 logits, against about a megabyte of the
body's activations (an MLX step of it takes about 7.5 s of one CPU core). A small body is the
worst case for the time overhead (the step is almost all head), and the best case for the
memory saving; a real model sits in between.

Each run is a fresh process that builds the backend with its own setup and
``train.loss_chunk`` = 0 (off) or ``--chunk`` (on) (``CudaBackend`` on the CPU:
torch/transformers/PEFT; ``MlxBackend``: mlx-lm on mlx[cpu]), then runs optimizer steps through
the backend's own ``forward_backward`` and ``optimizer_step``, which compute the loss with
``backends/<name>/loss.py``. Runs alternate off/on, the order flipping every
repeat; medians over the repeats. Figures per run:

- step seconds: median of the timed steps (forward, backward, optimizer) after a warm-up step,
  as wall-clock time and as the process's CPU time. On a shared machine the wall-clock time is
  mostly other people's load; the CPU time, with one compute thread per run (``--threads 1``,
  so no thread spin-waits for a descheduled peer), is the comparable figure, and the one the
  time target is judged on;
- mlx: ``mx.get_peak_memory`` over the timed steps, above the bytes resting before them;
- torch (CPU, no allocator counters): the profiler's allocation records over one extra,
  untimed step (every allocation and free torch makes on the CPU, in order: the running sum's
  maximum above the start is the step's peak), and the bytes of non-parameter storages autograd
  keeps for backward at the end of that step's forward (saved-tensor hooks);
- both: the child process's peak RSS (``os.wait4``'s ``ru_maxrss``), which includes loading.

Targets (issue 14): peak down by at least the logits' share (the drop is at least one logits
tensor's bytes), at most 5% slower. Printed, never asserted.

    python benchmarks/chunked_loss.py                          # both backends, 3 repeats
    python benchmarks/chunked_loss.py --backends mlx --runs 5 --chunk 512
    python benchmarks/chunked_loss.py --mask sft               # prompt half out of the loss
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def _batch(rows: int, cols: int, vocab: int, mask: str):
    import numpy as np
    from finetune.backends.base import Batch

    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, (rows, cols)).astype(np.int32)
    loss_mask = np.ones((rows, cols), np.int8)
    if mask == "sft":  # the first half of every row is the prompt, out of the loss
        loss_mask[:, : cols // 2] = 0
    return Batch(ids, loss_mask, np.full(rows, cols, np.int32))


def _backend(args: argparse.Namespace):
    """The backend built by its own setup, as ``finetune backend=... train.loss_chunk=...`` would."""
    import warnings

    from finetune.backends.runtimes import get_backend
    from omegaconf import OmegaConf

    from finetune.config import Config
    from finetune.resolver import resolve
    from finetune.model.tiny import build_tiny, preset_config

    cfg = Config(run_dir="unused")
    cfg.model.config = {**dict(preset_config("tiny") or ()), "vocab_size": args.vocab}
    cfg.backend.name = args.backend
    if args.backend == "cuda":
        cfg.backend.device = "cpu"
    cfg.method.name = args.method
    cfg.train.loss_chunk = args.chunk
    cfg = OmegaConf.structured(cfg)  # as the CLI composes it
    be = get_backend(args.backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes and PEFT chatter
        be.setup(resolve(cfg), build_tiny(cfg.model))
    return be


def _timed_steps(be, batch, steps: int, warmup: int = 1) -> tuple[list[float], list[float], float]:
    """``warmup`` optimizer steps (the first builds the optimizer state), then ``steps`` timed
    ones: (wall seconds of each, CPU seconds of each (this process, all threads), the last loss
    sum)."""
    wall, cpu, loss = [], [], 0.0
    for i in range(steps + warmup):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = be.forward_backward(batch, 1.0 / batch.label_tokens)
        be.optimizer_step(1e-4)
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return wall, cpu, loss


def child_torch(args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from finetune.backends.cuda.measure import SavedBytes, profiled_peak

    be = _backend(args)
    batch = _batch(args.rows, args.cols, args.vocab, args.mask)
    wall, cpu, loss = _timed_steps(be, batch, args.steps)

    # one more step, untimed, under the profiler's allocation records and saved-tensor hooks
    kept = SavedBytes(be.model)
    saved: list[int] = []

    def on_phase(phase: str) -> None:
        if phase == "forward":  # after forward, before backward: what autograd keeps
            saved.append(kept.bytes)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with kept.hooks():
            be.forward_backward(batch, 1.0 / batch.label_tokens, on_phase)
        be.optimizer_step(1e-4)
    return {"step_s": statistics.median(wall), "cpu_s": statistics.median(cpu), "peak_bytes": profiled_peak(prof),
            "saved_bytes": saved[0], "loss": loss, "targets": batch.label_tokens}


def child_mlx(args: argparse.Namespace) -> dict:
    import mlx.core as mx

    be = _backend(args)
    batch = _batch(args.rows, args.cols, args.vocab, args.mask)
    _timed_steps(be, batch, 0)  # the warm-up step, outside the peak window
    mx.clear_cache()
    mx.reset_peak_memory()
    resting = mx.get_active_memory()
    wall, cpu, loss = _timed_steps(be, batch, args.steps, warmup=0)
    return {"step_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
            "peak_bytes": mx.get_peak_memory() - resting, "saved_bytes": None, "loss": loss,
            "targets": batch.label_tokens}


def run_child(argv: list[str], threads: int) -> tuple[dict, int]:
    """Run this script as a child with ``threads`` compute threads (0: the libraries' default);
    return (its JSON result, its peak RSS bytes)."""
    env = dict(os.environ)
    if threads:
        env.update({k: str(threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    p = subprocess.Popen([sys.executable, __file__, "--child", *argv], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    out = p.stdout.read() if p.stdout else ""
    _, status, ru = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"child failed: {' '.join(argv)}\n{out[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return result, int(ru.ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"python {platform.python_version()}"]
    for name in ("torch", "transformers", "peft", "mlx", "mlx-lm", "liger-kernel"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} absent")
    return ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="cuda,mlx", help="comma-separated: cuda (torch on CPU here), mlx")
    ap.add_argument("--method", default="lora", choices=("lora", "full"))
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen2's vocabulary size")
    ap.add_argument("--rows", type=int, default=2, help="micro-batch")
    ap.add_argument("--cols", type=int, default=257, help="tokens per row (targets: cols - 1)")
    ap.add_argument("--chunk", type=int, default=64, help="train.loss_chunk of the 'on' runs")
    ap.add_argument("--mask", default="all", choices=("all", "sft"),
                    help="all: every token a target; sft: the first half of each row is a prompt out of the loss")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up)")
    ap.add_argument("--runs", type=int, default=3, help="repeats of (off, on), alternating")
    ap.add_argument("--threads", type=int, default=1,
                    help="compute threads per run (OMP/OpenBLAS/MKL); 1 keeps CPU seconds free of spin-waits on a "
                         "shared box; 0 leaves the libraries' default")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child_torch(args) if args.backend == "cuda" else child_mlx(args)
        print(json.dumps(result))
        return

    targets = args.rows * (args.cols - 1) // (2 if args.mask == "sft" else 1)
    logits_bytes = args.rows * (args.cols - 1) * args.vocab * 4
    cmd = " ".join([Path(sys.executable).name, "benchmarks/chunked_loss.py", *sys.argv[1:]])
    print(f"# {cmd}")
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}; {platform.platform()}; {os.cpu_count()} CPUs; "
          f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# {_versions()}")
    print(f"# tiny Qwen2 body (hidden 64, 2 layers), vocab {args.vocab:,} tied, method={args.method}, "
          f"micro-batch {args.rows} x {args.cols} tokens, mask={args.mask} ({targets:,} targets), "
          f"chunk {args.chunk}; {args.runs} repeats x {args.steps} timed steps; "
          f"{args.threads or 'default'} compute thread(s) per run")
    print(f"# full fp32 logits of the micro-batch [B, T-1, V]: {logits_bytes:,} B ({logits_bytes / MIB:.0f} MiB)")
    for backend in args.backends.split(","):
        common = ["--backend", backend, "--method", args.method, "--vocab", str(args.vocab), "--rows", str(args.rows),
                  "--cols", str(args.cols), "--mask", args.mask, "--steps", str(args.steps)]
        runs: dict[int, list[tuple[dict, int]]] = {0: [], args.chunk: []}
        for r in range(args.runs):
            for chunk in ((0, args.chunk) if r % 2 == 0 else (args.chunk, 0)):
                runs[chunk].append(run_child([*common, "--chunk", str(chunk)], args.threads))
        med = {c: {k: (statistics.median(x[0][k] for x in v) if v[0][0][k] is not None else None)
                   for k in ("step_s", "cpu_s", "peak_bytes", "saved_bytes", "loss")} | {"rss": statistics.median(x[1] for x in v)}
               for c, v in runs.items()}
        off, on = med[0], med[args.chunk]
        name = "cuda (torch on CPU)" if backend == "cuda" else "mlx (mlx[cpu])"
        peak_what = "profiler peak allocated" if backend == "cuda" else "mx.get_peak_memory above resting"
        print(f"\n## backend={name}")
        print(f"{'':>24} {'off':>14} {'on (chunk ' + str(args.chunk) + ')':>18} {'on/off':>8}")
        print(f"{'step seconds (wall)':>24} {off['step_s']:>14.3f} {on['step_s']:>18.3f} {on['step_s'] / off['step_s']:>8.3f}")
        print(f"{'step CPU seconds':>24} {off['cpu_s']:>14.3f} {on['cpu_s']:>18.3f} {on['cpu_s'] / off['cpu_s']:>8.3f}")
        print(f"{'peak MiB (' + ('profiler' if backend == 'cuda' else 'mlx') + ')':>24} {off['peak_bytes'] / MIB:>14.1f} "
              f"{on['peak_bytes'] / MIB:>18.1f} {on['peak_bytes'] / off['peak_bytes']:>8.3f}")
        if off["saved_bytes"] is not None:
            print(f"{'kept for backward MiB':>24} {off['saved_bytes'] / MIB:>14.1f} {on['saved_bytes'] / MIB:>18.1f} "
                  f"{on['saved_bytes'] / off['saved_bytes']:>8.3f}")
        print(f"{'process peak RSS MiB':>24} {off['rss'] / MIB:>14.1f} {on['rss'] / MIB:>18.1f} {on['rss'] / off['rss']:>8.3f}")
        print(f"{'loss sum':>24} {off['loss']:>14.4f} {on['loss']:>18.4f}")
        drop = off["peak_bytes"] - on["peak_bytes"]
        slower = on["cpu_s"] / off["cpu_s"] - 1
        slower_wall = on["step_s"] / off["step_s"] - 1
        print(f"target peak drop >= logits ({logits_bytes / MIB:.0f} MiB): {peak_what} dropped {drop / MIB:.0f} MiB "
              f"= {drop / logits_bytes:.2f} x logits: {'met' if drop >= logits_bytes else 'MISSED'}")
        print(f"target at most 5% slower: CPU seconds {slower * 100:+.1f}%: {'met' if slower <= 0.05 else 'MISSED'} "
              f"(wall {slower_wall * 100:+.1f}%, on a shared box)")
        print("per run (chunk: wall s, CPU s, peak MiB, RSS MiB): " + "; ".join(
            f"{c}: " + ", ".join(f"({x[0]['step_s']:.2f}, {x[0]['cpu_s']:.2f}, {x[0]['peak_bytes'] / MIB:.0f}, "
                                 f"{x[1] / MIB:.0f})" for x in v)
            for c, v in runs.items()))
    print(f"\n# load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
