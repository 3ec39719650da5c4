"""A non-editable install carries the Hydra configs, so `finetune` works from any directory."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO


def test_wheel_carries_configs_and_entry_points(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    wheel = next(Path(tmp_path).glob("finetune-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    conf = {n for n in names if n.startswith("finetune/conf/")}
    expected = {p.relative_to(REPO / "conf").as_posix() for p in (REPO / "conf").rglob("*.yaml")}
    assert {f"finetune/conf/{e}" for e in expected} <= conf, sorted(expected - {c[len("finetune/conf/"):] for c in conf})
    assert "finetune/backends/cuda/runtime.py" in names and "finetune/backends/mlx/runtime.py" in names
    assert not [n for n in names if n.startswith("backends/")]  # nothing generic at the top of site-packages
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(ep).decode()
    assert "finetune = finetune.cli:main" in text and "finetune-report = finetune.report:main" in text
    assert "finetune-export = finetune.export:main" in text
    # Installed elsewhere, the configs resolve from the package, not from this checkout.
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", "import finetune.cli, sys; print(finetune.cli.__file__); "
                        "sys.argv=['finetune','--help']; finetune.cli.main()"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(str(target)), r.stdout[:200]  # the installed copy, not this checkout
    assert "model: gemma3-12b, gpt-oss-20b, llama2-70b, llama2-7b, llama3-8b, llama3.1-405b, llama3.1-8b" in r.stdout
    # and from outside a checkout there is no top-level `backends` package to import
    r = subprocess.run([sys.executable, "-c", "import backends"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "No module named 'backends'" in r.stderr
