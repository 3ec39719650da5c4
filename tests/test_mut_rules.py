"""Accounting rules on recorded timelines: which phase and which figures a sentence names.

Pure functions of samples; each test plants the timeline a user's run would produce and asserts
the rule, the phase and the exact deltas."""

from __future__ import annotations

from finetune.accounting.rules import explain

GiB, MiB = 1 << 30, 1 << 20


def rec(step: int, phase: str, **kw):
    return {"step": step, "phase": phase, **kw}


def test_step_growth_names_the_phase_where_reserved_leapt_not_where_allocated_grew_most() -> None:
    # forward: reserved +1 GiB, allocated flat (the allocator's cache); optimizer: both +64 MiB
    tl = [rec(1, "forward", allocated=GiB, reserved=2 * GiB), rec(1, "optimizer", allocated=GiB, reserved=2 * GiB),
          rec(2, "forward", allocated=GiB, reserved=3 * GiB),
          rec(2, "optimizer", allocated=GiB + 64 * MiB, reserved=2 * GiB + 64 * MiB)]
    ex = {e["rule"]: e for e in explain(tl)}
    r = ex["reserved_growth_step2"]
    assert "allocated_growth_step2" not in ex
    assert r["figures"]["reserved_delta"] == GiB and r["figures"]["allocated_delta"] == 0
    assert "at the forward phase" in r["text"]


def test_step_growth_with_live_data_is_allocated_growth_at_its_phase() -> None:
    # reserved and allocated grow together at the optimizer step: new live data, not cache
    tl = [rec(1, "optimizer", allocated=GiB, reserved=GiB), rec(2, "optimizer", allocated=2 * GiB, reserved=2 * GiB)]
    ex = {e["rule"]: e for e in explain(tl)}
    a = ex["allocated_growth_step2"]
    assert "reserved_growth_step2" not in ex
    assert a["figures"]["allocated_delta"] == GiB and a["figures"]["reserved_delta"] == GiB
    assert a["text"].startswith("Allocated grew by 1.00 GiB between step 1 and step 2 at the optimizer phase")
