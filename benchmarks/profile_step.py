"""Where a training step's time goes on each backend, and what train.compile buys.

    python benchmarks/profile_step.py                              # profile + phases + compile, both backends
    python benchmarks/profile_step.py --parts profile --backends mlx --steps 100
    python benchmarks/profile_step.py --parts compile --repeats 5 --pads 0,32 --threads default,1

Three parts, each on the default job (LoRA on the tiny model, micro-batch 4, one micro-batch per
optimizer step) through the real CLI unless said otherwise:

1. profile: ``py-spy record --idle`` samples a fresh ``python -m finetune`` run from outside (no
   overhead inside the process; --idle so time the main thread spends waiting, e.g. in
   ``mx.eval`` for MLX's CPU stream thread, counts as wall time). Each sample of the main thread
   inside the loop's ``for step`` body is put in one bucket by its stack: framework
   (forward, backward, optimizer, MLX's evaluation), host reads (``float()`` of a device value),
   ours (loop, accountant, governor, run log, backend glue), data (batch assembly, host to
   device), evaluation, checkpoints. Then the top frames by self and by total time in that body.
   py-spy sees Python frames only: time inside a framework call is charged to the Python line
   that made it, which is what the buckets are keyed on.
2. phases: in one process, the framework's own split of a step, timed around each call: cuda
   from the backend's phase hook (forward ends where it reports "forward", backward where it
   reports "backward"); MLX fuses forward and backward in one evaluation, so its forward is
   timed alone on the same micro-batch first (an extra forward, not part of the step).
3. compile: ``train.compile=false`` against ``true`` in fresh processes, alternating which goes
   first, ``--repeats`` pairs per backend and ``train.pad_multiple`` (0: the default, 1 on CPU,
   so every new length is a new shape; 32: shapes repeat), each with its own compiler cache dir
   (TORCHINDUCTOR_CACHE_DIR, TMPDIR for MLX's CPU kernels): the first compiled run of a
   configuration compiles cold, the others find their kernels cached, as a user's second run
   would. Real tokens/s is sum(tokens) / sum(step_seconds) from metrics.jsonl after the first
   ``--warmup`` steps; compile time is the extra time of those first steps over the uncompiled
   runs' median. Medians; the ratio compiled / uncompiled is printed.

``--threads default,1`` runs each part with torch's own intra-op pool (one thread per core) and
with ``OMP_NUM_THREADS=1``: on a 2-core machine that other jobs load, a 2-thread OpenMP pool
waits at every parallel region for a thread the scheduler has taken away, and a cuda-backend
step on the CPU goes from ~10 ms to ~800 ms (measured here, 2026-12-01); one thread keeps it
near 10 ms. py-spy itself takes CPU: its default rate here is 200 Hz.

Printed, never asserted. On a shared machine the figures move with the neighbours' load: the
header gives the load average at start and end.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import linecache
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BASE = ["train.progress=false"]  # the default job otherwise


# ---- header ---------------------------------------------------------------------------------
def _version(mod: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(mod)
    except metadata.PackageNotFoundError:
        return "absent"


def header(argv: list[str]) -> list[str]:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return [f"# python benchmarks/profile_step.py {' '.join(argv)}",
            f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}; {platform.platform()}; {cpu}; "
            f"{os.cpu_count()} CPUs; load average at start {load}"
            + (" (shared: other jobs were running)" if os.getloadavg()[0] > 0.5 else ""),
            (f"# python {platform.python_version()}; torch {_version('torch')}; transformers {_version('transformers')}; "
            f"peft {_version('peft')}; mlx {_version('mlx')}; mlx-lm {_version('mlx-lm')}; py-spy {_version('py-spy')}")]


# ---- part 1: the sampling profile -------------------------------------------------------------
def _loop_body_lines() -> tuple[int, int]:
    """Lines of ``for step in ...`` inside Trainer.train (finetune/run/loop.py): a sample whose
    Trainer.train frame is on one of them is inside a step, else start-up or run end."""
    src = (REPO / "finetune" / "loop.py").read_text()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == "train" and any(
                isinstance(n, ast.For) for n in node.body):
            loop = next(n for n in node.body if isinstance(n, ast.For))
            return loop.lineno, loop.end_lineno or loop.lineno
    raise SystemExit("profile: Trainer.train's step loop not found in finetune/run/loop.py")


def _frame(text: str) -> tuple[str, str, int]:
    """'func (path:line)' -> (func, path, line)."""
    func, _, where = text.rpartition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    try:
        return func, path, int(line)
    except ValueError:
        return text, "", 0


def _source(path: str, line: int) -> str:
    """The source text py-spy's short path and line point at (ours: from the checkout)."""
    for base in (REPO, *map(Path, filter(None, sys.path))):
        f = base / path
        if f.is_file():
            return linecache.getline(str(f), line).strip()
    return ""


