"""How long the commands that load no weights take, end to end, in fresh processes.

    python benchmarks/cli_latency.py            # 5 runs each, median and worst

`finetune --help` and `finetune mode=plan` import neither torch nor mlx (the tests check the
imports); this prints what that buys in wall time on this machine, against issue 4's target of
under 2 s for `mode=plan model=qwen2-72b` and `model=llama2-7b method=full`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "--help": ["--help"],
    "plan qwen2-72b qlora": ["mode=plan", "model=qwen2-72b", "method=qlora", "memory.budget=80GiB"],
    "plan llama2-7b full adamw_8bit": ["mode=plan", "model=llama2-7b", "method=full", "optim=adamw_8bit",
                                       "memory.budget=48GiB"],
    "plan llama3-8b lora": ["mode=plan", "model=llama3-8b"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(f"{'command':<34} {'median s':>9} {'worst s':>9}  target")
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in COMMANDS.items():
            times = []
            for i in range(args.runs):
                cmd = [sys.executable, "-m", "finetune.cli", *argv]
                if argv[0] != "--help":
                    cmd.append(f"hydra.run.dir={tmp}/{len(times)}-{i}")
                t0 = time.perf_counter()
                p = subprocess.run(cmd, check=False, capture_output=True, text=True)
                times.append(time.perf_counter() - t0)
                if p.returncode != 0:
                    sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
            print(f"{name:<34} {statistics.median(times):>9.2f} {max(times):>9.2f}  under 2 s: "
                  f"{'yes' if max(times) < 2.0 else 'NO'}")


if __name__ == "__main__":
    main()
