"""The run loop's agreements between ranks, with the ranks' transport a stand-in: every rank
stops when any refused the run dir, and no rank stops when none did."""

from __future__ import annotations

from pathlib import Path

import pytest
from finetune.backends.base import Comm

from finetune.config import compose
from finetune.errors import UserError
from finetune.run.loop import Trainer
from finetune.resolver import resolve


class _Rank1Of2(Comm):
    """Rank 1 of two; rank 0's answer to each all_reduce is ``rank0``."""

    rank, world_size, local_rank, description = 1, 2, 1, "2 ranks (stand-in)"

    def __init__(self, rank0: float):
        self.rank0, self.reduced = rank0, []

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        self.reduced.append(list(values))
        return [v + self.rank0 for v in values]


def _trainer(tmp_path: Path) -> Trainer:
    return Trainer(resolve(compose(tmp_path / "run", "backend=cuda", "train.progress=false")))


def test_a_rank_goes_on_when_no_rank_refused_the_run_dir(tmp_path: Path) -> None:
    tr = _trainer(tmp_path)
    tr.comm = _Rank1Of2(rank0=0.0)
    tr.claim()  # nothing refused anywhere: no error
    tr.runlog.close()


def test_a_rank_stops_when_rank_0_refused_the_run_dir(tmp_path: Path) -> None:
    tr = _trainer(tmp_path)
    tr.comm = _Rank1Of2(rank0=1.0)
    with pytest.raises(UserError, match=r"^another rank refused the run dir \(rank 0 says why\)$"):
        tr.claim()
    tr.runlog.close()


def test_a_rank_that_refuses_still_takes_part_in_the_agreement(tmp_path: Path) -> None:
    # its peers wait in the same all_reduce: a rank leaving before it would hang them
    tr = Trainer(resolve(compose(tmp_path / "run", "backend=cuda", "train.progress=false", "train.resume=true")))
    tr.comm = comm = _Rank1Of2(rank0=0.0)
    with pytest.raises(UserError, match=r"^train.resume=true but .* holds no checkpoint"):
        tr.claim()
    assert len(comm.reduced) == 1 and comm.reduced[0][0] == 1.0  # "I refused", said to the others
    tr.runlog.close()


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """metrics.jsonl of the cheapest real run: the tiny model, two steps of two samples on the
    cuda backend (CPU here), evaluated after every step. Every sample is the same, so step 2
    sees step 1's batch again after one plain SGD step (constant lr, no momentum, no clipping)."""
    import json

    pytest.importorskip("torch")
    from finetune.run.loop import train

    tmp = tmp_path_factory.mktemp("two_steps")
    same = tmp / "same.jsonl"
    same.write_text((json.dumps({"prompt": "What is 12 + 30?", "completion": " The answer is 42."}) + "\n") * 16)
    train(resolve(compose(tmp / "run", "backend=cuda", "data=jsonl", f"data.path={same}", "optim=sgd", "optim.lr=0.05",
                  "optim.max_grad_norm=1000", "train.schedule=constant", "train.warmup_steps=0", "train.steps=2",
                  "train.eval_every=1", "train.progress=false", "train.batch_size=2", "train.grad_accum=1",
                  "memory.sample_every=0")))
    return [json.loads(ln) for ln in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def test_the_training_loss_is_a_mean_per_target_token_like_the_validation_loss(two_steps: list[dict]) -> None:
    import math

    first = two_steps[0]
    # a random-init model predicts near uniformly over its 512 tokens: loss near ln(512)
    assert abs(first["loss"] - math.log(512)) < 0.5
    assert abs(first["loss"] - first["val_loss"]) < 0.5


def test_the_gradient_is_that_of_the_mean_loss(two_steps: list[dict]) -> None:
    # one SGD step of lr along the gradient g of the mean loss lowers that loss by lr * |g|^2 to
    # first order: a gradient of another scale (say twice the mean's) lowers it by half that
    # per |g|^2 reported; step 2 measures the same batch after the step
    a, b = two_steps
    assert 0.8 < (a["loss"] - b["loss"]) / (a["lr"] * a["grad_norm"] ** 2) < 1.2


def test_eval_every_1_evaluates_after_every_step(two_steps: list[dict]) -> None:
    assert [r["step"] for r in two_steps] == [1, 2]
    assert all(isinstance(r.get("val_loss"), float) for r in two_steps)


def test_a_second_sigterm_exits_at_once_with_143() -> None:
    import os
    import signal
    import time

    try:
        from finetune.run.faults import StopOnSignal
    except ImportError:  # before it moved out of the loop
        from finetune.run.loop import _StopOnSignal as StopOnSignal

    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnSignal()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the first: finish the step, checkpoint, then exit
        time.sleep(0.05)
        assert stop.requested == "SIGTERM" and stop.exit_code == 143
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGTERM)  # the second: now, as a shell reports a signal
            time.sleep(1)
        assert e.value.code == 143
        assert signal.getsignal(signal.SIGTERM) == before  # its handler is gone with it
    finally:
        stop.close()
        signal.signal(signal.SIGTERM, before)


class _Ranks(Comm):
    """Rank ``rank`` of two, whose run dirs are ``dirs`` (Hydra names each rank's its own)."""

    world_size, description = 2, "2 ranks (stand-in)"

    def __init__(self, rank: int, dirs: list[str]):
        self.rank = self.local_rank = rank
        self.dirs = dirs

    def all_gather_object(self, obj):
        return list(self.dirs)


class _Joins:  # a backend as connect() sees it: it joins the launcher's ranks
    def __init__(self, comm: Comm):
        self.comm = comm

    def connect(self, spec) -> Comm:
        return self.comm


@pytest.mark.parametrize(("rank", "log"), [(0, "RunLog"), (1, "RankRunLog")])
def test_rank_0_alone_writes_the_run_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int,
                                         log: str) -> None:
    import finetune.run.loop as loop_mod

    dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    tr = Trainer(resolve(compose(dirs[rank], "backend=cuda", "train.progress=false")))
    monkeypatch.setattr(loop_mod, "get_backend", lambda name: _Joins(_Ranks(rank, dirs)))
    tr.connect()
    assert type(tr.runlog).__name__ == log and str(tr.run_dir) == dirs[0]
    tr.runlog.close()
