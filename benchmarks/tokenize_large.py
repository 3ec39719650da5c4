"""Tokenizing a large JSONL once, then reusing it: lines/s, peak RSS, cache size, reuse time.

The file is GSM8K's train.jsonl records repeated to ``--lines`` lines (1,000,000 by default,
~560 MB), tokenized with the built-in tiny model's tokenizer (a 512-token BPE trained on the
synthetic data: ~420 tokens a GSM8K record, so this is more tokenizer work a line than a real
vocabulary would do). Each measurement is a fresh process, so its peak RSS is the kernel's
high-water mark of that process alone (``os.wait4``'s ``ru_maxrss``), printed beside the RSS
it had before tokenizing (Python, transformers, the tokenizer loaded):

  cache build    data.prepare with the cache on and empty: streams the file into a new entry
  cache reuse    the same again: hashes the file, checks the entry, memory-maps it
  in memory      data.cache=false: the same streaming code, arrays kept in memory
  pre-cache      load_records + tokenize as data.py had them before the cache (commit
                 PRE_CACHE, read with git show): every record a dict in one list, every sample
                 its own arrays; on ``--old-lines`` lines (100,000 by default: the old path holds
                 the whole file as Python objects and takes as long again as the build)

    python benchmarks/tokenize_large.py                         # 1M lines; pre-cache at 100k
    python benchmarks/tokenize_large.py --lines 100000 --repeats 3   # the comparison, 3 alternating runs
    python benchmarks/tokenize_large.py --file big.jsonl        # your own file
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import itertools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlx_footprint import GSM8K, REPO, _run

PRE_CACHE = "2172553"  # data.py before the token cache: load_records into a list, tokenize into a list
MIB = 2**20


def write_jsonl(path: Path, lines: int) -> Path:
    """GSM8K's records repeated to ``lines`` lines (kept and reused when already that long)."""
    if path.is_file() and sum(1 for _ in path.open("rb")) == lines:
        return path
    src = GSM8K.read_text().splitlines()
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for line in itertools.islice(itertools.cycle(src), lines):
            f.write(line + "\n")
    tmp.replace(path)
    return path


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def child(mode: str, data: Path, cache: Path, seq_len: int) -> None:
    """One measurement in this (fresh) process; prints its figures as one JSON line."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from finetune.config import compose
    from finetune.model.source import resolve_model_dir

    cfg = compose("/tmp/unused", "data=jsonl", f"data.path={data}", f"data.cache_dir={cache}",
                  f"data.cache={'false' if mode == 'memory' else 'true'}", f"train.seq_len={seq_len}",
                  f"train.progress={'true' if mode == 'build' else 'false'}")
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(cfg.model)))
    if mode == "old":
        code = subprocess.run(["git", "-C", str(REPO), "show", f"{PRE_CACHE}:finetune/data.py"], check=True,
                              capture_output=True, text=True).stdout
        path = cache / "pre_cache_data.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
        spec = importlib.util.spec_from_file_location("pre_cache_data", path)
        old = importlib.util.module_from_spec(spec)
        sys.modules["pre_cache_data"] = old
        spec.loader.exec_module(old)
        base, t0 = _maxrss_bytes(), time.perf_counter()
        t = old.tokenize(old.load_records(cfg.data, 0), tok, seq_len, True)
        samples, tokens = len(t.ids), sum(len(x) for x in t.ids)
    else:
        from finetune import data

        base, t0 = _maxrss_bytes(), time.perf_counter()
        from finetune.resolver import resolve

        t = data.prepare(resolve(cfg), tok)
        samples, tokens = len(t.ids), int(t.lengths.sum())
    print(json.dumps({"seconds": time.perf_counter() - t0, "samples": samples, "tokens": tokens,
                      "rss_before_bytes": base}))


def measure(mode: str, data: Path, cache: Path, seq_len: int) -> dict:
    out, peak, wall = _run([sys.executable, __file__, "--child", mode, "--file", str(data), "--cache", str(cache),
                            "--seq-len", str(seq_len)], REPO)
    rec = json.loads(out.strip().splitlines()[-1])
    frames = [f for f in out.replace("\r", "\n").splitlines() if "lines/s" in f]
    return {**rec, "peak_rss_bytes": peak, "wall_s": wall, "bar": frames[-1].strip() if frames else None,
            "said": next((ln for ln in out.splitlines() if ln.startswith(("tokenized", "reused"))), None)}


def _line(name: str, lines: int, r: dict) -> str:
    return (f"  {name:<13} {lines:>9,} lines  {r['seconds']:8.1f} s  {lines / r['seconds']:>9,.0f} lines/s  "
            f"peak RSS {r['peak_rss_bytes'] / MIB:7.0f} MiB (before tokenizing {r['rss_before_bytes'] / MIB:.0f} MiB, "
            f"+{(r['peak_rss_bytes'] - r['rss_before_bytes']) / MIB:.0f} MiB)  {r['samples']:,} samples "
            f"{r['tokens']:,} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--old-lines", type=int, default=100_000, help="lines for the pre-cache path (0: skip it)")
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs of each side at --old-lines")
    ap.add_argument("--file", type=Path, help="a JSONL to tokenize instead of the repeated GSM8K")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tokenize_large"))
    ap.add_argument("--seq-len", type=int, default=256, help="train.seq_len (the default config's)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.file, args.cache, args.seq_len)

    import numpy
    import tokenizers
    import transformers

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=False,
                            capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/tokenize_large.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}  commit: {commit}")
    print(f"machine: {platform.machine()} {platform.system()} {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (at start)")
    print(f"python {platform.python_version()}  numpy {numpy.__version__}  transformers {transformers.__version__}  "
          f"tokenizers {tokenizers.__version__}")
    big = args.file or write_jsonl(work / f"gsm8k_x{args.lines}.jsonl", args.lines)
    lines = sum(1 for _ in big.open("rb"))
    print(f"data: {big} ({lines:,} lines, {big.stat().st_size / MIB:,.0f} MiB), train.seq_len={args.seq_len}, "
          "tokenizer: the tiny model's (512-token BPE)")
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)

    build = measure("build", big, cache, args.seq_len)
    entry = Path(build["said"].split("cached to ")[1].rstrip(")"))
    size = sum(p.stat().st_size for p in entry.iterdir())
    reuse = measure("reuse", big, cache, args.seq_len)
    print(f"\n{lines:,} lines")
    print(_line("cache build", lines, build))
    print(f"  {'':<13} its progress bar at the end: {build['bar']}")
    print(f"  cache entry   {size / MIB:,.0f} MiB on disk ({size / build['tokens']:.2f} bytes a token): {entry}")
    print(_line("cache reuse", lines, reuse))
    print(f"  reuse takes {reuse['seconds']:.2f} s, {reuse['seconds'] / build['seconds']:.1%} of the build "
          "(sha256 of the file and of the entry's arrays included)")
    if args.old_lines:
        n = min(args.old_lines, lines)
        small = big if n == lines else write_jsonl(work / f"gsm8k_x{n}.jsonl", n)
        runs: dict[str, list[dict]] = {"cache build": [], "in memory": [], "pre-cache": []}
        modes = {"cache build": "build", "in memory": "memory", "pre-cache": "old"}
        names = list(runs)
        for i in range(args.repeats):  # alternating, each order rotated: a load change hits every side
            for name in names[i % 3:] + names[: i % 3]:
                shutil.rmtree(work / "cache_small", ignore_errors=True)
                runs[name].append(measure(modes[name], small, work / "cache_small", args.seq_len))
        print(f"\n{n:,} lines, against the pre-cache code path (commit {PRE_CACHE}); "
              f"{args.repeats} alternating run(s) each, medians")
        med = {}
        for name, rs in runs.items():
            med[name] = {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak_rss_bytes", "rss_before_bytes")}
            med[name].update(samples=rs[0]["samples"], tokens=rs[0]["tokens"])
            each = ", ".join(f"{n / r['seconds']:,.0f}" for r in rs)
            print(_line(name, n, med[name]) + (f"  (each run: {each} lines/s)" if len(rs) > 1 else ""))
        new, old = med["cache build"], med["pre-cache"]
        same = len({(r["samples"], r["tokens"]) for rs in runs.values() for r in rs}) == 1
        growth = (new["peak_rss_bytes"] - new["rss_before_bytes"]) / max(1, old["peak_rss_bytes"] - old["rss_before_bytes"])
        print(f"  cache build against pre-cache: {old['seconds'] / new['seconds']:.2f}x the lines/s, {growth:.2f}x the "
              f"RSS growth; samples and tokens {'equal' if same else 'DIFFER'} on every run")
    print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
