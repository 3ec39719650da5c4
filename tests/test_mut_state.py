"""The run's live state as the config starts it: the effective batch is micro-batch times
accumulation, fixed for the run."""

from __future__ import annotations

from pathlib import Path

from finetune.config import compose
from finetune.resolver import resolve
from finetune.run.state import RunState


def test_the_effective_batch_is_micro_batch_times_accumulation(tmp_path: Path) -> None:
    cfg = compose(tmp_path / "run", "backend=cuda", "train.batch_size=4", "train.grad_accum=3")
    s = RunState.from_spec(resolve(cfg), "cuda")
    assert (s.micro_batch, s.effective_batch, s.grad_accum) == (4, 12, 3)
    assert s.with_(micro_batch=2).as_dict()["grad_accum"] == 6
