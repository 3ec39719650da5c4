"""The Accountant's own bookkeeping, seen where a user reads it: the samples of memory.json,
the ``accounting`` block of summary.json (what sampling cost) and the bounded timeline.

The backend is a stand-in with fixed figures (the Accountant's contract is memory(), census(),
reset_peak() and a name); NVML is a stand-in for the pynvml *library*, the Accountant unchanged."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

from finetune.accounting import Accountant

MiB, GiB = 1 << 20, 1 << 30


class Fixed:
    """A backend whose allocator holds a fixed 1 GiB (1.5 GiB reserved) and whose census can be
    changed between samples."""

    name = "fake"

    def __init__(self, memory_seconds: float = 0.0, extra: dict[str, Any] | None = None):
        self.memory_seconds, self.extra = memory_seconds, extra or {}
        self.grads = 0

    def memory(self) -> dict[str, Any]:
        if self.memory_seconds:
            time.sleep(self.memory_seconds)  # a device sync before the counters can be read
        return {"allocated": GiB, "reserved": GiB + GiB // 2, "peak_allocated": GiB,
                "peak_reserved": GiB + GiB // 2, "device_total": None, **self.extra}

    def reset_peak(self) -> None:
        pass

    def census(self) -> dict[str, int]:
        return {"frozen_weights": 512 * MiB, "trainable_weights": 0, "grads": self.grads,
                "optimizer_state": 0, "optimizer_state_paged": 0, "quant_buffers": 0}


def test_a_single_process_records_rank_0_in_every_sample() -> None:
    acct = Accountant(Fixed())
    assert acct.sample(0, "load")["rank"] == 0
    assert acct.sample(1, "optimizer")["rank"] == 0


def test_the_timeline_past_its_bound_keeps_the_recent_half_and_every_other_older_step() -> None:
    # load + 100 optimizer samples = 101 > 100: the older 51 are thinned (steps 0-2 whole, then
    # every other optimizer sample: 3, 5, ..., 49), the recent 50 (steps 51-100) stay
    acct = Accountant(Fixed(), max_samples=100)
    acct.sample(0, "load")
    for step in range(1, 101):
        acct.sample(step, "optimizer")
    steps = [s["step"] for s in acct.samples]
    assert steps == [0, 1, 2, *range(3, 50, 2), *range(51, 101)]
    assert acct.thinned == 24 and len(steps) == 77


def test_a_census_budget_that_allows_it_retakes_the_census_from_step_3() -> None:
    # the census budget's clock starts at step 3's first sample: a census that changed at step
    # 3 shows in that step's later samples (census_step 3), not two steps late
    b = Fixed()
    acct = Accountant(b, census_budget=1e9, phase_every=1)
    acct.sample(0, "load")
    for step in (1, 2, 3):
        if step == 3:
            b.grads = 256 * MiB
        for phase in ("forward", "backward", "optimizer"):
            acct.sample(step, phase)
    opt3 = next(s for s in acct.samples if s["step"] == 3 and s["phase"] == "optimizer")
    assert opt3["census_step"] == 3 and opt3["census"]["grads"] == 256 * MiB


def test_a_sample_inside_a_step_costs_at_least_its_backend_read() -> None:
    # forward/backward samples are built later from what was read: their cost still counts
    # the read (here a 5 ms device sync), as summary.json's per-sample figures say
    acct = Accountant(Fixed(memory_seconds=0.005))
    acct.sample(0, "load")
    acct.sample(1, "forward")
    acct.sample(1, "backward")
    acct.sample(1, "optimizer")
    fwd = next(s for s in acct.samples if s["phase"] == "forward")
    assert isinstance(fwd, dict) and fwd["sample_seconds"] >= 0.005
    assert fwd["allocated"] == GiB and fwd["census"]["frozen_weights"] == 512 * MiB


def test_the_accounting_block_adds_up_and_a_run_without_steps_has_no_fraction() -> None:
    acct = Accountant(Fixed())
    acct.sample(0, "load")
    acct.sample(1, "optimizer")
    acc = acct.summary(100.0)["accounting"]
    # the census is part of the backend's time, which is part of the sampling time
    assert 0 < acc["census_seconds"] <= acc["backend_seconds"] <= acc["sampling_seconds"] < 1.0
    assert acc["fraction_of_step_time"] == acc["sampling_seconds"] / 100.0
    assert acc["own_fraction_of_step_time"] == (acc["sampling_seconds"] - acc["backend_seconds"]) / 100.0
    none = Accountant(Fixed()).summary(0.0)["accounting"]
    assert none["fraction_of_step_time"] is None and none["own_fraction_of_step_time"] is None


def test_one_device_row_takes_the_context_and_total_the_backend_reports_beside_it() -> None:
    # a row without its own cuda_context/device_total: with one device they are the backend's
    b = Fixed(extra={"devices": [{"index": 0, "allocated": GiB, "reserved": GiB + GiB // 2}],
                     "cuda_context": 500 * MiB, "device_total": 80 * GiB})
    s = Accountant(b).sample(0, "load")
    assert s["devices"][0]["cuda_context"] == 500 * MiB and s["cuda_context"] == 500 * MiB
    assert s["device_total"] == 80 * GiB


class _Pynvml:
    """Answers like pynvml for one GPU with 3 GiB used, all of it this process's."""

    nvmlMemory_v2 = 0x02000028

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Any:
        return type("Mem", (), {"used": 3 * GiB, "total": 80 * GiB})()

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [type("P", (), {"pid": os.getpid(), "usedGpuMemory": 3 * GiB})()]


class CudaFixed(Fixed):
    name = "cuda"


def test_nvml_reading_time_is_part_of_the_sampling_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _Pynvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    acct = Accountant(CudaFixed(), io_budget=1.0)
    for step, phase in ((0, "load"), (1, "optimizer"), (2, "optimizer")):
        s = acct.sample(step, phase)
    assert s["device_used"] == 3 * GiB and s["non_allocator"] == 3 * GiB - (GiB + GiB // 2)
    acc = acct.summary(10.0)["accounting"]
    assert acc["io_reads"] >= 3 and 0 < acc["io_seconds"] <= acc["sampling_seconds"] < 1.0
