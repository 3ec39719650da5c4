"""The governor adapts to memory without changing the math: same samples, order, effective
batch, tokens and losses as an unadapted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cuda_backend_with_oom, make_cfg, needs_mlx, needs_torch
import warm_cli

import finetune.run.loop as loop_mod
from finetune.errors import UserError
from finetune.run.governor import smaller_divisor
from finetune.run.loop import train
from finetune.resolver import resolve

COMMON = ("train.progress=false", "data.num_samples=200", "train.eval_every=0", "train.steps=6", "train.warmup_steps=1")


def _losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


def test_smaller_divisor_keeps_effective_batch():
    assert smaller_divisor(8, 8) == 4 and smaller_divisor(8, 4) == 2 and smaller_divisor(8, 1) is None
    assert smaller_divisor(12, 12) == 6 and smaller_divisor(6, 6) == 3 and smaller_divisor(6, 3) == 1


@needs_torch
def test_cuda_oom_lowers_micro_batch_and_redoes_the_step(cfg_factory, tmp_path, monkeypatch):
    """A backend whose model raises torch's real OutOfMemoryError for micro-batches above 2
    rows from step 3 on: the loop redoes step 3 at micro-batch 2 and the run equals one that
    used micro-batch 2 from the start."""
    monkeypatch.setattr(loop_mod, "get_backend",
                        lambda name: cuda_backend_with_oom(lambda be, ids: be.steps_done >= 2 and ids.shape[0] > 2))
    adapted = train(resolve(cfg_factory("backend=cuda", *COMMON, "train.batch_size=8", run_dir=tmp_path / "oom")))
    monkeypatch.undo()
    plain = train(resolve(cfg_factory("backend=cuda", *COMMON, "train.batch_size=2", "train.grad_accum=4", run_dir=tmp_path / "plain")))
    ev = adapted["adaptations"]
    assert [(e["step"], e["trigger"], e["before"]["batch_size"], e["after"]["batch_size"]) for e in ev] == \
        [(3, "oom", 8, 4), (3, "oom", 4, 2)]
    assert adapted["micro_batch"] == 2 and adapted["tokens"] == plain["tokens"]
    assert _losses(tmp_path / "oom") == pytest.approx(_losses(tmp_path / "plain"), abs=1e-5)


@needs_torch
def test_oom_with_adapt_off_is_a_clear_error(cfg_factory, tmp_path, monkeypatch):
    import torch
    from finetune.backends.cuda.runtime import CudaBackend

    class AlwaysOom(CudaBackend):
        def forward_backward(self, batch, loss_scale, on_phase=None):
            try:
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
            except torch.OutOfMemoryError:
                from finetune.backends.base import OutOfMemory

                raise OutOfMemory("test") from None

    monkeypatch.setattr(loop_mod, "get_backend", lambda name: AlwaysOom())
    with pytest.raises(UserError, match="memory.adapt=false"):
        train(resolve(cfg_factory("backend=cuda", *COMMON, "memory.adapt=false", run_dir=tmp_path / "x")))


@needs_mlx
def test_mlx_budget_below_need_adapts_with_equal_losses(cfg_factory, tmp_path):
    """Measure the peak at micro-batch 8 and 4, set the budget between them: the adapted run
    must finish with the tokens and losses of the run whose micro-batch fits."""
    big = train(resolve(cfg_factory("backend=mlx", *COMMON, "train.batch_size=8", run_dir=tmp_path / "big")))
    small = train(resolve(cfg_factory("backend=mlx", *COMMON, "train.batch_size=4", "train.grad_accum=2", run_dir=tmp_path / "small")))
    p_big, p_small = big["memory"]["peaks"]["allocated_bytes"], small["memory"]["peaks"]["allocated_bytes"]
    assert p_big > p_small, (p_big, p_small)
    budget = (p_big + p_small) // 2
    adapted = train(resolve(cfg_factory("backend=mlx", *COMMON, "train.batch_size=8", f"memory.budget={budget}",
                                run_dir=tmp_path / "adapted")))
    assert adapted["adaptations"], "nothing adapted"
    assert adapted["micro_batch"] < 8 and adapted["effective_batch"] == 8
    assert adapted["tokens"] == big["tokens"] == small["tokens"]
    # Adapted and unadapted mlx runs differ by under 4e-6 per token (float sums in another
    # order); a per-micro-batch loss scale moves them ~2.5e-5: the tolerance sits between.
    assert _losses(tmp_path / "adapted") == pytest.approx(_losses(tmp_path / "big"), abs=1e-5)


@needs_mlx
def test_supervisor_restarts_an_aborted_run_from_its_checkpoint(tmp_path):
    """The child aborts (as MLX does on a Metal allocation failure) at step 4 while the
    micro-batch is above 2; the supervisor restarts it from the step-2 checkpoint at micro 2,
    and the losses equal an uninterrupted run's."""
    import os
    import sys

    args = ["backend=mlx", *COMMON, "train.batch_size=4", "train.save_every=2"]
    env = {**os.environ, "FINETUNE_FAULT_ABORT": "4:2"}
    r = warm_cli.run([sys.executable, "-m", "finetune.cli", *args, "memory.supervise=true",
                        f"hydra.run.dir={tmp_path}/sup"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[supervisor] child died" in r.stderr
    s = json.loads((tmp_path / "sup" / "summary.json").read_text())
    assert s["micro_batch"] == 2 and s["effective_batch"] == 4
    events = [json.loads(ln)["event"] for ln in (tmp_path / "sup" / "metrics.jsonl").read_text().splitlines() if '"event"' in ln]
    assert any(e["trigger"] == "process_died" and e["after"]["resume_from_step"] == 2 for e in events)
    train(resolve(make_cfg(tmp_path / "plain", *args)))  # the uninterrupted reference, in this process
    assert _losses(tmp_path / "sup") == pytest.approx(_losses(tmp_path / "plain"), abs=1e-5)  # see above


def test_nothing_fits_stops_before_any_download(tmp_path):
    """qwen2-72b on a box with RAM for a budget: the plan stops the run before the hub is
    asked for a single file, with the plan table and one error line."""
    import sys

    r = warm_cli.run([sys.executable, "-m", "finetune.cli", "model=qwen2-72b", "backend=cuda", "memory.budget=64GiB",
                        f"hydra.run.dir={tmp_path}/r"], capture_output=True, text=True, timeout=120,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "does not fit memory.budget=64GiB" in err[0] and "Traceback" not in r.stderr
    assert "peak allocated" in r.stderr  # the plan table came first
    assert "hub" not in err[0]  # it never got as far as fetching the model


class _Releases:
    """What the governor asks of a backend while training: release_cache (counted)."""

    def __init__(self) -> None:
        self.released = 0

    def release_cache(self) -> None:
        self.released += 1

    def set_grad_checkpointing(self, on: bool) -> None:
        pass


def test_swap_pressure_and_fragmentation_reactions_on_recorded_samples(cfg_factory):
    """Swap growth and PSI pressure (which no CPU test machine can be made to show) and CUDA
    fragmentation, as samples: each is acted on once per fresh reading, by an event that keeps
    the effective batch; a sample repeating a stale reading (system_fresh False) is not acted
    on again."""
    from finetune.run.governor import Governor

    MiB = 1 << 20
    events = []
    cfg = cfg_factory("train.batch_size=8", "train.grad_accum=1", "backend=cuda")
    gov = Governor(resolve(cfg), "cuda", events.append)
    gov.backend = be = _Releases()
    base = {"swap_used": 100 * MiB, "psi_some_avg10": 0.0, "system_fresh": True}
    gov.after_step(1, base)
    gov.after_step(2, {**base, "swap_used": 500 * MiB})  # +400 MiB of swap since the start
    assert [(e["trigger"], e["after"]["batch_size"], e["after"]["grad_accum"]) for e in events] == [("swap_growth", 4, 2)]
    assert be.released == 1
    for step in range(3, 12):  # the same reading carried by later samples: no second action
        gov.after_step(step, {**base, "swap_used": 900 * MiB, "system_fresh": False})
    assert len(events) == 1
    gov.after_step(12, {**base, "swap_used": 500 * MiB, "psi_some_avg10": 35.0})  # fresh: pressure
    assert events[-1]["trigger"] == "memory_pressure" and events[-1]["after"] == {"batch_size": 2, "grad_accum": 4}
    gov.after_step(13, {**base, "swap_used": 500 * MiB, "psi_some_avg10": 35.0, "system_fresh": False})
    assert len(events) == 2
    # fragmentation: inactive split blocks above 25% of reserved (and 512 MiB) -> release cached blocks
    gov.after_step(20, {**base, "swap_used": 500 * MiB, "inactive_split": 900 * MiB, "reserved": 2048 * MiB})
    assert events[-1]["trigger"] == "fragmentation" and events[-1]["action"] == "release_cache"
    assert be.released == 2 and gov.micro * (gov.effective // gov.micro) == 8
