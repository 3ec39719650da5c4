"""Record the timelines the chart tests and the README's pictures are drawn from.

    python scripts/record_timelines.py cuda_cpu mlx_cpu governor   # tiny real jobs (~1 min on 2 CPU cores)
    torchrun --nproc_per_node 2 scripts/record_timelines.py two_rank   # two ranks over gloo
    python scripts/record_timelines.py sweep2 sweep12 h200              # real sweeps (~4 min); the GPU one rebuilt

Each job runs through ``finetune.run.loop.train`` as a user's would; the samples, the budget, the
governor's events and memory.phase_every that ``memory.png`` is drawn from are written to
``tests/data/timelines/<name>.json`` at the moment the run draws its chart. The GPU timeline
cannot be recorded on a machine without one: ``h200.json`` is rebuilt from the end-of-run figures
benchmarks/results/gpu_check_h200.txt recorded (see ``gpu_timeline``), and says so.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "timelines"
sys.path.insert(0, str(REPO / "tests"))

JOBS = {
    "cuda_cpu": ["backend=cuda", "train.steps=12"],
    "mlx_cpu": ["backend=mlx", "train.steps=6"],
    # a budget below the plan: the governor lowers the micro-batch before loading (events)
    "governor": ["backend=mlx", "train.steps=6", "train.batch_size=8", "memory.budget=40MiB"],
    # under torchrun --nproc_per_node 2 (gloo): rank 0's chart
    "two_rank": ["backend=cuda", "train.steps=6"],
}


def record(name: str, overrides: list[str]) -> None:
    from conftest import make_cfg

    from finetune.accounting.accountant import Accountant
    from finetune.run.loop import train
    from finetune.resolver import resolve

    original = Accountant.write_plot

    def capture(self, path, budget=None):  # the chart's own inputs, as the run hands them over
        if self.rank != 0:
            return original(self, path, budget)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"{name}.json").write_text(json.dumps({
            "backend": self.backend_name, "rank": self.rank, "world": self._world(), "budget": budget,
            "phase_every": self.phase_every, "events": self.run_facts.get("adaptations") or [],
            "samples": self.samples, "recorded_with": overrides}, default=str))
        return original(self, path, budget)

    Accountant.write_plot = capture
    try:
        with tempfile.TemporaryDirectory() as d:
            train(resolve(make_cfg(Path(d) / "run", "train.progress=false", *overrides)))
    finally:
        Accountant.write_plot = original


MIB = 1 << 20
# sweeps whose report rows sweep_memory.png is drawn from (finetune.report.rows of a real sweep)
SWEEPS = {
    "sweep2": ["optim=adamw,sgd"],
    "sweep12": ["optim=adamw,sgd,adafactor", "train.batch_size=1,2,4,8"],
}


def record_sweep(name: str, overrides: list[str]) -> None:
    import subprocess

    from conftest import finetune_cmd

    from finetune.report import rows

    with tempfile.TemporaryDirectory() as d:
        subprocess.run([*finetune_cmd(), "-m", "backend=cuda", "train.steps=2", "train.progress=false",
                        f"hydra.sweep.dir={d}/sweep", *overrides], check=True, capture_output=True)
        rs = rows(Path(d) / "sweep")
    (OUT / f"{name}.json").write_text(json.dumps({"rows": rs, "recorded_with": overrides}, default=str))


def gpu_timeline() -> dict:
    """The H200 job of benchmarks/results/gpu_check_h200.txt (tiny model widened to hidden
    1024, 8 layers, full fine-tune, adamw_8bit, 10 steps) as a 31-sample timeline, rebuilt from
    the figures that file recorded: weights 466 MiB, 8-bit state 237 MiB created at step 1's
    optimizer phase, activations 65 MiB, allocated 997 -> 768 MiB over step 1's optimizer,
    reserved +478 MiB at step 2's forward to 1.39 GiB, step peaks 1.21-1.25 GiB, CUDA context
    524 MiB, NVML 2.13 GiB of 140 GiB at the end. A layout fixture: no GPU timeline was recorded,
    and the samples between the recorded points are interpolated."""
    w, st, act, ctx, total = 466 * MIB, 237 * MIB, 65 * MIB, 524 * MIB, 140 << 30
    samples = []

    def add(step: int, phase: str, alloc: int, reserved: int, step_peak: int | None, census: dict) -> None:
        used = reserved + ctx + (229 * MIB if step >= 2 else 0)
        dev = {"index": 0, "allocated": alloc, "reserved": reserved, "peak_allocated": None, "peak_reserved": None,
               "device_used": used, "device_total": total, "non_allocator": used - reserved,
               "non_allocator_unexplained": used - reserved - ctx}
        peak = max([alloc, step_peak or 0] + [x["peak_allocated"] for x in samples])
        peak_resv = max([reserved] + [x["peak_reserved"] for x in samples])
        dev.update(peak_allocated=peak, peak_reserved=peak_resv)
        samples.append({"step": step, "phase": phase, "allocated": alloc, "reserved": reserved,
                        "peak_allocated": peak, "peak_reserved": peak_resv,
                        "step_peak_allocated": step_peak, "peak_scope": "step" if step_peak else None,
                        "device_used": used, "device_total": total, "non_allocator": used - reserved,
                        "cuda_context": ctx, "paged_optimizer_state": 0, "other_processes_used": 0,
                        "non_allocator_unexplained": used - reserved - ctx, "devices": [dev],
                        "census": census, "rss": int(1.54 * (1 << 30)), "peak_rss": int(1.54 * (1 << 30)),
                        "swap_growth": 0, "swap_process": 0, "inactive_split": 30 * MIB, "alloc_retries": 0,
                        "num_ooms": 0})

    cen = lambda grads, state, a: {"frozen_weights": 0, "quant_buffers": 0, "trainable_weights": w,  # noqa: E731
                                   "grads": grads, "optimizer_state": state, "activations_and_other": a,
                                   "optimizer_state_paged": 0}
    add(0, "load", w, 512 * MIB, None, cen(0, 0, 0))
    for step in range(1, 11):
        state = st if step > 1 else 0
        reserved = 942 * MIB if step == 1 else int(1.39 * (1 << 30))
        add(step, "forward", w + state + act, reserved, None, cen(0, state, act))
        add(step, "backward", w + w + state + act, reserved, int((1.21 + 0.004 * step) * (1 << 30)), cen(w, state, act))
        add(step, "optimizer", w + st + act, reserved, int((1.21 + 0.004 * step) * (1 << 30)), cen(0, st, 0))
    return {"backend": "cuda", "rank": 0, "world": 1, "budget": None, "phase_every": 1, "events": [],
            "samples": samples, "recorded_with": "rebuilt from benchmarks/results/gpu_check_h200.txt (see "
                                                  "scripts/record_timelines.py gpu_timeline)"}


if __name__ == "__main__":
    for name, over in JOBS.items():
        if len(sys.argv) == 1 or name in sys.argv[1:]:
            record(name, over)
            print(f"recorded {OUT / name}.json", file=sys.stderr)
    for name, over in SWEEPS.items():
        if len(sys.argv) == 1 or name in sys.argv[1:]:
            record_sweep(name, over)
            print(f"recorded {OUT / name}.json", file=sys.stderr)
    if len(sys.argv) == 1 or "h200" in sys.argv[1:]:
        (OUT / "h200.json").write_text(json.dumps(gpu_timeline()))
        print(f"rebuilt {OUT / 'h200.json'}", file=sys.stderr)
