"""The house has no hidden import knot (issue 22): the project's modules import each other in one
direction, deferred imports included, and nothing defers an import of the project's own to dodge
a cycle.

The graph is read from the source (AST), not from a running interpreter, so an import inside a
function body counts as much as one at the top: module-level and function-level ``import`` /
``from ... import``, ``importlib.import_module("...")`` with a literal (an f-string's ``{...}``
matches any one name), and the parent packages an import runs (``from finetune.planner.fit
import X`` runs ``finetune/planner/__init__.py`` first).
"""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the project's packages and their folders (pyproject's package-dir: backends/ installs as
# finetune.backends)
PACKAGES = {"finetune": REPO / "finetune", "finetune.backends": REPO / "backends"}

# The only project modules a function body may import: each imports a heavy framework at module
# level, so importing it where it is needed keeps `finetune --help`, mode=plan and finetune-report
# free of torch and mlx. finetune.backends.runtimes.get_backend loads the runtimes by name.
LAZY_FRAMEWORK_MODULES = {
    "finetune.backends.cuda.runtime": "torch, transformers, peft: the cuda runtime, loaded by get_backend",
    "finetune.backends.cuda.load": "torch: what the cuda runtime's setup loads with (device, checks, adapters)",
    "finetune.backends.cuda.optimizers": "torch: the cuda runtime's optimizers",
    "finetune.backends.cuda.files": "torch: the cuda runtime's adapter and checkpoint files",
    "finetune.backends.cuda.readings": "torch: the cuda runtime's memory readings (allocator, census)",
    "finetune.backends.cuda.loss": "torch: the cuda loss, used by the cuda runtime once a model is set up",
    "finetune.backends.cuda.varlen": "torch: packed rows' attention per sample, used by the cuda runtime",
    "finetune.backends.cuda.distributed": "torch.distributed: the cuda ranks, used by the cuda runtime under a launcher",
    "finetune.backends.cuda.measure": "torch: the cuda allocator's figures",
    "finetune.backends.cuda.offload": "torch: train.activation_offload's saved-tensor hooks, used by the cuda runtime",
    "finetune.backends.cuda.preference": "torch: the cuda preference step (objective=dpo|orpo|simpo)",
    "finetune.backends.cuda.shared_prompt": "torch: a pair micro-batch's log-probs with each prompt run once, in the cuda preference step",
    "finetune.backends.cuda.sharded_load": "torch, accelerate: fsdp's sharded load, used by the cuda runtime under FSDP",
    "finetune.backends.mlx.runtime": "mlx, mlx_lm: the mlx runtime, loaded by get_backend",
    "finetune.backends.mlx.loss": "mlx: the mlx loss, used by the mlx runtime once a model is set up",
    "finetune.backends.mlx.preference": "mlx: the mlx preference step (objective=dpo|orpo|simpo), in the mlx runtime",
    "finetune.backends.mlx.shared_prompt": "mlx: a pair micro-batch's log-probs with each prompt run once, in the mlx preference step",
    "finetune.backends.cuda.generate": "torch, transformers: mode=generate on cuda, used by the cuda runtime",
    "finetune.backends.mlx.distributed": "mlx: the mlx ranks, used by the mlx runtime",
    "finetune.backends.cuda.evaluate": "torch, lm_eval: mode=eval on cuda (lm-eval's HFLM), used by the cuda runtime",
    "finetune.backends.mlx.evaluate": "mlx_lm, lm_eval: mode=eval on mlx (mlx-lm's MLXLM), used by the mlx runtime",
}
FRAMEWORKS = {"torch", "mlx", "mlx_lm", "transformers", "peft", "bitsandbytes", "accelerate"}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    deferred: bool  # inside a function body
    implicit: bool = False  # a parent package the import runs first


