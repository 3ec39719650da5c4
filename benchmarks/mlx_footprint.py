"""The MLX footprint, side by side: `finetune backend=mlx` vs `mlx_lm lora` on the same job.

Same model (the built-in tiny Qwen2: hidden 64, 2 layers, its own BPE tokenizer), same data
(GSM8K as {"text": "Question: ...\\nAnswer: ..."} records, every token in the loss on both
sides), micro-batch 8, max length 2048, LoRA rank 8 / scale 2 on q_proj and v_proj of every
layer, Adam(W) lr 1e-4, the same number of optimizer steps. Runs alternate (ours, peer, ours,
...); each is a fresh process, so peak RSS is the kernel's high-water mark of that process
alone (``os.wait4``'s ``ru_maxrss``).

What each side counts as a token: ours reports real (non-pad) tokens of the inputs
(``summary.json`` tokens / step seconds); mlx_lm counts target positions (real tokens minus one
per sample: ``mask.sum()`` in ``default_loss``). The script converts ours to the peer's count
for the ratio, and prints both. tokens/s is taken over the steps after the first 10 on both
sides (mlx_lm's first report includes its warm-up, so ours drops the same steps).

    python benchmarks/mlx_footprint.py                    # 3 runs each, 40 steps
    python benchmarks/mlx_footprint.py --runs 5 --steps 60
    python benchmarks/mlx_footprint.py --ours-only -- train.pad_multiple=1   # today's trimming
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GSM8K = Path(os.environ.get("FINETUNE_GSM8K", REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"))
GIB = 2**30


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[str, int, float]:
    """Run ``cmd`` (``env`` added to this process's environment); return (stdout+stderr, peak RSS
    bytes of that process, wall seconds)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **(env or {})})
    out = p.stdout.read() if p.stdout else ""
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return out, int(ru.ru_maxrss) * (1 if sys.platform == "darwin" else 1024), wall


def make_data(work: Path, n: int) -> Path:
    d = work / "data"
    d.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(x) for x in GSM8K.read_text().splitlines()[:n]]
    texts = [json.dumps({"text": f"Question: {r['question']}\nAnswer: {r['answer']}"}) for r in rows]
    (d / "train.jsonl").write_text("\n".join(texts) + "\n")
    (d / "valid.jsonl").write_text("\n".join(texts[:16]) + "\n")
    return d


def tiny_dir() -> Path:
    sys.path.insert(0, str(REPO))
    from finetune.config import compose
    from finetune.model.source import resolve_model_dir

    return resolve_model_dir(compose("/tmp/unused").model)


def ours(work: Path, data: Path, args: argparse.Namespace, i: int) -> dict:
    run_dir = work / f"ours_{i}"
    cmd = [sys.executable, "-m", "finetune", "backend=mlx", "data=jsonl", f"data.path={data / 'train.jsonl'}",
           "data.val_fraction=0", "train.eval_every=0", f"train.steps={args.steps}", "train.batch_size=8",
           "train.seq_len=2048", "train.warmup_steps=0", "train.schedule=constant", "optim.lr=1e-4",
           "train.progress=false", f"hydra.run.dir={run_dir}", *args.overrides]
    _, rss, wall = _run(cmd, work)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    rows = [r for r in rows if "step" in r]
    tail = rows[10:]
    real = sum(r["tokens"] for r in tail)
    secs = sum(r["step_seconds"] for r in tail)
    targets = real - sum(r["samples"] for r in tail)  # the peer's count: one target fewer per sample
    s = json.loads((run_dir / "summary.json").read_text())
    return {"rss": rss, "tps_real": real / secs, "tps_targets": targets / secs, "wall": wall,
            "mlx_peak": s["memory"]["peaks"]["allocated_bytes"],
            "mlx_cache_end": (s["memory"].get("last") or {}).get("mlx_cache_bytes"),
            "loss": s["final_train_loss"]}


