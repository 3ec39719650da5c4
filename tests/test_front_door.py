"""The front door without patches (issue 32): Hydra's own functions stay Hydra's, a config that
does not compose is refused before Hydra makes anything (a sweep's every value included), and
a run dir or sweep dir that cannot be made is refused in one line by the run dir's callback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import finetune_cmd
import warm_cli


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_a_command_leaves_hydras_functions_as_they_were(tmp_path, monkeypatch):
    import hydra._internal.utils as hydra_utils
    import hydra.core.utils as hydra_core_utils

    from finetune import cli

    before = (hydra_core_utils.configure_log, hydra_utils.run_and_report, hydra_core_utils.run_job)
    monkeypatch.setattr(sys, "argv", ["finetune", "mode=plan", f"hydra.run.dir={tmp_path / 'plan'}"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 0 and (tmp_path / "plan" / ".hydra" / "config.yaml").is_file()
    assert (hydra_core_utils.configure_log, hydra_utils.run_and_report, hydra_core_utils.run_job) == before


def test_a_sweep_with_a_bad_value_is_refused_before_its_first_job(tmp_path):
    out = tmp_path / "sweep"
    r = warm_cli.run([*finetune_cmd(), "-m", "mode=plan", "train.steps=2,abc", f"hydra.sweep.dir={out}"],
                       capture_output=True, text=True, timeout=120)
    assert "give train.steps a whole number" in _one_line(r)
    assert not out.exists()


@pytest.mark.parametrize("multirun", [False, True])
def test_a_dir_that_cannot_be_made_is_one_line(tmp_path, multirun):
    (tmp_path / "file").write_text("")
    where = tmp_path / "file" / "run"
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    r = warm_cli.run([*finetune_cmd(), *(["-m"] if multirun else []), "mode=plan", f"{key}={where}"],
                       capture_output=True, text=True, timeout=120)
    line = _one_line(r)
    assert "(Not a directory)" in line and f"set {key}= to a writable directory" in line, line