def discover(packages: dict[str, Path]) -> dict[str, Path]:
    """Every module of ``packages``: dotted name -> file."""
    mods: dict[str, Path] = {}
    for pkg, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The project module an import of ``name`` loads (its longest known prefix)."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _literal(node: ast.expr) -> str | None:
    """An importlib argument as a pattern: a str literal, or an f-string with ``*`` per field."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
    return None


def imports_of(module: str, path: Path, mods: dict[str, Path]) -> list[Edge]:
    """The project modules ``module`` imports, with the line and whether a function body does it."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: list[Edge] = []

    def add(targets: list[str], line: int, deferred: bool) -> None:
        for target in targets:
            if target == module:
                continue
            edges.append(Edge(module, target, line, deferred))
            mine = set(_ancestors(module)) | {module}
            for parent in _ancestors(target):
                if parent in mods and parent not in mine:
                    edges.append(Edge(module, parent, line, deferred, implicit=True))

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                add([t for a in child.names if (t := _resolve(a.name, mods))], child.lineno, deferred)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    origin = ".".join(base + ([child.module] if child.module else []))
                else:
                    origin = child.module or ""
                found = []
                for a in child.names:
                    sub = f"{origin}.{a.name}"
                    found.append(sub if sub in mods else _resolve(origin, mods))
                add([t for t in dict.fromkeys(found) if t], child.lineno, deferred)
            elif (isinstance(child, ast.Call) and isinstance(child.func, (ast.Attribute, ast.Name))
                  and (child.func.attr if isinstance(child.func, ast.Attribute) else child.func.id) == "import_module"
                  and child.args and (pattern := _literal(child.args[0]))):
                add([m for m in mods if fnmatch.fnmatchcase(m, pattern)], child.lineno, deferred)
            visit(child, inner)

    visit(tree, False)
    return edges


def graph(packages: dict[str, Path] = PACKAGES) -> tuple[dict[str, Path], list[Edge]]:
    mods = discover(packages)
    return mods, [e for m, p in mods.items() for e in imports_of(m, p, mods)]


def find_cycle(nodes: list[str], edges: list[Edge]) -> list[Edge] | None:
    """One cycle of ``edges`` as its edges in order, or None."""
    out: dict[str, list[Edge]] = {n: [] for n in nodes}
    for e in edges:
        out[e.source].append(e)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[Edge] = []

    def dfs(node: str) -> list[Edge] | None:
        state[node] = 1
        for e in out[node]:
            if state.get(e.target) == 1:
                start = next(i for i, p in enumerate(path) if p.source == e.target) if e.target != node else len(path)
                return path[start:] + [e]
            if e.target not in state:
                path.append(e)
                found = dfs(e.target)
                if found:
                    return found
                path.pop()
        state[node] = 2
        return None

    for n in sorted(nodes):
        if n not in state and (found := dfs(n)):
            return found
    return None


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def describe_cycle(cycle: list[Edge], mods: dict[str, Path]) -> str:
    return "\n".join(f"  {e.source} -> {e.target}   ({_shown(mods[e.source])}:{e.line}"
                     f"{', in a function' if e.deferred else ''}{', its parent package' if e.implicit else ''})"
                     for e in cycle)


def dependency_order(nodes: list[str], edges: list[Edge]) -> list[str]:
    """The modules, each after every module it imports (the graph has no cycle)."""
    deps: dict[str, set[str]] = {n: set() for n in nodes}
    for e in edges:
        deps[e.source].add(e.target)
    order: list[str] = []
    done: set[str] = set()

    def place(n: str) -> None:
        if n in done:
            return
        done.add(n)
        for d in sorted(deps[n]):
            place(d)
        order.append(n)

    for n in sorted(nodes):
        place(n)
    return order


# ---- the project ---------------------------------------------------------------------------------

def test_no_import_cycle() -> None:
    mods, edges = graph()
    cycle = find_cycle(list(mods), edges)
    assert cycle is None, "an import cycle among the project's modules:\n" + describe_cycle(cycle, mods)


def test_no_deferred_import_of_the_project_but_lazy_framework_modules() -> None:
    mods, edges = graph()
    bad = sorted({f"{mods[e.source].relative_to(REPO)}:{e.line} imports {e.target} in a function"
                  for e in edges if e.deferred and not e.implicit and e.target not in LAZY_FRAMEWORK_MODULES})
    assert not bad, ("import these at module level (only a module that imports a framework may be imported "
                     "in a function; see LAZY_FRAMEWORK_MODULES):\n  " + "\n  ".join(bad))


