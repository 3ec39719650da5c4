"""The type checker holds (issue 22): mypy over finetune/ and backends/ (as finetune.backends, the
name they are installed and imported by) reports no error, the same check CI runs before the
tests (scripts/typecheck.py, configured by pyproject.toml's [tool.mypy]).

Records (samples, census, plan) are TypedDicts in finetune/records.py and the memory categories
are Literal types there, so a misspelt category or a plan key read that plan() never writes is an
error here, not a None in a report. mypy's cache (.mypy_cache, shared with CI's step) keeps a
re-run to seconds.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed: pip install -e '.[dev]' (or bash scripts/setup.sh dev)")
def test_mypy_finds_no_error() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "typecheck.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"mypy found type errors:\n{proc.stdout}{proc.stderr}"
    assert "Success: no issues found" in proc.stdout


def test_records_define_each_category_once() -> None:
    """The census categories, the plan's and the tokenizer files each have one definition."""
    from finetune import records
    from finetune.accounting import ALLOCATOR_HELD, CENSUS_KEYS
    from finetune.model.source import TOKENIZER_FILES

    assert CENSUS_KEYS is records.CENSUS_KEYS and ALLOCATOR_HELD is records.ALLOCATOR_HELD
    assert set(ALLOCATOR_HELD) == set(CENSUS_KEYS) - {"optimizer_state_paged"}
    assert tuple(records.Census.__annotations__) == (*CENSUS_KEYS, records.ACTIVATIONS_AND_OTHER)
    assert tuple(records.PlanBytes.__annotations__) == records.PLAN_KEYS
    assert set(records.RANK_KEYS) <= set(records.PLAN_KEYS)
    sources = [p for p in (REPO / "finetune").rglob("*.py")] + [p for p in (REPO / "backends").rglob("*.py")]
    defined = {name: [str(p.relative_to(REPO)) for p in sources
                      if any(line.lstrip("_").startswith(name + " =") or line.lstrip("_").startswith(name + ":")
                             for line in p.read_text().splitlines())]
               for name in ("CENSUS_KEYS", "ALLOCATOR_HELD", "TOKENIZER_FILES", "PLAN_KEYS", "RANK_KEYS")}
    assert defined == {"CENSUS_KEYS": ["finetune/records.py"], "ALLOCATOR_HELD": ["finetune/records.py"],
                       "TOKENIZER_FILES": ["finetune/model/source.py"], "PLAN_KEYS": ["finetune/records.py"],
                       "RANK_KEYS": ["finetune/records.py"]}
    assert "tokenizer.json" in TOKENIZER_FILES
