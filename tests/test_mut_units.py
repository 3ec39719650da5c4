"""Byte counts as printed in tables and sentences: binary units, three significant digits."""

from __future__ import annotations

import pytest

from finetune.accounting import fmt_bytes, fmt_delta  # the package keeps them wherever they live


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
                                         (12 * 2**20, "12.0 MiB"), (2**20 - 100, "1.00 MiB"),
                                         (2**20 - 2**10, "1023 KiB"), (3 * 2**29, "1.50 GiB"),
                                         (2**40, "1.00 TiB"), (-3 * 2**20, "-3.00 MiB"), (None, "n/a")])
def test_fmt_bytes(n, text: str) -> None:
    assert fmt_bytes(n) == text


def test_fmt_delta_signs_growth() -> None:
    assert (fmt_delta(2**30), fmt_delta(0), fmt_delta(-12 * 2**20)) == ("+1.00 GiB", "+0 B", "-12.0 MiB")
