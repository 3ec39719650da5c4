"""Accounting rules at their thresholds (constants imported from the rules' own table)."""

from __future__ import annotations

from finetune.accounting import rules


def _sample(step: int, swap_growth: int) -> dict:
    return {"step": step, "phase": "optimizer", "swap_growth": swap_growth}


def test_swap_rule_names_the_first_sample_at_the_threshold():
    low = rules.DEFAULTS["swap_min_bytes"]
    assert rules.rule_swap([_sample(1, 0), _sample(2, low - 1)], rules.DEFAULTS) == []  # under it: noise
    (ex,) = rules.rule_swap([_sample(1, 0), _sample(2, low), _sample(3, 2 * low)], rules.DEFAULTS)
    assert ex["rule"] == "swap_growth" and ex["figures"]["swap_growth"] == 2 * low
    assert "(first at the optimizer phase of step 2)" in ex["text"]  # growth reached the threshold there