OURS_FILES = ("finetune/", "backends/")
FRAMEWORK = ("torch/", "mlx/", "transformers/", "peft/", "mlx_lm/", "nn/", "optimizers/", "bitsandbytes/")


def classify(frames: list[tuple[str, str, int]]) -> str:
    """The bucket of one sample inside the step loop (frames root first, from Trainer.train on)."""
    funcs = [f for f, _, _ in frames]
    paths = [p for _, p, _ in frames]

    def has(name: str) -> bool:
        return any(f == name or f.endswith("." + name) for f in funcs)

    if has("Trainer.evaluate"):
        return "evaluation|every train.eval_every steps"
    if has("Checkpointer.save"):
        return "checkpoint|train.save_every"
    if has("Trainer._calibrate"):
        return "ours|planner calibration (step 1)"
    if any(p.startswith("finetune/accounting/") for p in paths):
        return "ours|accountant (memory samples, census)"
    if any(p in ("finetune/run/log.py", "finetune/loggers.py") for p in paths):
        return "ours|run log (metrics.jsonl, progress)"
    if any(p == "finetune/run/governor.py" for p in paths):
        return "ours|governor"
    if any(p.startswith("finetune/data/") or p in ("finetune/data/cache.py", "backends/base.py") for p in paths) or has("rank_slice"):
        return "data|batch assembly (finetune/data/, Batch.split)"
    if has("MlxBackend._arrays"):
        return "data|host to device (arrays)"
    leaf_func, leaf_path, leaf_line = frames[-1]
    text = _source(leaf_path, leaf_line) if leaf_path.startswith(OURS_FILES) else ""
    if leaf_func == "CudaBackend._loss_sum" or has("CudaBackend._to_device"):
        return "data|host to device (tensors)"
    if has("CudaBackend.optimizer_step") or has("MlxBackend.optimizer_step"):
        if leaf_func.endswith("optimizer_step") and text.startswith("return") and "float(" in text:
            return "host reads|float(grad norm), once per step"
        if leaf_func.endswith("optimizer_step") and "mx.eval" in text:
            return "framework|optimizer: clip + update (mx.eval)"
        return "framework|optimizer: clip + update"
    if has("CudaBackend.forward_backward") or has("MlxBackend.forward_backward"):
        if has("Tensor.backward") or any(p.startswith("torch/autograd/") for p in paths):
            return "framework|backward"
        if has("token_loss_sum"):
            return ("framework|forward" if has("CudaBackend.forward_backward")
                    else "framework|forward + backward: graph build (Python)")
        if has("wrapped_value_grad_fn") or has("value_and_grad"):
            return "framework|forward + backward: graph build (Python)"
        if has("compile_wrapper") or any(p.startswith("torch/_dynamo/") for p in paths):
            return "framework|forward (torch.compile)"
        if leaf_func.endswith("forward_backward"):
            if "mx.eval" in text:
                return "framework|forward + backward: compute (mx.eval)"
            if "float(" in text:
                return "host reads|float(loss), once per micro-batch"
            if ".backward()" in text:
                return "framework|backward"
        if has("tree_map"):
            return "framework|grad accumulation (graph build)"
        if has("MlxBackend._reseed"):
            return "ours|backend glue (RNG reseed, calls)"
        return "ours|backend glue (RNG reseed, calls)"
    if leaf_path.startswith(OURS_FILES):
        return "ours|loop (loop.py: lr, stop checks, bookkeeping)"
    if (has("Trainer._train_step") or has("Trainer.train")) and (
            any(p.startswith(FRAMEWORK) for p in paths) or "omegaconf/" in leaf_path):
        return "ours|loop (loop.py: lr, stop checks, bookkeeping)"
    return f"other|{frames[-1][0]} ({frames[-1][1]})"


