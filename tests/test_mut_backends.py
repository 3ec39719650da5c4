"""backend=auto's choice where a user's machine decides it. Written for survivors of the
mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import platform
import sys

import pytest
from finetune.backends import resolve_backend_name


@pytest.mark.parametrize(("os_name", "machine", "want"), [
    ("darwin", "arm64", "mlx"),  # Apple Silicon
    ("darwin", "x86_64", "cuda"),  # an Intel Mac: no Metal for mlx
    ("linux", "arm64", "cuda"),  # an ARM Linux box (Graviton, Grace): not a Mac
    ("linux", "aarch64", "cuda"),
])
def test_auto_picks_mlx_only_on_apple_silicon(monkeypatch: pytest.MonkeyPatch, os_name: str, machine: str,
                                              want: str) -> None:
    monkeypatch.setattr(sys, "platform", os_name)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    assert resolve_backend_name("auto")[0] == want
    assert resolve_backend_name("mlx") == ("mlx", "backend=mlx (asked for)")


@pytest.mark.parametrize(("longest", "multiple", "max_len", "want"), [
    (10, 8, None, 17),  # input 9 tokens -> 16, plus the last target
    (9, 8, None, 9),  # input 8 tokens: already a multiple
    (2, 32, None, 33),  # mlx-lm's 1 + a multiple of 32
    (70, 32, None, 97),
    (70, 32, 80, 80),  # capped at max_len
    (90, 32, 80, 90),  # never below the longest sample
    (10, 1, None, 10),  # no padding asked
    (1, 8, None, 1),
])
def test_padded_length_rounds_the_model_input_up_to_the_multiple(longest: int, multiple: int, max_len: int | None,
                                                                 want: int) -> None:
    from backends.base import padded_length

    assert padded_length(longest, multiple, max_len) == want
