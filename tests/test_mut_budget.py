"""memory.budget without a unit, on the edges of the rule that a bare number below 1 MiB is a
unit left out. Written for survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import pytest
from finetune.budget import parse_budget
from finetune.errors import UserError


def test_a_bare_number_of_one_mib_or_more_counts_bytes() -> None:
    assert parse_budget("1048576", None) == 2**20
    assert parse_budget(2**20, None) == 2**20
    assert parse_budget("1MiB", None) == 2**20  # with a unit, any size is taken as said


@pytest.mark.parametrize(("text", "message"), [
    ("1048575", "memory.budget=1048575 is 1,048,575 bytes: did you mean 1048575MB? (a number without a unit counts bytes)"),
    ("999", "memory.budget=999 is 999 bytes: did you mean 999GB? (a number without a unit counts bytes)"),
    ("1000", "memory.budget=1000 is 1,000 bytes: did you mean 1000MB? (a number without a unit counts bytes)"),
])
def test_a_bare_number_below_one_mib_names_the_unit_meant(text: str, message: str) -> None:
    with pytest.raises(UserError) as e:
        parse_budget(text, None)
    assert str(e.value) == message
