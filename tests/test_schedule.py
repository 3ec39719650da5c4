"""The learning-rate schedule: lr_at against values worked by hand, every schedule and edge.

The metrics side (each step's `lr` in metrics.jsonl, and the rate the optimizer really got)
is checked on a real run in test_values.py.
"""

from __future__ import annotations

import math

import functools
from dataclasses import replace

import pytest
from conftest import make_spec

from finetune.run.loop import lr_at


@functools.cache
def _base():
    return make_spec("/tmp/unused-schedule")  # resolved once; each case replaces its four numbers


def _cfg(schedule: str, steps: int, warmup: int, lr: float = 1.0):
    b = _base()
    return replace(b, optim=replace(b.optim, lr=lr),
                   train=replace(b.train, steps=steps, warmup_steps=warmup, schedule=schedule))


def _lrs(schedule: str, steps: int, warmup: int, lr: float = 1.0) -> list[float]:
    cfg = _cfg(schedule, steps, warmup, lr)
    return [lr_at(s, cfg) for s in range(1, steps + 1)]


def test_warmup_is_linear_from_the_first_step():
    """Warmup 4 of lr 0.02: step 1 already trains (0.005), step 4 reaches the base rate."""
    got = _lrs("constant", 6, 4, lr=0.02)
    assert got == pytest.approx([0.005, 0.01, 0.015, 0.02, 0.02, 0.02], rel=1e-12)
    assert got[0] > 0  # lr 0 at step 1 would waste the first batch


def test_constant_without_warmup():
    assert _lrs("constant", 3, 0, lr=3e-4) == [3e-4, 3e-4, 3e-4]


def test_linear_decays_to_zero_at_the_last_step():
    # warmup 2 of 6 steps: after it, frac = (step - 2) / 4 -> 0.25, 0.5, 0.75, 1
    assert _lrs("linear", 6, 2) == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-12)
    assert _lrs("linear", 4, 0) == pytest.approx([0.75, 0.5, 0.25, 0.0], abs=1e-12)
    assert _lrs("linear", 3, 2) == pytest.approx([0.5, 1.0, 0.0], abs=1e-12)  # one step after warmup: frac 1


def test_cosine_by_hand():
    # warmup 2 of 6: 0.5 (1 + cos(pi frac)) at frac 1/4, 1/2, 3/4, 1
    r = math.sqrt(0.5)
    assert _lrs("cosine", 6, 2) == pytest.approx([0.5, 1.0, 0.5 * (1 + r), 0.5, 0.5 * (1 - r), 0.0], abs=1e-12)
    # no warmup, 3 steps: frac 1/3, 2/3, 1 -> 0.75, 0.25, 0
    assert _lrs("cosine", 3, 0) == pytest.approx([0.75, 0.25, 0.0], abs=1e-12)


def test_warmup_as_long_as_the_run_stays_on_the_ramp():
    """warmup >= steps: every step is on the ramp (the schedule never starts), none divides by zero."""
    assert _lrs("cosine", 3, 3) == pytest.approx([1 / 3, 2 / 3, 1.0], rel=1e-12)
    assert _lrs("linear", 2, 4) == pytest.approx([0.25, 0.5], rel=1e-12)
