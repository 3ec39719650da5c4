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


def _opt(step: int, allocated: int, reserved: int) -> dict:
    return rec(step, "optimizer", allocated=allocated, reserved=reserved)


def test_growth_under_1_mib_per_step_is_no_leak_and_2_mib_is() -> None:
    # steps 3-10 after warm-up, allocated and reserved growing together each step
    slow = [_opt(s, GiB + s * 512 * 1024, 2 * GiB + s * 512 * 1024) for s in range(1, 11)]
    assert {e["rule"] for e in explain(slow)} & {"leak", "cache_growth"} == set()
    fast = [_opt(s, GiB + s * 2 * MiB, 2 * GiB + s * 2 * MiB) for s in range(1, 11)]
    leak = {e["rule"]: e for e in explain(fast)}["leak"]
    assert leak["figures"]["bytes_per_step"] == 2 * MiB and leak["figures"]["growth"] == 14 * MiB
    assert leak["text"].startswith("allocated keeps growing after each optimizer step: +2.00 MiB per step "
                                   "(linear fit over steps 3-10), +14.0 MiB in total, up in 100% of steps.")


def test_reserved_that_jumped_once_is_no_steady_cache_growth() -> None:
    # reserved flat over steps 3-7, then one 1 GiB jump at step 8: rising in 1 of 5 steps
    once = [_opt(s, GiB, 2 * GiB + (GiB if s == 8 else 0)) for s in range(3, 9)]
    assert "cache_growth" not in {e["rule"] for e in explain(once)}
    steady = [_opt(s, GiB, 2 * GiB + s * 64 * MiB) for s in range(3, 9)]
    cg = {e["rule"]: e for e in explain(steady)}["cache_growth"]
    assert cg["figures"]["reserved_bytes_per_step"] == 64 * MiB and cg["figures"]["allocated_bytes_per_step"] == 0
    assert cg["text"].startswith("Reserved grows by +64.0 MiB per step (linear fit over steps 3-8, now 2.50 GiB) "
                                 "while allocated stays near 1.00 GiB (+0 B per step): the caching allocator")


def test_swap_growth_names_the_largest_growth_not_the_last() -> None:
    tl = [rec(s, "optimizer", swap_growth=g) for s, g in ((1, 0), (2, 100 * MiB), (3, 50 * MiB))]
    sw = {e["rule"]: e for e in explain(tl)}["swap_growth"]
    assert sw["figures"]["swap_growth"] == 100 * MiB
    assert sw["text"] == ("System swap grew by 100 MiB during the run (first at the optimizer phase of step 2): "
                          "the OS moved memory pages to disk, so expect slow steps.")


FIX = ("lower train.batch_size (raising train.grad_accum keeps the batch) or train.seq_len, turn on "
       "train.grad_checkpointing, or set memory.budget so the governor does it")


def test_mlx_peak_over_ram_says_the_governor_did_nothing_and_to_set_a_budget() -> None:
    tl = [rec(3, "optimizer", backend="mlx", mlx_peak=20 * GiB)]
    ex = {e["rule"]: e for e in explain(tl, {"system_total": 16 * GiB})}
    e = ex["mlx_peak_over_ram"]
    assert e["text"] == ("MLX peak memory 20.0 GiB (step 3) is above the 16.0 GiB of RAM by 4.00 GiB: unified memory "
                         "cannot hold it, so the OS kept the run going by compressing and swapping; the governor "
                         "changed nothing; set memory.budget so it keeps the run under RAM. To stay in RAM: "
                         + FIX + ".")
    assert e["figures"] == {"peak": 20 * GiB, "ram": 16 * GiB, "over": 4 * GiB}
    with_budget = explain(tl, {"system_total": 16 * GiB, "budget_set": True})
    assert "the governor changed nothing. To stay in RAM" in with_budget[-1]["text"]


def test_mlx_peak_over_the_working_set_but_under_ram() -> None:
    tl = [rec(3, "optimizer", backend="mlx", mlx_peak=20 * GiB, mlx_recommended_working_set=18 * GiB)]
    e = {e["rule"]: e for e in explain(tl, {"system_total": 32 * GiB, "budget_set": True})}["mlx_peak_over_working_set"]
    assert e["text"] == ("MLX peak memory 20.0 GiB (step 3) is above Metal's recommended working set 18.0 GiB by "
                         "2.00 GiB (RAM 32.0 GiB): the GPU may have to page memory; the governor changed nothing. "
                         "To stay in RAM: " + FIX + ".")
    assert e["figures"]["over"] == 2 * GiB
    under = [rec(3, "optimizer", backend="mlx", mlx_peak=10 * GiB, mlx_recommended_working_set=18 * GiB)]
    assert explain(under, {"system_total": 32 * GiB}) == []
