"""Planned reserved against PEFT's published MetaMathQA runs (Llama-3.2-3B on an L40S).

    python benchmarks/plan_vs_published.py > benchmarks/results/plan_vs_metamathqa.txt

Each run of tests/data/measured/peft_metamathqa.json is planned as its command line says, at
several padded widths: the published figure is the 99th percentile over 5,000 steps of each step's
reserved peak, and the width of the step at that percentile is not published (MetaMathQA is not
on this machine; samples of <= 1,300 characters, 210 tokens on average). The table prints the
ratio planned / published at each width; nothing here is fitted. Imports neither torch nor mlx.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from finetune.config import compose  # noqa: E402
from finetune.planner import plan  # noqa: E402
from finetune.resolver import resolve  # noqa: E402

WIDTHS = (400, 500, 600, 768)


def main() -> None:
    data = json.loads((REPO / "tests" / "data" / "measured" / "peft_metamathqa.json").read_text())
    print(data["source"])
    print("not modelled (their loop, not ours):", data["not_ours"])
    print()
    print(f"{'run':10s}{'published p99':>15s}" + "".join(f"{'T=' + str(w):>18s}" for w in WIDTHS))
    with tempfile.TemporaryDirectory() as tmp:
        for name, r in data["runs"].items():
            cells = []
            for w in WIDTHS:
                args = [a for a in r["command"].split() if not a.startswith("train.seq_len=")]
                p = plan(resolve(compose(tmp, "mode=plan", *args, f"train.seq_len={w}")), recommend=False)
                resv = p["phases"]["steady"]["reserved_bytes"]
                cells.append(f"{resv / 1e9:8.2f} GB {resv / r['reserved_99th_bytes']:5.2f}x")
            print(f"{name:10s}{r['reserved_99th_bytes'] / 1e9:12.2f} GB" + "".join(f"{c:>18s}" for c in cells))
    print("\nplanned: the steady state's reserved bytes (memory.empty_cache_every=1 as their loop empties the cache "
          "every step, torch's default allocator, foreach AdamW); ratio = planned / published 99th percentile")


if __name__ == "__main__":
    main()