def _phase_outside(frames: list[tuple[str, str, int]]) -> str:
    """What a sample outside the step loop was doing: the call below finetune.run.loop.train (or
    below Trainer.train, before or after its loop), else the imports and the CLI around it."""
    names = [f for f, _, _ in frames]
    if not any(names):
        return "no Python frame (interpreter start and exit)"
    if any(f == "Thread._bootstrap" for f in names):
        return "BACKGROUND"
    if "Trainer.train" in names:
        i = names.index("Trainer.train")
        return f"run start/end: {names[i + 1] if i + 1 < len(names) else 'Trainer.train'}"
    for i, (f, p, _) in enumerate(frames):
        if f == "train" and p == "finetune/run/loop.py":
            return f"run setup: {names[i + 1] if i + 1 < len(names) else 'train'}"
    if any(f.startswith("_find_and_load") for f in names):
        return "imports (before the run)"
    ours = [f"{f} ({p})" for f, p, _ in frames if p.startswith(OURS_FILES)]
    return f"other: {ours[-1] if ours else names[-1]}"


def _env(threads: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads  # torch's intra-op pool (and inductor's OpenMP kernels)
    return env


def run_pyspy(backend: str, steps: int, rate: int, work: Path, extra: list[str], threads: str) -> Path:
    if shutil.which("py-spy") is None:
        raise SystemExit("profile: py-spy is not installed (pip install py-spy)")
    run_dir, raw = work / f"profile_{backend}_{threads}", work / f"profile_{backend}_{threads}.raw"
    cmd = ["py-spy", "record", "--idle", "-r", str(rate), "--format", "raw", "-o", str(raw), "--",
           sys.executable, "-m", "finetune", f"backend={backend}", f"train.steps={steps}",
           f"hydra.run.dir={run_dir}", *BASE, *extra]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=work, env=_env(threads))
    if p.returncode != 0 or not raw.is_file():
        raise SystemExit(f"profile {backend} failed ({' '.join(cmd)}):\n{p.stderr[-3000:]}")
    return raw


def analyse(raw: Path, rate: int, steps: int, top: int) -> list[str]:
    lo, hi = _loop_body_lines()
    buckets: collections.Counter = collections.Counter()
    self_t: collections.Counter = collections.Counter()
    total_t: collections.Counter = collections.Counter()
    outside = start_end = 0
    outside_t: collections.Counter = collections.Counter()  # our frames, outside the step loop
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        at = [i for i, (f, p, _) in enumerate(frames) if f == "Trainer.train" and p == "finetune/run/loop.py"]
        i = at[0] if at else None
        if i is None or not lo <= frames[i][2] <= hi:
            if i is None:
                outside += n
            else:
                start_end += n
            outside_t[_phase_outside(frames)] += n
            continue
        body = frames[i:]
        bucket = classify(body)
        buckets[bucket] += n
        if bucket.startswith(("evaluation", "checkpoint")):
            continue
        self_t[f"{body[-1][0]} ({body[-1][1]}:{body[-1][2]})"] += n
        for f in {f"{f} ({p})" for f, p, _ in body[1:]}:
            total_t[f] += n
    step_n = sum(v for k, v in buckets.items() if not k.startswith(("evaluation", "checkpoint")))
    ms = lambda n: n / rate * 1e3 / steps
    background = outside_t.pop("BACKGROUND", 0)  # other threads' samples: --idle counts their waits too
    outside -= background
    out = [(f"samples at {rate} Hz of the main thread: {outside + start_end + sum(buckets.values())}; outside the "
           f"step loop {outside + start_end}, inside it {sum(buckets.values())} (and {background} of other, "
           "mostly waiting, threads: left out)"),
           f"step loop without evaluation: {ms(step_n):.1f} ms per optimizer step ({steps} steps)",
           f"  {'group':<11} {'bucket':<52} {'ms/step':>8} {'share':>7}"]
    groups: collections.Counter = collections.Counter()
    for k, v in buckets.items():
        groups[k.split("|")[0]] += v
    order = ["framework", "host reads", "ours", "data", "other", "evaluation", "checkpoint"]
    for g in sorted(groups, key=lambda g: order.index(g) if g in order else 99):
        for k, v in sorted(((k, v) for k, v in buckets.items() if k.split("|")[0] == g), key=lambda kv: -kv[1]):
            share = f"{v / step_n:6.1%}" if g not in ("evaluation", "checkpoint") else "   n/a"
            out.append(f"  {g:<11} {k.split('|', 1)[1]:<52} {ms(v):8.2f} {share}")
        if g not in ("evaluation", "checkpoint"):
            out.append(f"  {g:<11} {'= all ' + g:<52} {ms(groups[g]):8.2f} {groups[g] / step_n:6.1%}")
    out.append(f"  outside the step loop, {(outside + start_end) / rate:.1f} s of the main thread:")
    out += [f"    {v / rate:6.2f} s  {k}" for k, v in outside_t.most_common(8)]
    out.append(f"  top {top} frames by self time (the leaf of a sample) in the step loop, evaluation excluded:")
    out += [f"    {v / step_n:6.1%}  {k}" for k, v in self_t.most_common(top)]
    out.append(f"  top {top} frames by total time (on the stack), Trainer.train excluded:")
    out += [f"    {v / step_n:6.1%}  {k}" for k, v in total_t.most_common(top)]
    return out


