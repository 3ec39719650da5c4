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


def test_the_loss_counts_every_target_after_the_first_token() -> None:
    import numpy as np
    from finetune.backends.base import Batch

    # a prompt token, then targets at positions 1 and 2 (row 0) and 1, 2, 3 (row 1)
    mask = np.array([[0, 1, 1, 0], [0, 1, 1, 1]], np.int8)
    b = Batch(input_ids=np.zeros((2, 4), np.int32), loss_mask=mask, lengths=np.array([3, 4], np.int32))
    assert b.label_tokens == 5 and b.tokens == 7


def test_a_named_backend_is_itself_and_an_unknown_one_is_refused_with_the_choices() -> None:
    from finetune.backends import concrete_name

    from finetune.errors import UserError

    assert concrete_name("cuda") == "cuda" and concrete_name("mlx") == "mlx"
    with pytest.raises(UserError, match=r"^backend.name=tpu is not valid; choose one of: auto, cuda, mlx$"):
        concrete_name("tpu")
