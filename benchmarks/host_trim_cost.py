"""What handing the C heap's free pages back after optimizer steps costs (issue 34): the cuda
runtime on the CPU calls glibc's malloc_trim(0) after a step that left at least 32 MiB more
resident than the last trim (backends/cuda/runtime.py ``host_trim``, finetune/accounting/
probes.py HostHeapTrim). Here the same run with it off, as the runtime has it ("on") and
after every step ("always"), alternated, each in a fresh process, single-threaded. Prints each
run's median step time over steps 2..N, its RSS after the last step, its peak RSS and how many
steps trimmed, then the medians over the runs of each. Prints, never asserts.

    OMP_NUM_THREADS=1 python3 benchmarks/host_trim_cost.py --pairs 3 OVERRIDES...
    e.g. OVERRIDES: backend=cuda backend.device=cpu backend.strategy=fsdp backend.cpu_offload=true
         method=lora train.batch_size=1 train.steps=8 model=tiny model.config.hidden_size=1024 ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMON = ["train.eval_every=0", "train.progress=false", "train.warmup_steps=1"]


MODES = ("off", "on", "always")


def one_run(mode: str, overrides: list[str]) -> None:
    """This process: one run with the trim as ``mode`` says."""
    from finetune.backends.cuda.runtime import CudaBackend

    from finetune.accounting.probes import HostHeapTrim
    from finetune.run import loop

    class Forced(CudaBackend):
        def setup(self, spec, model_dir):  # type: ignore[no-untyped-def]
            info = super().setup(spec, model_dir)
            self.host_trim = {"off": None, "on": HostHeapTrim(), "always": HostHeapTrim(0)}[mode]
            return info

        def optimizer_step(self, lr):  # type: ignore[no-untyped-def]
            norm = super().optimizer_step(lr)
            Path(os.environ["TRIMS_FILE"]).write_text(str(self.host_trim.trims if self.host_trim else 0))
            return norm

    loop.get_backend = lambda name: Forced()
    from finetune.cli import main

    sys.argv = ["finetune", *overrides]
    main()


def measure(mode: str, overrides: list[str], out: Path) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRIMS_FILE": f"{out}.trims",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, __file__, "--one", mode, *COMMON, *overrides, f"hydra.run.dir={out}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if r.returncode != 0:
        sys.exit(r.stderr[-3000:])
    steps = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]
    return {"step_s": statistics.median(s["step_seconds"] for s in steps[1:]),
            "rss_mib": steps[-1]["rss_bytes"] / 2**20, "peak_mib": steps[-1]["peak_rss_bytes"] / 2**20,
            "trims": int(Path(f"{out}.trims").read_text()), "steps": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", choices=MODES)
    ap.add_argument("--pairs", type=int, default=3, help="rounds of one run each mode, in rotating order")
    ap.add_argument("--modes", default="off,on", help="which of off,on,always to compare")
    args, overrides = ap.parse_known_args()
    if args.one:
        one_run(args.one, overrides)
        return
    modes = args.modes.split(",")
    got: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
                m = measure(mode, overrides, Path(tmp) / f"{i}-{mode}")
                got[mode].append(m)
                print(f"round {i} trim={mode:6}: median step {m['step_s']:.4f} s, RSS after the last step "
                      f"{m['rss_mib']:.0f} MiB, peak RSS {m['peak_mib']:.0f} MiB, trimmed after {m['trims']} of "
                      f"{m['steps']} steps", flush=True)
    med = {t: statistics.median(m["step_s"] for m in got[t]) for t in modes}
    for t in modes:
        print(f"trim={t:6}: median of the runs' median step {med[t]:.4f} s ({med[t] / med[modes[0]]:.3f}x "
              f"{modes[0]}), RSS after the last step {statistics.median(m['rss_mib'] for m in got[t]):.0f} MiB")


if __name__ == "__main__":
    main()
