"""Mutation testing of the core modules: plant one small bug at a time, run the tests that
should notice, count what they kill.

    python benchmarks/mutation.py                    # every target, results printed
    python benchmarks/mutation.py --out benchmarks/results/mutation.txt
    python benchmarks/mutation.py --only governor    # targets whose file or function matches
    python benchmarks/mutation.py --list             # the mutants, nothing run

Mutants are generated, not hand-picked: in each target function every comparison (< <=,
> >=, == !=, in / not in, is / is not), arithmetic operator (+ -, * /, // /), boolean
operator (and or), `not`, and small int constant (n -> n + 1) is a site; a fixed-seed sample of
at most ``cap`` sites per function is planted, one per run, in a copy of the committed tree
(``git archive HEAD``), never in the working tree. A mutant is killed when its tests fail (or
time out), survives when they pass. A survivor that cannot change behaviour is listed in
EQUIVALENT with the reason; the score is killed / (mutants - equivalent).

Like the other scripts here this prints and writes results; it asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

GOV_UNIT = ["tests/test_governor_reactions.py", "tests/test_governor.py", "-k",
            "threshold or adapt or cooldown or in_order or both or divisor or says_so"]
# (file, function or Class.method, at most this many mutants, the tests that should notice)
TARGETS: list[tuple[str, str, int, list[str]]] = [
    ("finetune/loop.py", "_lr", 5, ["tests/test_schedule.py"]),
    ("finetune/loop.py", "Trainer._train_step", 3, ["tests/test_values.py", "-k", "cuda"]),
    ("finetune/loop.py", "Trainer.evaluate", 3, ["tests/test_values.py", "-k", "cuda or eval_every"]),
    ("finetune/loop.py", "Trainer.maybe_resume", 2, ["tests/test_train_e2e.py", "-k", "resume and (cuda or effective)"]),
    ("finetune/data.py", "tokenize", 2, ["tests/test_data.py"]),
    ("finetune/data.py", "DataSource.__init__", 3, ["tests/test_data.py"]),
    ("finetune/data.py", "DataSource._epoch", 3, ["tests/test_data.py"]),
    ("finetune/data.py", "DataSource.val_batches", 2, ["tests/test_data.py", "tests/test_values.py", "-k",
                                                        "not mlx"]),
    ("finetune/governor.py", "smaller_divisor", 2, GOV_UNIT),
    ("finetune/governor.py", "Governor._lower_micro", 2, GOV_UNIT),
    ("finetune/governor.py", "Governor.on_oom", 2, GOV_UNIT),
    ("finetune/governor.py", "Governor.after_step", 7, GOV_UNIT),
    ("backends/cuda/memory.py", "bnb4_bytes", 3, ["tests/test_pricing.py"]),
    ("backends/mlx/memory.py", "mlx_quant_bytes", 2, ["tests/test_pricing.py"]),
    ("backends/cuda/memory.py", "optimizer_state_bytes", 5, ["tests/test_pricing.py"]),
    ("finetune/planner/price.py", "_split_layers", 2, ["tests/test_pricing.py"]),
    ("finetune/planner/report.py", "_err", 2, ["tests/test_pricing.py"]),
    ("finetune/accounting/rules.py", "rule_swap", 2, ["tests/test_rules_edges.py", "tests/test_accounting.py", "-k",
                                                      "explain or swap"]),
    ("finetune/accounting/rules.py", "rule_fragmentation", 2, ["tests/test_accounting.py", "-k", "explain"]),
    ("backends/cuda/runtime.py", "CudaBackend.census", 2, ["tests/test_backend_cuda.py", "-k", "census"]),
    ("backends/cuda/runtime.py", "CudaBackend.load_state", 1, ["tests/test_state_mismatch.py", "tests/test_backend_cuda.py",
                                                       "-k", "resume or refused"]),
    ("backends/mlx/runtime.py", "MlxBackend.census", 2, ["tests/test_backend_mlx.py", "-k", "census or state_bytes or quant"]),
    ("backends/mlx/runtime.py", "MlxBackend.load_state", 1, ["tests/test_backend_mlx.py", "-k", "resume"]),
]

# Survivors that cannot change behaviour, by mutant id, with the reason. An id names the
# function, the line within it and the change, so it survives edits elsewhere in the file.
EQUIVALENT: dict[str, str] = {
    "finetune/loop.py::Trainer.evaluate+1 LtE -> Lt":
        "the loop calls evaluate() only when train.eval_every > 0, so the guard never sees 0",
    "finetune/governor.py::Governor._lower_micro+2 GtE -> Gt":
        "smaller_divisor(n, micro) returns at most micro // 2, never micro itself: new == micro cannot happen",
}

_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
         ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
         ast.And: ast.Or, ast.Or: ast.And}


@dataclass
class Mutant:
    id: str
    file: str
    line: int  # 1-based, in the file
    source_line: str
    tests: list[str]
    new_source: str  # the whole file, mutated


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    node: ast.AST = tree
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    assert isinstance(node, ast.FunctionDef)
    return node


def _sites(fn: ast.FunctionDef) -> list[tuple[ast.AST, str, int]]:
    """(node, kind, index) for every mutable spot, in a fixed walk order; docstrings skipped."""
    out: list[tuple[ast.AST, str, int]] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare):
            out += [(node, "cmp", i) for i, op in enumerate(node.ops) if type(op) in _SWAP]
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _SWAP:
            out.append((node, "bin", 0))
        elif isinstance(node, ast.BoolOp):
            out.append((node, "bool", 0))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append((node, "not", 0))
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 4096:
            out.append((node, "int", 0))
    return out


class _Apply(ast.NodeTransformer):
    def __init__(self, target: ast.AST, kind: str, index: int):
        self.target, self.kind, self.index, self.desc = target, kind, index, ""

    def visit(self, node: ast.AST) -> ast.AST:
        if node is not self.target:
            return self.generic_visit(node)
        if self.kind == "cmp":
            old = node.ops[self.index]
            node.ops[self.index] = _SWAP[type(old)]()
            self.desc = f"{type(old).__name__} -> {type(node.ops[self.index]).__name__}"
        elif self.kind in ("bin", "bool"):
            old = node.op
            node.op = _SWAP[type(old)]()
            self.desc = f"{type(old).__name__} -> {type(node.op).__name__}"
        elif self.kind == "not":
            self.desc = "drop not"
            return node.operand
        else:
            self.desc = f"{node.value} -> {node.value + 1}"
            node.value += 1
        return node


def mutants(root: Path, only: str | None = None, seed: int = 0) -> list[Mutant]:
    out = []
    for file, qualname, cap, tests in TARGETS:
        if only and only not in file and only not in qualname:
            continue
        src = (root / file).read_text()
        lines = src.splitlines(keepends=True)
        tree = ast.parse(src)
        fn = _find(tree, qualname)
        sites = _sites(fn)
        rng = random.Random(f"{seed}:{file}:{qualname}")
        chosen = sorted(rng.sample(range(len(sites)), min(cap, len(sites))))
        for k in chosen:
            fn_copy = copy.deepcopy(fn)
            node, kind, index = _sites(fn_copy)[k]
            t = _Apply(node, kind, index)
            new_fn = t.visit(fn_copy)
            ast.fix_missing_locations(new_fn)
            indent = " " * fn.col_offset
            body = "".join(indent + ln + "\n" if ln else "\n" for ln in ast.unparse(new_fn).splitlines())
            start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
            new_src = "".join(lines[:start]) + body + "".join(lines[fn.end_lineno:])
            line = getattr(node, "lineno", fn.lineno)
            mid = f"{file}::{qualname}+{line - fn.lineno} {t.desc}"
            out.append(Mutant(mid, file, line, lines[line - 1].strip(), tests, new_src))
    return out


def _pytest(copy_root: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": str(copy_root),
           "FINETUNE_SHARED": os.environ.get("FINETUNE_SHARED", str(REPO.parent / "shared"))}
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                           cwd=copy_root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0
    return ("survived" if r.returncode == 0 else "killed"), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="targets whose file or function contains this")
    ap.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per mutant's test run")
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="finetune-mutation-") as tmp:
        root = Path(tmp)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        # an editable install maps finetune.conf to the checkout's conf/: the copy brings its own
        (root / "finetune" / "conf").symlink_to("../conf")
        ms = mutants(root, args.only)
        if args.list:
            for m in ms:
                print(f"{m.id}\n    line {m.line}: {m.source_line}")
            return
        report = [f"mutation run over {len(ms)} mutants of commit {commit} "
                  f"({time.strftime('%Y-%m-%d %H:%M')}; python benchmarks/mutation.py"
                  + (f" --only {args.only}" if args.only else "") + ")", ""]

        def say(line: str) -> None:
            print(line, flush=True)
            report.append(line)

        for tests in {tuple(t) for *_, t in TARGETS}:  # the unmutated tree must pass first
            if args.only and not any(args.only in f or args.only in q for f, q, _, t in TARGETS if tuple(t) == tests):
                continue
            status, secs = _pytest(root, list(tests), args.timeout)
            if status != "survived":
                sys.exit(f"baseline {' '.join(tests)}: {status} without any mutant; fix the suite first")
        counts = {"killed": 0, "timeout": 0, "survived": 0, "equivalent": 0}
        for m in ms:
            path = root / m.file
            original = path.read_text()
            path.write_text(m.new_source)
            try:
                status, secs = _pytest(root, m.tests, args.timeout)
            finally:
                path.write_text(original)
            if status == "survived" and m.id in EQUIVALENT:
                status = "equivalent"
            counts[status] += 1
            say(f"{status:10s} {secs:6.1f}s  {m.id}")
            say(f"{'':19s}line {m.line}: {m.source_line}")
            if status == "equivalent":
                say(f"{'':19s}why equivalent: {EQUIVALENT[m.id]}")
        live = len(ms) - counts["equivalent"]
        dead = counts["killed"] + counts["timeout"]
        say("")
        say(f"killed {counts['killed']}, timed out (counted killed) {counts['timeout']}, survived "
            f"{counts['survived']}, equivalent {counts['equivalent']}: "
            f"{dead}/{live} = {100 * dead / max(live, 1):.1f}% of the non-equivalent mutants killed")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