def peer(work: Path, data: Path, model: Path, args: argparse.Namespace, i: int) -> dict:
    cfg = work / "lora.yaml"
    cfg.write_text(json.dumps({"lora_parameters": {"rank": 8, "scale": 2.0, "dropout": 0.0,
                                                   "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}))
    reports = work / f"peer_{i}.jsonl"
    # `mlx_lm lora` exactly (its main(), its trainer), with its reporting callback swapped for
    # one that writes each report as JSON: its console UI rounds the figures.
    driver = ("import json, sys, mlx_lm.lora as L\n"
              "from mlx_lm.tuner.callbacks import TrainingCallback\n"
              "class Rec(TrainingCallback):\n"
              "    def on_train_loss_report(self, info):\n"
              f"        open({str(reports)!r}, 'a').write(json.dumps(info) + '\\n')\n"
              "L.get_reporting_callbacks = lambda *a, **k: Rec()\n"
              "sys.argv = ['mlx_lm.lora'] + sys.argv[1:]\n"
              "L.main()\n")
    cmd = [sys.executable, "-c", driver, "--model", str(model), "--train", "--data", str(data),
           "--batch-size", "8", "--iters", str(args.steps), "--max-seq-length", "2048", "--num-layers", "-1",
           "--learning-rate", "1e-4", "--steps-per-report", "10", "--steps-per-eval", str(10 * args.steps),
           "--val-batches", "1", "--adapter-path", str(work / f"peer_{i}"), "--save-every", str(10 * args.steps),
           "--optimizer", "adamw", "-c", str(cfg)]
    out, rss, wall = _run(cmd, work)
    reps = [json.loads(x) for x in reports.read_text().splitlines()] if reports.exists() else []
    if len(reps) < 2:
        sys.exit(f"could not read mlx_lm's reports:\n{out[-2000:]}")
    prev, toks, secs = reps[0]["trained_tokens"], 0, 0.0
    for r in reps[1:]:
        toks += r["trained_tokens"] - prev
        secs += (r["trained_tokens"] - prev) / r["tokens_per_second"]
        prev = r["trained_tokens"]
    return {"rss": rss, "tps_targets": toks / secs, "wall": wall, "mlx_peak": reps[-1]["peak_memory"] * 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--ours-only", action="store_true")
    ap.add_argument("overrides", nargs="*", help="extra finetune overrides (after --)")
    args = ap.parse_args()
    if not GSM8K.is_file():
        sys.exit(f"{GSM8K} not found: set FINETUNE_GSM8K=/path/to/gsm8k/train.jsonl")
    import mlx.core as mx
    import mlx_lm

    model = tiny_dir()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_data(work, args.samples)
        res: dict[str, list[dict]] = {"ours": [], "peer": []}
        for i in range(args.runs):
            order = ("ours", "peer") if i % 2 == 0 else ("peer", "ours")
            for side in order:
                if side == "peer" and args.ours_only:
                    continue
                r = ours(work, data, args, i) if side == "ours" else peer(work, data, model, args, i)
                res[side].append(r)
                print(f"run {i} {side}: peak RSS {r['rss'] / GIB:.3f} GiB, {r['tps_targets']:,.0f} target tok/s"
                      + f", mlx peak {r['mlx_peak'] / GIB:.3f} GiB"
                      + (f", {r['tps_real']:,.0f} real tok/s, mlx cache at end {(r['mlx_cache_end'] or 0) / GIB:.3f} GiB"
                         if side == "ours" else ""),
                      flush=True)

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in res[side])

    print(f"\nmachine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores; mlx {mx.__version__}, "
          f"mlx-lm {mlx_lm.__version__}; {args.runs} runs each, {args.steps} steps, micro-batch 8, seq_len 2048, "
          f"{args.samples} GSM8K text samples; overrides: {' '.join(args.overrides) or '(none)'}")
    print(f"{'':28}{'finetune':>12}{'mlx_lm lora':>14}{'ratio':>8}")
    o_rss = med("ours", "rss")
    o_tps = med("ours", "tps_targets")
    if res["peer"]:
        p_rss, p_tps = med("peer", "rss"), med("peer", "tps_targets")
        print(f"{'peak RSS (GiB, median)':28}{o_rss / GIB:12.3f}{p_rss / GIB:14.3f}{o_rss / p_rss:8.2f}x")
        print(f"{'target tokens/s (median)':28}{o_tps:12,.0f}{p_tps:14,.0f}{o_tps / p_tps:8.2f}x")
    else:
        print(f"{'peak RSS (GiB, median)':28}{o_rss / GIB:12.3f}")
        print(f"{'target tokens/s (median)':28}{o_tps:12,.0f}")
    print(f"{'real tokens/s (ours, median)':28}{med('ours', 'tps_real'):12,.0f}")


if __name__ == "__main__":
    main()
