"""Files as the umask says: everything finetune writes (the atomic writers' temporary names and
safetensors' own 0600 files included) comes out 0644/0755 under umask 022 and 0600/0700 under
077, through the real console scripts: a tiny LoRA run on each backend (checkpoints, adapter,
summary.json, metrics.jsonl, memory.png), finetune-export (an adapter in the other
format, a merged model), finetune-report (the sweep summaries and chart, the same writers a
sweep's report uses) and mode=plan (plan.json)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import HAS_MLX, finetune_cmd, needs_torch
import warm_cli

# umask -> (a file's mode, a directory's mode): what open() and mkdir() give under it
MODES = {0o022: (0o644, 0o755), 0o077: (0o600, 0o700)}
TRAIN = ("train.steps=2", "train.save_every=1", "train.eval_every=1", "train.progress=false", "data.num_samples=40")


def _script(name: str, module: str) -> list[str]:
    """The installed console script ``name`` of this interpreter (it imports the package first
    on PYTHONPATH, as finetune_cmd's does), else ``python -m module``."""
    script = Path(sysconfig.get_path("scripts")) / name
    if script.is_file() and Path(sys.executable).parent == script.parent:
        return [str(script)]
    return [sys.executable, "-m", module]


def _under(umask: int, *cmd: str) -> subprocess.CompletedProcess:
    r = warm_cli.run(list(cmd), capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(umask))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _wrong_modes(root: Path, umask: int) -> dict[str, str]:
    """Every file and directory under ``root`` (itself included) whose mode is not the umask's."""
    file_mode, dir_mode = MODES[umask]
    wrong = {}
    for p in (root, *root.rglob("*")):
        st = p.lstat()
        want = dir_mode if stat.S_ISDIR(st.st_mode) else file_mode if stat.S_ISREG(st.st_mode) else None
        if want is not None and stat.S_IMODE(st.st_mode) != want:
            wrong[str(p.relative_to(root.parent))] = oct(stat.S_IMODE(st.st_mode))
    return wrong


# Each umask once, each backend once (mlx where it is installed): every writer shares the one
# mechanism (finetune.io), and two runs per umask would double the file's time.
CASES = [(0o022, "cuda"), (0o077, "mlx" if HAS_MLX else "cuda")]


@needs_torch
@pytest.mark.parametrize("umask, backend", CASES, ids=[f"umask{m:03o}-{b}" for m, b in CASES])
def test_every_file_a_run_export_report_and_plan_write_has_the_umasks_mode(tmp_path: Path, umask: int,
                                                                           backend: str) -> None:
    finetune, export = finetune_cmd(), _script("finetune-export", "finetune.export")
    run = tmp_path / "run"
    _under(umask, *finetune, f"backend={backend}", *TRAIN, f"hydra.run.dir={run}")
    # what the issue found 0600/0700 under umask 022, and what was right already: each named, so
    # a file not written fails here rather than passing the mode check unseen
    weights = "adapter_model.safetensors" if backend == "cuda" else "adapters.safetensors"
    for name in ("summary.json", f"adapter/{weights}", "checkpoints/step_0000002/trainer_state.json",
                 "metrics.jsonl", "memory.png", ".hydra/config.yaml"):
        assert (run / name).is_file(), name
    if backend == "cuda":  # the merged model: safetensors writes model.safetensors 0600 itself
        out = tmp_path / "merged"
        _under(umask, *export, "--merge", str(run), str(out))
        assert (out / "model.safetensors").is_file()
    else:
        out = tmp_path / "as-peft"
        _under(umask, *export, "--to", "peft", str(run), str(out))
        assert (out / "adapter_model.safetensors").is_file()
    report = tmp_path / "report"
    _under(umask, *_script("finetune-report", "finetune.report"), str(run), "--out", str(report))
    assert {p.name for p in report.iterdir()} == {"sweep_summary.csv", "sweep_summary.md", "sweep_memory.png"}
    plan = tmp_path / "plan"
    _under(umask, *finetune, "mode=plan", f"hydra.run.dir={plan}")
    assert (plan / "plan.json").is_file()
    made = [run, out, report, plan]
    wrong = {k: v for d in made for k, v in _wrong_modes(d, umask).items()}
    assert not wrong, f"not {MODES[umask][0]:o}/{MODES[umask][1]:o} under umask {umask:03o}: {wrong}"
    # and nothing a temporary name left behind
    assert not [p for d in made for p in d.rglob(".*") if p.name.endswith((".tmp", ".old"))]


def test_the_atomic_writers_follow_any_umask(tmp_path: Path) -> None:
    """In-process, under umask 027 (neither of the above): atomic_write_json gives 0640;
    atomic_dir gives its directory and subdirectories 0750, safetensors' own 0600 file 0640,
    and a file with an execute bit 0750, as open()/mkdir()/a compiler would under that umask."""
    import numpy as np
    from safetensors.numpy import save_file

    from finetune.io import atomic_dir, atomic_write_json

    old = os.umask(0o027)
    try:
        atomic_write_json(tmp_path / "s.json", {"a": 1})
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "sub").mkdir()
            save_file({"w": np.zeros(2, np.float32)}, str(tmp / "sub" / "w.safetensors"))
            (tmp / "run.sh").write_text("#!/bin/sh\n")
            (tmp / "run.sh").chmod(0o700)
    finally:
        os.umask(old)
    got = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in sorted(tmp_path.rglob("*"))}
    assert got == {"s.json": "0o640", "d": "0o750", "d/sub": "0o750", "d/sub/w.safetensors": "0o640",
                   "d/run.sh": "0o750"}
