"""Byte formatting for people. Files keep ints of bytes; only printed text uses units.

Binary units throughout: KiB = 2^10, MiB = 2^20, GiB = 2^30, TiB = 2^40 bytes.
"""

from __future__ import annotations

_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def fmt_bytes(n: float | None) -> str:
    """Format a byte count with a binary unit and three significant digits.

    Args:
        n: bytes, or None for a figure that could not be measured.

    Returns:
        e.g. "1.50 GiB", "12.0 MiB", "512 B", "-3.00 MiB"; "n/a" for None.
    """
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    a = abs(n)
    for k, (size, unit) in enumerate(_UNITS):
        if a >= size or (k > 0 and a >= size - size // 2048):  # 1023.9 KiB prints as 1.00 MiB
            v = a / size
            # three significant digits
            digits = 2 if v < 9.995 else 1 if v < 99.95 else 0
            return f"{sign}{v:.{digits}f} {unit}"
    return f"{sign}{round(a)} B"


def fmt_delta(n: float | None) -> str:
    """Like fmt_bytes with an explicit sign for growth: "+1.00 GiB", "-12.0 MiB", "+0 B"."""
    if n is None:
        return "n/a"
    return fmt_bytes(n) if n < 0 else "+" + fmt_bytes(n)
