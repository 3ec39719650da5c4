"""Type-check finetune/ and backends/ with mypy, under the names they are installed as.

    python3 scripts/typecheck.py            # what CI runs (pyproject.toml's [tool.mypy] applies)

backends/ installs as ``finetune.backends`` (pyproject's package-dir), and the code imports it
by that name. mypy cannot follow setuptools' editable-install finder, so ``mypy finetune
backends`` would check backends/ as a package named ``backends`` and leave every
``finetune.backends...`` import unresolved (Any): the Backend and MemoryModel Protocols, the
census and the memory models would go unchecked across that line. This script lays out the
installed shape as links (build/typecheck/finetune/* -> finetune/*, .../finetune/backends ->
backends/), runs mypy there, and prints each error with its path in the checkout.
Exit status: mypy's (0 clean, 1 errors, 2 mypy itself failed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "build" / "typecheck"
# the installed name of each top-level folder checked (pyproject's package-dir)
PACKAGES = {"finetune": REPO / "finetune", "finetune/backends": REPO / "backends"}


def lay_out_tree() -> Path:
    """build/typecheck/finetune as installed: a link per entry of finetune/ plus backends/."""
    pkg = TREE / "finetune"
    pkg.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in PACKAGES["finetune"].iterdir() if p.name != "__pycache__"}
    wanted["backends"] = PACKAGES["finetune/backends"]
    for link in pkg.iterdir():
        if link.name not in wanted or not link.is_symlink() or link.resolve() != wanted[link.name].resolve():
            link.unlink()
    for name, target in wanted.items():
        link = pkg / name
        if not link.is_symlink():
            link.symlink_to(target, target_is_directory=target.is_dir())
    return pkg


def checkout_path(line: str) -> str:
    """An error line with its tree path (finetune/backends/x.py) given as the checkout's."""
    return line.replace("finetune/backends/", "backends/", 1) if line.startswith("finetune/backends/") else line


def main(argv: list[str] | None = None) -> int:
    lay_out_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
           "--cache-dir", str(REPO / ".mypy_cache"), "-p", "finetune", *(argv or [])]
    # run from the tree so that `finetune` is the linked package (and not the checkout's
    # finetune/, which has no backends/ inside)
    proc = subprocess.run(cmd, cwd=TREE, capture_output=True, text=True,
                          env={**os.environ, "MYPYPATH": str(TREE)})
    for line in proc.stdout.splitlines():
        print(checkout_path(line))
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
