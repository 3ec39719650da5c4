"""benchmarks/gpu_bench.sh end to end on this CPU (``--smoke``: tiny shape, 3 steps, 1 run per
side, a 3-point grid), so the script a lent GPU machine runs once is known to run. It checks that
every part printed its rows and ratio lines; no figure is asserted (benchmarks never assert)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import REPO, needs_torch
import warm_cli


@pytest.mark.slow
@needs_torch
def test_gpu_bench_smoke(tmp_path: Path, gsm8k: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "FINETUNE_GSM8K": str(gsm8k), "PYTHON": os.environ.get("PYTHON", "python3")}
    r = warm_cli.run(["bash", "benchmarks/gpu_bench.sh", "--smoke", "--work", str(tmp_path / "work")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    text = (out / "gpu_bench.txt").read_text()
    assert text.strip() == r.stdout.strip()  # the report file holds what was printed
    assert "CRASHED" not in text and "skipped" not in text, text

    for head in ("command: bash benchmarks/gpu_bench.sh --smoke", "date: ", "machine: ", "versions: torch "):
        assert any(ln.startswith(head) for ln in text.splitlines()), head

    num = r"(?:[\d,.]+|n/a)"
    # every side of the timed runs printed a row: micro-batch, round, side, real tok/s, loop tok/s, ...
    for side in ("ours", "Trainer\\+PEFT", "ours chunk=64"):
        assert re.search(rf"^\s+4\s+0 {side}\s+[\d,]+\s+[\d,]+\s+{num}\s+{num}\s+[\d.]+\s+[\d.]+", text, re.MULTILINE), side
    # three grid rows, each with the plan's figures and the measured ones (n/a on a CPU)
    rows = re.findall(rf"^\s*\d+ (?:lora|dora|full)\s+b=\d T=\d+\s+ckpt=\d \w+\s+[\d.]+\s+{num}\s+\S+\s+[\d.]+", text,
                      re.MULTILINE)
    assert len(rows) == 3, text
    # issue 34's row: FSDP-QLoRA at world size 1 with CPU and activation offload, planned against measured
    assert re.search(rf"^\s*3 qlora b=1 T=\d+\s+ckpt=1 adamw fsdp1\+offload\s+[\d.]+\s+{num}\s+\S+\s+[\d.]+", text,
                     re.MULTILINE), text

    for ratio in ("ratio micro-batch 4 real tokens/s", "ratio micro-batch 4 loop tokens/s",
                  "ratio micro-batch 4 peak reserved", "ratio micro-batch 4 peak allocated",
                  "ratio chunked/unchunked peak reserved", "ratio chunked/unchunked peak allocated",
                  "ratio chunked/unchunked real tokens/s"):
        assert re.search(rf"^{re.escape(ratio)}.*= {num}x?", text, re.MULTILINE), ratio
    for ratio in ("ratio planner peak_allocated_bytes", "ratio planned steady reserved", "ratio planned step-1 reserved",
                  "ratio planned NVML used", "ratio planned host RSS"):
        assert re.search(rf"^{re.escape(ratio)}.*worst \|error\| \S+, median \|error\| \S+", text, re.MULTILINE), ratio
    assert "the logits' share: " in text
    for part in ("time: the grid took", "time: ours vs peer and chunked loss took", "time: total"):
        assert part in text, part