# ---- part 2: the framework's own split, in process ---------------------------------------------
def phases_worker(backend: str, steps: int) -> dict[str, Any]:
    from finetune.backends.runtimes import get_backend
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from finetune import data as data_mod
    from finetune.config import Config
    from finetune.model.source import resolve_model_dir
    from finetune.resolver import resolve

    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.backend.name = backend
    model_dir = resolve_model_dir(cfg.model)
    spec = resolve(cfg)  # what the CLI hands the backends
    b = get_backend(backend)
    b.setup(spec, model_dir)
    src, _ = data_mod.build(spec, AutoTokenizer.from_pretrained(str(model_dir)))
    t: dict[str, list[float]] = collections.defaultdict(list)
    for j in range(steps + 3):
        batch = src.train_batch(j)
        scale = 1.0 / batch.label_tokens
        f = fb = opt = 0.0
        for micro in batch.split(cfg.train.batch_size):
            if backend == "mlx":
                import mlx.core as mx

                ids, mask = b._arrays(micro)
                t0 = time.perf_counter()
                mx.eval(b._loss(ids, mask, scale)[1])  # the forward alone, in train mode
                f += time.perf_counter() - t0
                t0 = time.perf_counter()
                b.forward_backward(micro, scale)
                fb += time.perf_counter() - t0
            else:
                marks: dict[str, float] = {}
                t0 = time.perf_counter()
                b.forward_backward(micro, scale, lambda ph, m=marks: m.__setitem__(ph, time.perf_counter()))
                end = time.perf_counter()
                f += marks["forward"] - t0
                fb += end - t0
        t0 = time.perf_counter()
        b.optimizer_step(cfg.optim.lr)
        opt = time.perf_counter() - t0
        if j >= 3:  # warm-up: the first steps allocate the optimizer state and the caches
            t["forward"].append(f)
            t["backward"].append(fb - f)
            t["optimizer"].append(opt)
    return {k: statistics.median(v) * 1e3 for k, v in t.items()}


def phases(backends: list[str], steps: int, threads_list: list[str]) -> list[str]:
    out = [f"framework split, in process, medians over {steps} steps after 3 of warm-up (ms per optimizer step):",
           f"  {'backend':<8} {'threads':>7} {'forward':>8} {'backward':>9} {'optimizer':>10}   how"]
    for threads, backend in ((t, b) for t in threads_list for b in backends):
        p = subprocess.run([sys.executable, __file__, "--phases-worker", backend, "--steps", str(steps)],
                           check=False, capture_output=True, text=True, env=_env(threads))
        if p.returncode != 0:
            raise SystemExit(f"phases {backend} failed:\n{p.stderr[-2000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        how = ("phase hook: forward ends at on_phase('forward')" if backend == "cuda" else
               "forward timed alone first (mx.eval of the loss); backward = forward_backward - that")
        out.append(f"  {backend:<8} {threads:>7} {r['forward']:8.2f} {r['backward']:9.2f} {r['optimizer']:10.2f}   {how}")
    return out


# ---- part 3: compiled against not ----------------------------------------------------------------
def compile_run(backend: str, compile_: bool, pad: int, steps: int, run_dir: Path, cache: Path,
                threads: str) -> dict[str, Any]:
    env = _env(threads, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TMPDIR=str(cache / "tmp"))
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "finetune", f"backend={backend}", f"train.steps={steps}", "train.eval_every=0",
           f"train.compile={str(compile_).lower()}", f"train.pad_multiple={pad}", f"hydra.run.dir={run_dir}", *BASE]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=run_dir.parent)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"compile run failed ({' '.join(cmd)}):\n{p.stderr[-3000:]}")
    recs = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    return {"recs": recs, "wall": wall}


