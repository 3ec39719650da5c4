"""What a SLURM step without torchrun hands torch's env:// rendezvous: rank, world and the
port every task of the job computes alike (29500 + job id mod 1000). Written for survivors of
the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import pytest
from conftest import needs_torch


def _forget_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset the launcher's variables so that monkeypatch puts them back as they were, even
    those launched_world itself writes into os.environ (a bare delenv of an unset name records
    nothing, and RANK/WORLD_SIZE left behind would make every later test a distributed run)."""
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)


@needs_torch
def test_slurm_step_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    from finetune.backends.cuda.distributed import launched_world

    _forget_launcher_env(monkeypatch)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "1234567")
    monkeypatch.setenv("MASTER_ADDR", "node-a")
    import os

    assert launched_world() == (3, 4, 1)
    assert (os.environ["MASTER_PORT"], os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
        "30067", "3", "4", "1")


@needs_torch
def test_torchrun_world_and_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from finetune.backends.cuda.distributed import launched_world

    _forget_launcher_env(monkeypatch)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launched_world() == (1, 2, 0)
    # a launcher that sets only WORLD_SIZE and RANK (mpirun-style): one process per node
    monkeypatch.delenv("LOCAL_RANK")
    assert launched_world() == (1, 2, 0)
    monkeypatch.delenv("RANK")
    assert launched_world() == (0, 2, 0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launched_world() is None


@needs_torch
def test_a_world_size_of_zero_or_empty_is_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """WORLD_SIZE=0 or WORLD_SIZE= left in a shell (an export meant to clear it) is no launch:
    one process, no rendezvous to wait in."""
    from finetune.backends.cuda.distributed import launched_world

    _forget_launcher_env(monkeypatch)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    for value in ("0", ""):
        monkeypatch.setenv("WORLD_SIZE", value)
        assert launched_world() is None
