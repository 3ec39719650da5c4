"""The per-rank memory table rank 0 prints: each rank's report from its own run, the
Overall/min/max rows, and which rank held the max."""

from __future__ import annotations

from finetune.accounting.ranks import merge, rank_report, render_rank_table

GiB = 1 << 30


def _report(rank: int, peak: int, last_alloc: int) -> dict:
    summary = {"peaks": {"allocated_bytes": peak, "reserved_bytes": peak + GiB}, "devices": []}
    samples = [{"host": "h", "allocated": GiB // 4, "reserved": GiB // 2},
               {"host": "h", "allocated": last_alloc, "reserved": 2 * last_alloc}]
    return rank_report(rank, f"cuda:{rank}", summary, samples)


def test_a_rank_reports_its_last_sample_and_its_run_peaks() -> None:
    r = _report(1, 3 * GiB, 2 * GiB)
    assert (r["rank"], r["host"], r["device"]) == (1, "h", "cuda:1")
    assert r["allocated"] == 2 * GiB and r["reserved"] == 4 * GiB
    assert r["peak_allocated"] == 3 * GiB and r["peak_reserved"] == 4 * GiB


def test_the_max_row_names_the_rank_and_the_min_row_does_not() -> None:
    text = render_rank_table(merge([_report(0, 2 * GiB, GiB), _report(1, 3 * GiB, GiB)]))
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines()[5:8]}
    assert rows["Overall"][-4:] == ["5.00", "GiB", "7.00", "GiB"]
    assert rows["min"][1:] == ["2.00", "GiB", "3.00", "GiB"]
    assert rows["max"][1:] == ["3.00", "GiB", "(r1)", "4.00", "GiB", "(r1)"]