def compile_part(backends: list[str], pads: list[int], repeats: int, steps: int, warmup: int,
                 threads_list: list[str], work: Path) -> list[str]:
    out = [(f"train.compile: fresh processes, alternating order, {repeats} pairs per row, {steps} steps, "
           f"eval off; tokens/s after the first {warmup} steps (real tokens, metrics.jsonl)"),
           (f"  {'backend':<7} {'pad':>4} {'threads':>7} {'tok/s off':>10} {'tok/s on':>10} {'on/off':>7} "
           f"{'compile cold s':>15} {'compile warm s':>15} {'max |dloss|':>12} {'runs (off|on tok/s)'}")]
    for threads in threads_list:
        for backend in backends:
            for pad in pads:
                cache = work / f"cache_{backend}_{pad}_{threads}"
                got: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
                for i in range(repeats):
                    for c in ((False, True) if i % 2 == 0 else (True, False)):
                        run_dir = work / f"c_{backend}_{pad}_{threads}_{int(c)}_{i}"
                        got[c].append(compile_run(backend, c, pad, steps, run_dir, cache, threads))
                        print(f"compile {backend} pad={pad} threads={threads} compile={c} run {i + 1}/{repeats}: "
                              f"{got[c][-1]['wall']:.0f} s", file=sys.stderr)

                def tps(r: dict[str, Any]) -> float:
                    tail = r["recs"][warmup:]
                    return sum(x["tokens"] for x in tail) / sum(x["step_seconds"] for x in tail)

                def head_s(r: dict[str, Any]) -> float:
                    return sum(x["step_seconds"] for x in r["recs"][:warmup])

                off, on = [tps(r) for r in got[False]], [tps(r) for r in got[True]]
                base = statistics.median(head_s(r) for r in got[False])
                cold = head_s(got[True][0]) - base  # the first compiled run met an empty cache
                warm = statistics.median(head_s(r) for r in got[True][1:]) - base if repeats > 1 else float("nan")
                dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(got[False][0]["recs"], got[True][0]["recs"]))
                ratio = statistics.median(on) / statistics.median(off)
                runs = " ".join(f"{a:.0f}" for a in off) + " | " + " ".join(f"{a:.0f}" for a in on)
                out.append(f"  {backend:<7} {pad:>4} {threads:>7} {statistics.median(off):10.0f} "
                           f"{statistics.median(on):10.0f} {ratio:6.2f}x {cold:15.1f} {warm:15.1f} {dloss:12.2e} {runs}")
    out.append(f"  pad: train.pad_multiple (0 = default: 1 on CPU, every new length a new shape); threads: "
               f"OMP_NUM_THREADS (default: torch's own, one per core); compile cold/warm: extra seconds in the "
               f"first {warmup} steps over the uncompiled median, with an empty / a filled compiler cache; "
               f"max |dloss|: largest difference of a step's loss, first pair")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="profile,phases,compile", help="comma-separated: profile, phases, compile")
    ap.add_argument("--backends", default="cuda,mlx")
    ap.add_argument("--steps", type=int, default=50, help="profile and phases: optimizer steps")
    ap.add_argument("--rate", type=int, default=200, help="profile: py-spy samples per second")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3, help="compile: pairs of runs per row")
    ap.add_argument("--compile-steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10, help="compile: first steps left out of tokens/s")
    ap.add_argument("--pads", default="0,32", help="compile: train.pad_multiple values")
    ap.add_argument("--threads", default="default",
                    help="OMP_NUM_THREADS values each part runs under, e.g. default,1 (default: torch's own, one per core)")
    ap.add_argument("--phases-worker", help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="profile: more overrides for the profiled runs")
    args = ap.parse_args()
    if args.phases_worker:
        print(json.dumps(phases_worker(args.phases_worker, args.steps)))
        return
    backends, parts = args.backends.split(","), args.parts.split(",")
    lines = header(sys.argv[1:])
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory(prefix="profile_step_") as tmp:
        work = Path(tmp)
        threads_list = args.threads.split(",")
        if "profile" in parts:
            for threads, backend in ((t, b) for t in threads_list for b in backends):
                raw = run_pyspy(backend, args.steps, args.rate, work, args.extra, threads)
                block = [(f"\n== profile: backend={backend}, default job, {args.steps} steps, threads={threads} "
                         f"(py-spy --idle -r {args.rate}; overrides: {' '.join(BASE + args.extra)})")]
                block += analyse(raw, args.rate, args.steps, args.top)
                print("\n".join(block), flush=True)
        if "phases" in parts:
            print("\n== phases\n" + "\n".join(phases(backends, args.steps, threads_list)), flush=True)
        if "compile" in parts:
            block = compile_part(backends, [int(p) for p in args.pads.split(",")], args.repeats,
                                 args.compile_steps, args.warmup, threads_list, work)
            print("\n== compile\n" + "\n".join(block), flush=True)
    print(f"\n# load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