def _module_level_framework_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.add(child.module.split(".")[0])
            visit(child)

    visit(tree)
    return found & FRAMEWORKS


def test_lazy_framework_modules_are_exactly_those_that_import_a_framework() -> None:
    """The allow list stays honest: each entry imports a framework at module level, and every
    other module imports none there."""
    mods = discover(PACKAGES)
    heavy = {m for m, p in mods.items() if _module_level_framework_imports(p)}
    assert heavy == set(LAZY_FRAMEWORK_MODULES), (heavy, set(LAZY_FRAMEWORK_MODULES))


def test_every_module_imports_in_dependency_order() -> None:
    """In a fresh interpreter, import each module after the ones it imports (as the graph says),
    then in another the same modules in the reverse order (each top module first): neither needs
    a deferred import. The lazy framework modules are left out (importing torch, transformers and
    mlx takes minutes on a busy CPU); the graph checks their imports."""
    mods, edges = graph()
    # finetune.__main__ runs the CLI when imported: it is an entry point, not a module to import
    order = [m for m in dependency_order(list(mods), edges) if m not in {*LAZY_FRAMEWORK_MODULES, "finetune.__main__"}]
    for names in (order, order[::-1]):
        code = f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)\n"
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                           check=False)
        assert r.returncode == 0, r.stdout + r.stderr


# ---- the checks can fail --------------------------------------------------------------------------

def _tiny_package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return {"finetune": root / "finetune"}


def test_a_planted_cycle_is_found(tmp_path: Path) -> None:
    """A cycle hidden by a deferred import and an importlib string, through a parent package."""
    pkgs = _tiny_package(tmp_path, {
        "finetune/__init__.py": "",
        "finetune/low.py": "def f():\n    from finetune.top import g\n",
        "finetune/mid/__init__.py": "from finetune.mid import inner\n",
        "finetune/mid/inner.py": "import importlib\ndef h(n):\n    return importlib.import_module(f'finetune.{n}')\n",
        "finetune/top.py": "from finetune.mid.inner import h\ng = 1\n",
        "finetune/leaf.py": "import os\n",
    })
    mods, edges = graph(pkgs)
    cycle = find_cycle(list(mods), edges)
    assert cycle is not None
    text = " ".join(f"{e.source}->{e.target}" for e in cycle)
    assert describe_cycle(cycle, mods)  # printable
    assert "finetune.low->finetune.top" in text, text
    deferred = {(e.source, e.target) for e in edges if e.deferred and not e.implicit}
    assert ("finetune.low", "finetune.top") in deferred
    assert ("finetune.mid.inner", "finetune.leaf") in deferred  # the f-string matches every module
    # the parent package an import runs: top imports finetune.mid.inner, so finetune.mid first
    assert any(e.source == "finetune.top" and e.target == "finetune.mid" and e.implicit for e in edges)


def test_a_package_without_cycles_passes(tmp_path: Path) -> None:
    pkgs = _tiny_package(tmp_path, {
        "finetune/__init__.py": "",
        "finetune/low.py": "X = 1\n",
        "finetune/top.py": "from finetune.low import X\nfrom . import low\n",
    })
    mods, edges = graph(pkgs)
    assert find_cycle(list(mods), edges) is None
    assert dependency_order(list(mods), edges).index("finetune.low") < dependency_order(list(mods), edges).index(
        "finetune.top")


@pytest.mark.parametrize("mode", ["deferred", "relative"])
def test_a_planted_deferred_import_is_reported(tmp_path: Path, mode: str) -> None:
    body = ("def f():\n    from finetune.low import X\n" if mode == "deferred" else
            "def f():\n    from .low import X\n")
    pkgs = _tiny_package(tmp_path, {"finetune/__init__.py": "", "finetune/low.py": "X = 1\n",
                                    "finetune/top.py": body})
    _, edges = graph(pkgs)
    assert [(e.source, e.target, e.line) for e in edges if e.deferred] == [("finetune.top", "finetune.low", 2)]
