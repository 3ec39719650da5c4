"""A signal sent to a real `finetune` run: SIGTERM (a scheduler's preemption) and SIGINT
(Ctrl-C) finish the step in flight, write a checkpoint, exit 128 + the signal (143, 130),
and `train.resume=true` continues to the losses of a run that was never interrupted.

The run is started with far more steps than it will take and the signal is sent once its
second step is logged, so no timing decides the outcome; the schedule is constant, so the
resumed and the reference runs (shorter, in-process) see the same learning rates.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import finetune_cmd, make_cfg, needs_torch

from finetune.run.loop import train
from finetune.resolver import resolve

ARGS = ("backend=cuda", "train.schedule=constant", "train.warmup_steps=2", "optim.lr=1e-2", "train.eval_every=0",
        "train.progress=false", "data.num_samples=200", "method.lora.dropout=0.1")  # dropout: the RNG must resume too
LONG = "train.steps=100000"


def _steps(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.startswith('{"step"') and ln.endswith("}")]


def _interrupt(run: Path, sig: signal.Signals) -> tuple[int, str, int]:
    """Start a long run, send ``sig`` once step 2 is logged; return (exit code, stderr, last step)."""
    # a test runner started in the background may ignore SIGINT, and a child inherits that
    reset = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sig == signal.SIGINT else None
    proc = subprocess.Popen([*finetune_cmd(), *ARGS, LONG, f"hydra.run.dir={run}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=reset)
    try:
        deadline = time.monotonic() + 300  # a guard against a hung child, not a measurement
        while len(_steps(run)) < 2:
            assert proc.poll() is None, f"the run ended before step 2: {proc.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, "no second step logged in 300 s"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err, _steps(run)[-1]["step"]


@needs_torch
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_checkpoints_exits_and_resumes_to_equal_losses(tmp_path, sig, code):
    run = tmp_path / "run"
    rc, err, last = _interrupt(run, sig)
    assert rc == code, err[-3000:]
    assert f"stopped by {sig.name} after step {last}; checkpoint saved" in err and "Traceback" not in err
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert ckpts == [f"step_{last:07d}"], ckpts  # the step in flight was finished, then saved
    state = json.loads((run / "checkpoints" / ckpts[0] / "trainer_state.json").read_text())
    assert state["step"] == last and state["samples"] == 4 * last
    total = last + 2
    resumed = train(resolve(make_cfg(run, *ARGS, f"train.steps={total}", "train.resume=true")))
    assert resumed["steps_this_run"] == 2
    reference = train(resolve(make_cfg(tmp_path / "reference", *ARGS, f"train.steps={total}")))
    got, want = _steps(run), _steps(tmp_path / "reference")
    assert [r["step"] for r in got] == list(range(1, total + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-5)
    assert resumed["tokens"] == reference["tokens"] and resumed["samples"] == reference["samples"]
