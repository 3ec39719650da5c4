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
