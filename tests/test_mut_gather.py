"""Figures of several ranks merged: devices counted once, pressure never summed, timelines
aligned on the moments every rank sampled."""

from __future__ import annotations

from finetune.accounting.gather import gather, gather_timeline

GiB = 1 << 30


def _rank(rank: int, step: int, used: int, psi: float) -> dict:
    return {"step": step, "phase": "optimizer", "rank": rank, "host": "h", "allocated": GiB, "reserved": 2 * GiB,
            "device_used": used, "device_total": 80 * GiB, "other_processes_used": 0, "psi_full_avg10": psi,
            "devices": [{"index": rank, "device_used": used, "device_total": 80 * GiB, "other_processes_used": 0}]}


def test_device_figures_are_summed_over_devices_and_pressure_is_never_summed() -> None:
    g = gather([_rank(0, 3, 3 * GiB, 1.5), _rank(1, 3, 5 * GiB, 7.0)])
    ov = g["overall"]
    assert ov["device_used"] == {"sum": 8 * GiB, "min": 3 * GiB, "max": 5 * GiB, "max_rank": 1}
    assert ov["device_total"]["sum"] == 160 * GiB and g["num_devices"] == 2
    assert ov["psi_full_avg10"] == {"sum": None, "min": 1.5, "max": 7.0, "max_rank": 1}
    assert ov["psi_some_avg10"] == {"sum": None, "min": None, "max": None, "max_rank": None}
    assert ov["non_allocator"]["sum"] == 8 * GiB - 4 * GiB


def test_timelines_meet_at_the_moments_every_rank_sampled() -> None:
    a = [_rank(0, s, GiB, 0.0) for s in (1, 2, 3)]
    b = [_rank(1, s, 2 * GiB, 0.0) for s in (2, 3, 4)]
    tl = gather_timeline([a, b])
    assert [t["step"] for t in tl] == [2, 3]
    assert [t["overall"]["device_used"]["sum"] for t in tl] == [3 * GiB, 3 * GiB]
    assert gather_timeline([]) == []
