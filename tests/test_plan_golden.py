"""plan.json, byte for byte: the seeds' commands and each family/method on each backend
(tests/data/plans/configs.txt) plan exactly as the files written by scripts/golden_plans.py.

A refactor of the planner, the config or the memory models must leave every byte as it was. A
change to the planner's math rewrites the files (`python scripts/golden_plans.py`), and the
diff shows every figure that moved, for review."""

from __future__ import annotations

import os
import shutil
import sys

from conftest import REPO
import warm_cli


def test_every_golden_plan_is_byte_equal() -> None:
    r = warm_cli.run([sys.executable, str(REPO / "scripts" / "golden_plans.py"), "--check"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_check_sees_a_changed_byte(tmp_path) -> None:
    """The check is not vacuous: one figure changed in one file is reported by name."""
    plans = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", plans / "scripts")
    shutil.copytree(REPO / "tests" / "data" / "plans", plans / "tests" / "data" / "plans")
    f = plans / "tests" / "data" / "plans" / "cuda-tiny-lora.json"
    f.write_text(f.read_text().replace('"batch_size": 4', '"batch_size": 5', 1))
    r = warm_cli.run([sys.executable, str(plans / "scripts" / "golden_plans.py"), "--check"],
                       capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 1
    assert "plan.json differs for: cuda-tiny-lora" in r.stderr
