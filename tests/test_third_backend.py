"""Adding a backend is a new folder, its YAML and one registry line (issue 22).

A copy of the package gets a stub third backend, ``stub``: its folder ``backends/stub/`` (its
capabilities, memory model, rules and runtime: the cuda backend's, renamed, since the point is
what the rest of the house needs and not a new framework), ``conf/backend/stub.yaml``, and its
name in the registry's ``BACKENDS``. The test checks that nothing else differs from this
checkout, then plans and trains with ``backend=stub`` through the CLI of that copy.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, needs_torch
import warm_cli

STUB = {
    "__init__.py": '"""A stub backend: the cuda backend under another name (tests/test_third_backend.py)."""\n',
    "capabilities.py": "from dataclasses import replace\n\n"
                       "from finetune.backends.cuda.capabilities import CAPABILITIES as _CUDA\n\n"
                       "CAPABILITIES = replace(_CUDA, name='stub', install='backend=stub needs torch')\n",
    "memory.py": "from finetune.backends.cuda.memory import *  # noqa: F403\n",
    "rules.py": "# the cuda backend's explanations are registered by its own rules module\n",
    "runtime.py": "from finetune.backends.cuda.runtime import CudaBackend\n\n\n"
                  "class BACKEND(CudaBackend):\n    name = 'stub'\n",
}


def _copy(dst: Path) -> Path:
    """finetune/ with conf/ and backends/ where an install puts them (finetune.conf, finetune.backends)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "finetune", dst / "finetune", ignore=ignore)
    shutil.copytree(REPO / "conf", dst / "finetune" / "conf", ignore=ignore)
    shutil.copytree(REPO / "backends", dst / "finetune" / "backends", ignore=ignore)
    return dst / "finetune"


def _differences(a: Path, b: Path, where: str = "") -> list[str]:
    """Paths that differ between two trees (added, removed or changed), relative to their roots."""
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [f"{where}{n}" for n in cmp.left_only + cmp.right_only + cmp.diff_files]
    for sub in cmp.common_dirs:
        out += _differences(a / sub, b / sub, f"{where}{sub}/")
    return out


@pytest.fixture(scope="module")
def stub_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("third")
    pristine, pkg = _copy(root / "pristine"), _copy(root / "stub")
    folder = pkg / "backends" / "stub"
    folder.mkdir()
    for name, text in STUB.items():
        (folder / name).write_text(text)
    yaml = (pkg / "conf" / "backend" / "cuda.yaml").read_text().replace("name: cuda", "name: stub")
    (pkg / "conf" / "backend" / "stub.yaml").write_text(yaml)
    registry = pkg / "backends" / "__init__.py"
    text = registry.read_text()
    assert text.count('BACKENDS = ("cuda", "mlx")') == 1
    registry.write_text(text.replace('BACKENDS = ("cuda", "mlx")', 'BACKENDS = ("cuda", "mlx", "stub")'))
    # what the stub touched: its folder, its YAML, one line of the registry, and nothing else
    changed = sorted(_differences(pristine, pkg))
    assert changed == ["backends/__init__.py", "backends/stub", "conf/backend/stub.yaml"], changed
    old, new = (pristine / "backends" / "__init__.py").read_text(), registry.read_text()
    assert sum(a != b for a, b in zip(old.splitlines(), new.splitlines())) == 1
    return root / "stub"


def _finetune(root: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    code = "import sys; import finetune; assert finetune.__file__.startswith(sys.argv[1]), finetune.__file__; " \
           "sys.argv = ['finetune', *sys.argv[2:]]; from finetune.cli import main; main()"
    return warm_cli.run([sys.executable, "-c", code, str(root), *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, env=env, cwd=root, timeout=600)


def test_a_stub_backend_plans_through_the_cli(stub_tree: Path, tmp_path: Path) -> None:
    r = _finetune(stub_tree, tmp_path / "plan", "backend=stub", "mode=plan", "model=tiny")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["backend"] == "stub" and plan["peak_bytes"] > 0
    r = _finetune(stub_tree, tmp_path / "bad", "backend=stub", "mode=plan", "optim=bogus")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: optim=bogus")


@needs_torch
def test_a_stub_backend_trains_through_the_cli(stub_tree: Path, tmp_path: Path) -> None:
    r = _finetune(stub_tree, tmp_path / "run", "backend=stub", "backend.device=cpu", "model=tiny", "train.steps=2",
                  "train.eval_every=0", "train.progress=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "backend=stub (asked for)" in r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_this_run"] == 2 and summary["backend"] == "stub"


def test_a_stub_backend_ships_in_the_wheel(tmp_path: Path) -> None:
    """The wheel of a checkout with the stub's folder holds finetune/backends/stub/ with no other
    change (setup.py finds the backends; pyproject.toml lists no packages)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("finetune", "conf", "backends"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    (src / "backends" / "stub").mkdir()
    for name, text in STUB.items():
        (src / "backends" / "stub" / name).write_text(text)
    r = warm_cli.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".",
                        "-w", str(tmp_path / "dist")], capture_output=True, text=True, cwd=src, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import zipfile

    (wheel,) = (tmp_path / "dist").glob("finetune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"finetune/backends/stub/{n}" for n in STUB} <= names
    for pkg in ("finetune/backends/cuda/runtime.py", "finetune/backends/mlx/runtime.py", "finetune/planner/fit.py",
                "finetune/accounting/rules.py", "finetune/conf/config.yaml"):
        assert pkg in names, pkg
