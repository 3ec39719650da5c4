"""Mutation testing of every module in finetune/ and backends/, with cosmic-ray 8 making the
mutants and this script choosing which tests each one runs.

    python benchmarks/mutation/mut.py map                       # module -> test files (coverage), ~30 min
    python benchmarks/mutation/mut.py init --sample 300         # seeded sample over every module
    python benchmarks/mutation/mut.py init --base main --session changed   # lines a diff touches
    nohup python benchmarks/mutation/mut.py run >> benchmarks/mutation/run.log 2>&1 &   # resumes
    python benchmarks/mutation/mut.py status [--survivors]      # made/killed/survived/... per module

Why a driver around cosmic-ray (benchmarks/mutation/README.md says more): cosmic-ray makes and
applies the mutants (its operators, its session database, its `cosmic-ray apply`), but its
runner gives every mutant one test command. Here each mutant first runs only the test files that
executed its function (the map), fail-fast and fastest file first; the whole suite runs, as a
queue at the end, only for mutants those files let through. Mutants are applied in a separate
git worktree checked out at the session's commit, never in the checkout this script lives in.

Like the other scripts in benchmarks/ this prints and writes results; it asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG = HERE / "cosmic-ray.toml"
TESTMAP = HERE / "testmap.json"
EQUIVALENTS = HERE / "equivalents.txt"
SESSIONS = HERE / "sessions"
DEFAULT_WORKDIR = Path(os.environ.get("FINETUNE_MUTWORK", tempfile.gettempdir() + "/mutwork"))
SHARED = os.environ.get("FINETUNE_SHARED") or str(REPO.parent / "shared")

# Outcomes, one per mutant. "timeout" is a mutant whose tests ran past their limit: counted as
# detected (a hang fails CI) but listed apart, since on a shared box it can also be load.
OUTCOMES = ("killed", "survived", "timeout", "equivalent", "pending", "full-suite queue", "deferred")


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def modules(tree: Path) -> list[str]:
    """Every module of finetune/ and backends/ in ``tree``, as repo-relative paths, minus the
    config's excluded-modules."""
    cfg = load_config()
    excluded = cfg.get("excluded-modules", [])
    out = []
    for top in ("finetune", "backends"):
        for p in sorted((tree / top).rglob("*.py")):
            rel = p.relative_to(tree).as_posix()
            if not any(Path(rel).match(pat) for pat in excluded):
                out.append(rel)
    return out


def load_config() -> dict:
    import toml

    return toml.loads(CONFIG.read_text())["cosmic-ray"]


# ---------------------------------------------------------------------------------------------
# the work tree the mutants live in


def workdir_at(sha: str, workdir: Path) -> Path:
    """A git worktree of this repository checked out (detached) at ``sha``, clean. Made if
    absent; reset if it holds anything else."""
    if not (workdir / ".git").exists():
        git("worktree", "add", "--detach", str(workdir), sha)
    git("checkout", "--detach", "--force", sha, cwd=workdir)
    git("clean", "-fdxq", "-e", "__pycache__", cwd=workdir)
    return workdir


def test_env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The package is imported from the work tree (finetune/__init__ puts its backends/ and conf/
    # on the package path), including by the CLI subprocesses the tests start.
    env["PYTHONPATH"] = str(workdir)
    env["FINETUNE_SHARED"] = SHARED
    env.pop("COVERAGE_PROCESS_START", None)
    return env


def pytest_cmd(workdir: Path, files: list[str], deselect: list[str], fail_fast: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(workdir),
           "--no-header", "-o", "addopts=--strict-markers"]
    if fail_fast:
        cmd.append("-x")
    for node in deselect:
        cmd += ["--deselect", node]
    return cmd + files


def run_bounded(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (the tests start
    CLI subprocesses). Returns (exit code or None on timeout, the output's tail, seconds)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        out.seek(0)
        tail = out.read()[-3000:]
    return rc, tail, time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# map: which test files execute which lines


COVERAGE_RC = """[run]
parallel = true
dynamic_context = test_function
patch = subprocess
include =
    {w}/finetune/*
    {w}/backends/*
"""


def cmd_map(args: argparse.Namespace) -> None:
    """Run each test file alone under coverage (its CLI subprocesses too) in a worktree at
    ``--rev``; store, per test file, its seconds, the tests that fail there before any mutation
    (deselected later) and the lines it executed per module."""
    from coverage import CoverageData

    sha = git("rev-parse", args.rev)
    workdir = workdir_at(sha, Path(args.workdir))
    tests = sorted(p.relative_to(workdir).as_posix() for p in (workdir / "tests").glob("test_*.py"))
    old = json.loads(TESTMAP.read_text()) if TESTMAP.is_file() and (args.only or args.missing) else {}
    if old and old["sha"] != sha:
        sys.exit(f"{TESTMAP.name} was made at {old['sha'][:7]}: --only/--missing add to a map of the same commit")
    if args.only:
        tests = [t for t in tests if any(o in t for o in args.only)]
    if args.missing:
        tests = [t for t in tests if t not in old.get("tests", {})]
    result = {"sha": sha, "made": time.strftime("%Y-%m-%d %H:%M"), "tests": old.get("tests", {})}
    covdir = Path(tempfile.mkdtemp(prefix="mutmap-"))
    rc_path = covdir / "coveragerc"
    rc_path.write_text(COVERAGE_RC.format(w=workdir))
    for i, test in enumerate(tests, 1):
        data = covdir / Path(test).stem / ".coverage"
        data.parent.mkdir()
        junit = covdir / (Path(test).stem + ".xml")
        env = test_env(workdir) | {"COVERAGE_FILE": str(data), "COVERAGE_RCFILE": str(rc_path)}
        cmd = [sys.executable, "-m", "coverage", "run", "--rcfile", str(rc_path), "-m", "pytest", "-q", "-p",
               "no:cacheprovider", "--rootdir", str(workdir), "-o", "addopts=--strict-markers",
               f"--junitxml={junit}", test]
        rc, _tail, secs = run_bounded(cmd, workdir, env, args.timeout)
        subprocess.run([sys.executable, "-m", "coverage", "combine", "--rcfile", str(rc_path), "-q", "--keep",
                        str(data.parent)], cwd=workdir, env=env, capture_output=True, check=False)
        lines: dict[str, list[list[int]]] = {}
        # lines each test function ran in this process; "" = outside any test function (imports,
        # fixtures, the CLI subprocesses), which only the whole file can stand for
        by_test: dict[str, dict[str, list[list[int]]]] = {}
        if data.is_file():
            cov = CoverageData(basename=str(data))
            cov.read()
            for f in cov.measured_files():
                rel = Path(f).resolve().relative_to(workdir.resolve()).as_posix()
                lines[rel] = ranges(sorted(cov.lines(f) or []))
                per: dict[str, set[int]] = defaultdict(set)
                for n, ctxs in cov.contexts_by_lineno(f).items():
                    for c in ctxs:
                        per[node_id(test, c)].add(n)
                by_test[rel] = {k: ranges(sorted(v)) for k, v in per.items()}
        failed = junit_failures(junit, test)
        result["tests"][test] = {"seconds": round(secs, 1), "exit": rc, "failed": failed, "lines": lines,
                                 "by_test": by_test}
        print(f"[{i}/{len(tests)}] {test}: {secs:.0f} s, exit {rc}, {len(lines)} modules, "
              f"{len(failed)} failing before mutation", flush=True)
        write_atomic(TESTMAP, json.dumps(result, indent=0, sort_keys=True))
    shutil.rmtree(covdir, ignore_errors=True)
    print(f"wrote {TESTMAP.relative_to(REPO)} ({len(result['tests'])} test files, commit {sha[:7]})")


def write_atomic(path: Path, text: str) -> None:
    # the runner reads the map while `map` is still adding to it
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def node_id(test: str, context: str) -> str:
    """coverage's test_function context (tests.test_x.Class.test_y) -> a pytest node id
    (tests/test_x.py::Class::test_y); "" stays ""."""
    if not context:
        return ""
    prefix = test[:-3].replace("/", ".") + "."
    rest = context[len(prefix):] if context.startswith(prefix) else context.rsplit(".", 1)[-1]
    return test + "::" + rest.replace(".", "::")


def junit_failures(junit: Path, test: str) -> list[str]:
    if not junit.is_file():
        return []
    out = []
    for case in ET.parse(junit).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            # classname tests.test_x.Class -> tests/test_x.py::Class::name
            parts = case.get("classname", "").split(".")
            mod_parts = [p for p in parts if not p[:1].isupper()]
            cls_parts = [p for p in parts if p[:1].isupper()]
            out.append("::".join(["/".join(mod_parts) + ".py", *cls_parts, case.get("name", "")]))
    return out


def ranges(lines: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for n in lines:
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return out


class TestMap:
    def __init__(self, sha: str):
        raw = json.loads(TESTMAP.read_text()) if TESTMAP.is_file() else {"sha": None, "tests": {}}
        self.exact = raw["sha"] == sha  # line numbers hold only at the commit the map was made at
        self.tests = raw["tests"]
        # A map still being built (not every test file of the commit in it yet): a kill by the
        # files mapped so far stands, a survival waits for the rest
        listed = git("ls-tree", "--name-only", sha, "tests/").splitlines()
        wanted = {t for t in listed if Path(t).name.startswith("test_") and t.endswith(".py")}
        self.complete = not self.exact or wanted <= set(self.tests)
        self.lines: dict[str, dict[str, set[int]]] = defaultdict(dict)
        for test, info in self.tests.items():
            for mod, rs in info["lines"].items():
                self.lines[mod][test] = {n for a, b in rs for n in range(a, b + 1)}

    def seconds(self, test: str) -> float:
        """A test file's seconds in the map; a single test function counts a tenth of its file."""
        file = test.split("::")[0]
        secs = self.tests.get(file, {}).get("seconds", 60.0)
        return secs / 10 if "::" in test else secs

    def failing(self, tests: list[str]) -> list[str]:
        files = {t.split("::")[0] for t in tests}
        return [n for f in sorted(files) for n in self.tests.get(f, {}).get("failed", [])]

    def full_suite_seconds(self) -> float:
        return sum(i["seconds"] for i in self.tests.values()) or 900.0

    def for_mutant(self, module: str, span: tuple[int, int]) -> list[str]:
        """Test files that executed a line of ``span`` (the body of the function around the
        mutant, or its own line at module level), fastest first; within a file only the test
        functions that ran it, unless a line of it ran outside any test function (a fixture, an
        import, a CLI subprocess): then the whole file. The whole module's test files when the
        map was made at another commit."""
        by_file = self.lines.get(module, {})
        if not self.exact:
            return sorted(by_file, key=self.seconds)
        lo, hi = span
        out = []
        for t in sorted(by_file, key=self.seconds):
            if not any(lo <= n <= hi for n in by_file[t]):
                continue
            per = self.tests[t].get("by_test", {}).get(module)
            if per is None or any(lo <= n <= hi for a, b in per.get("", []) for n in range(a, b + 1)):
                out.append(t)
                continue
            out += sorted(node for node, rs in per.items() if node and any(a <= hi and lo <= b for a, b in rs))
        return out


# ---------------------------------------------------------------------------------------------
# init: the mutants of a session


@dataclass
class Mutant:
    job_id: str
    module: str
    operator: str
    occurrence: int
    line: int
    end_line: int
    col: int


def all_mutants(workdir: Path, mods: list[str]) -> list[Mutant]:
    """Every mutant cosmic-ray's operators make in ``mods`` (config's operator filter applied),
    minus those inside annotations (``from __future__ import annotations`` keeps them strings,
    so `int | None` -> `int - None` cannot change behaviour) and under ``if TYPE_CHECKING``."""
    from cosmic_ray.commands.init import _all_work_items

    cfg = load_config()
    drop = [re.compile(p) for p in cfg.get("exclude-operators", [])]
    out = []
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        for mod in mods:
            dead = inert_spans((workdir / mod).read_text())
            for item in _all_work_items([Path(mod)], {}):
                m = item.mutations[0]
                if any(p.search(m.operator_name) for p in drop):
                    continue
                pos = tuple(m.start_pos)
                if any(a <= pos < b for a, b in dead):
                    continue
                out.append(Mutant(item.job_id, mod, m.operator_name, m.occurrence, m.start_pos[0], m.end_pos[0],
                                  m.start_pos[1]))
    finally:
        os.chdir(cwd)
    return out


def inert_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    spans = []
    for node in ast.walk(ast.parse(source)):
        ann = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            ann = [x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            ann = [node.annotation]
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ann = node.body
        for n in ann:
            if n is not None:
                spans.append(((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)))
    return spans


def enclosing_span(source_tree: ast.AST, line: int) -> tuple[int, int]:
    """Lines of the innermost function body around ``line``; (line, line) at module level."""
    best = (line, line)
    for node in ast.walk(source_tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lo, hi = node.body[0].lineno, node.end_lineno or node.lineno
            if lo <= line <= hi and (best == (line, line) or hi - lo < best[1] - best[0]):
                best = (lo, hi)
    return best


def changed_lines(base: str, rev: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = defaultdict(set)
    current = None
    for ln in git("diff", "-U0", base, rev, "--", "finetune", "backends").splitlines():
        if ln.startswith("+++ "):
            current = ln[6:] if ln.startswith("+++ b/") else None
        elif ln.startswith("@@") and current:
            m = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", ln)
            if m:
                start, count = int(m.group(1)), int(m.group(2) if m.group(2) is not None else 1)
                out[current].update(range(start, start + count))
    return out


def stratified_sample(mutants: list[Mutant], n: int, seed: int, sizes: dict[str, int]) -> list[Mutant]:
    """``n`` mutants over every module in proportion to its size in lines (at least one from
    each module that has any), drawn with ``seed``; returned in a seeded shuffled order so a
    run cut short has touched every part of the tree."""
    rng = random.Random(seed)
    by_mod: dict[str, list[Mutant]] = defaultdict(list)
    for m in mutants:
        by_mod[m.module].append(m)
    total = sum(sizes[m] for m in by_mod)
    quota = {m: max(1, round(n * sizes[m] / total)) for m in by_mod}
    picked = []
    for mod in sorted(by_mod):
        picked += rng.sample(by_mod[mod], min(quota[mod], len(by_mod[mod])))
    rng.shuffle(picked)
    return picked


def cmd_init(args: argparse.Namespace) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import MutationSpec, WorkItem

    sha = git("rev-parse", args.rev)
    session = SESSIONS / args.session
    if session.exists() and not args.force:
        sys.exit(f"{session.relative_to(REPO)} exists: `run` resumes it; init --force starts it over")
    shutil.rmtree(session, ignore_errors=True)
    session.mkdir(parents=True)
    workdir = workdir_at(sha, Path(args.workdir))
    mods = [m for m in modules(workdir) if not args.modules or any(x in m for x in args.modules)]
    base = None
    if args.base is not None or args.session.startswith("changed"):
        base = args.base or default_base(sha)
        touched = changed_lines(base, sha)
        mods = [m for m in mods if m in touched]
    mutants = all_mutants(workdir, mods)
    if base is not None:
        mutants = [m for m in mutants if touched[m.module] & set(range(m.line, m.end_line + 1))]
        if args.sample:
            mutants = stratified_sample(mutants, args.sample, args.seed,
                                        {m: len((workdir / m).read_text().splitlines()) for m in mods})
    else:
        sizes = {m: len((workdir / m).read_text().splitlines()) for m in mods}
        mutants = stratified_sample(mutants, args.sample, args.seed, sizes)
    with use_db(str(session / "session.sqlite"), WorkDB.Mode.create) as db:
        db.clear()
        db.add_work_items(WorkItem.single(m.job_id, MutationSpec(
            module_path=m.module, operator_name=m.operator, occurrence=m.occurrence,
            start_pos=(m.line, m.col), end_pos=(m.end_line, m.col + 1) if m.end_line == m.line else (m.end_line, 0),
        )) for m in mutants)
    meta = {"sha": sha, "base": base, "seed": args.seed, "sample": args.sample, "made": time.strftime("%Y-%m-%d %H:%M"),
            "modules": len({m.module for m in mutants}),
            "order": [m.__dict__ for m in mutants]}
    (session / "meta.json").write_text(json.dumps(meta, indent=0))
    (session / "results.jsonl").touch()
    print(f"{len(mutants)} mutants over {meta['modules']} modules at {sha[:7]}"
          + (f" (lines changed since {base[:7]})" if base else f" (seed {args.seed})")
          + f" -> {session.relative_to(REPO)}")


def default_base(sha: str) -> str:
    """The merge-base with main, or the commit before ``sha`` when that is ``sha`` itself."""
    try:
        mb = git("merge-base", "main", sha)
    except subprocess.CalledProcessError:
        mb = sha
    return git("rev-parse", f"{sha}~1") if mb == sha else mb


# ---------------------------------------------------------------------------------------------
# run: apply, test, record; resumable


def load_results(session: Path) -> dict[str, dict]:
    last: dict[str, dict] = {}
    for ln in (session / "results.jsonl").read_text().splitlines():
        if ln.strip():
            rec = json.loads(ln)
            if rec["outcome"] == "deferred":  # a quick pass that did not kill: still to be run in full
                last.setdefault(rec["job_id"], rec)
                continue
            prev = last.get(rec["job_id"])
            if prev is not None and prev["outcome"] == "deferred":
                prev = None
            # a kill stands: a later record (a mapped run started before a recheck) cannot undo it
            if prev is None or prev["outcome"] not in ("killed", "timeout"):
                last[rec["job_id"]] = rec
    return last


def record(session: Path, rec: dict) -> None:
    with open(session / "results.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def drop_pyc(workdir: Path, module: str) -> None:
    # A mutant and the original can have the same size and mtime second, which would let the
    # next run load a stale .pyc: remove the module's bytecode around every mutant.
    p = workdir / module
    for pyc in (p.parent / "__pycache__").glob(p.stem + ".*.pyc"):
        pyc.unlink(missing_ok=True)


def apply_and_test(workdir: Path, m: dict, files: list[str], tmap: TestMap, timeout_s: float,
                   fail_fast: bool = True) -> tuple[str, str, str, float]:
    """Plant mutant ``m`` with cosmic-ray, run pytest on ``files``, put the source back.
    Returns (outcome, diff, output tail, seconds); outcome is killed, survived, timeout or
    no-mutation."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import use_mutation

    path = workdir / m["module"]
    operator = cosmic_ray.plugins.get_operator(m["operator"])()
    drop_pyc(workdir, m["module"])
    try:
        with use_mutation(path, operator, m["occurrence"]) as (before, after):
            if after is None:
                return "no-mutation", "", "", 0.0
            diff = short_diff(before, after)
            rc, tail, secs = run_bounded(pytest_cmd(workdir, files, tmap.failing(files), fail_fast), workdir,
                                         test_env(workdir), timeout_s)
    finally:
        drop_pyc(workdir, m["module"])
    if rc is None:
        return "timeout", diff, tail, secs
    if rc == 0 or rc == 5:  # 5: every mapped test deselected or skipped -> nothing caught it
        return "survived", diff, tail, secs
    return "killed", diff, tail, secs


def short_diff(before: str, after: str) -> str:
    import difflib

    lines = [ln for ln in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
             if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    return "\n".join(ln.rstrip() for ln in lines)


QUICK_SKIP = ("test_dist_", "test_compile", "test_gpu_bench_smoke", "test_slurm")


def run_mapped(workdir: Path, tmap: TestMap, trees: dict[str, ast.AST], m: dict, args: argparse.Namespace) -> dict:
    """One mutant against its mapped test files; the result record (not yet written)."""
    mod = m["module"]
    if mod not in trees:
        trees[mod] = ast.parse((workdir / mod).read_text())
    quick = getattr(args, "quick", 0)
    # the quick pass takes the tests that ran the mutated lines themselves (not the whole
    # function around them), leaving out the multi-process files, which rarely are the ones
    # to notice and cost minutes each
    files = (tmap.for_mutant(mod, (m["line"], m["end_line"])) if quick
             else tmap.for_mutant(mod, enclosing_span(trees[mod], m["line"])))
    if quick:
        files = [t for t in files if not any(h in t for h in QUICK_SKIP)]
    if quick and not files:
        return {"job_id": m["job_id"], "phase": "quick", "tests": [], "seconds": 0, "diff": "", "outcome": "deferred",
                "time": time.strftime("%H:%M:%S")}
    if quick:
        # the quick pass: the cheapest mapped tests up to `quick` mapped seconds (at least one);
        # a kill stands, anything else is "deferred" to the full mapped run
        chosen, total = [], 0.0
        for t in files:
            if chosen and total + tmap.seconds(t) > quick:
                break
            chosen.append(t)
            total += tmap.seconds(t)
        outcome, diff, tail, secs = apply_and_test(workdir, m, chosen, tmap, max(args.min_timeout, 4 * total + 120))
        return {"job_id": m["job_id"], "phase": "quick", "tests": chosen, "seconds": round(secs, 1), "diff": diff,
                "outcome": outcome if outcome in ("killed", "timeout", "no-mutation") else "deferred",
                "time": time.strftime("%H:%M:%S")}
    if not files:
        import cosmic_ray.plugins
        from cosmic_ray.mutating import use_mutation

        with use_mutation(workdir / mod, cosmic_ray.plugins.get_operator(m["operator"])(), m["occurrence"]) as (
                before, after):
            diff = short_diff(before, after) if after else ""
        rec = {"job_id": m["job_id"], "phase": "mapped", "outcome": "survived", "tests": [], "seconds": 0,
               "diff": diff}
    else:
        limit = max(args.min_timeout, 4 * sum(tmap.seconds(t) for t in files) + 120)
        outcome, diff, tail, secs = apply_and_test(workdir, m, files, tmap, limit)
        rec = {"job_id": m["job_id"], "phase": "mapped", "outcome": outcome, "tests": files,
               "seconds": round(secs, 1), "diff": diff, "limit_s": round(limit)}
        if outcome != "killed":
            rec["tail"] = tail[-800:]
    rec["time"] = time.strftime("%H:%M:%S")
    return rec


def cmd_run(args: argparse.Namespace) -> None:
    session = SESSIONS / args.session
    meta = json.loads((session / "meta.json").read_text())
    worker, workers = (int(x) for x in args.worker.split("/")) if args.worker else (1, 1)
    lock = session / (f"run.{worker}.pid" if workers > 1 else "run.pid")
    if lock.is_file():
        pid = int(lock.read_text() or 0)
        if pid and Path(f"/proc/{pid}").exists():
            sys.exit(f"session {args.session} is already running (pid {pid})")
    lock.write_text(str(os.getpid()))
    workdir = workdir_at(meta["sha"], Path(args.workdir))
    tmap = TestMap(meta["sha"])
    trees: dict[str, ast.AST] = {}
    done = load_results(session)
    order = [m for i, m in enumerate(meta["order"]) if i % workers == worker - 1]
    if args.quick:
        eq = load_equivalents()
        todo = [m for m in order if (m["job_id"] not in done or (args.retry_deferred and done[m["job_id"]]["outcome"]
                                                                 == "deferred")) and not is_equivalent(m, eq)]
        print(f"session {args.session}: quick pass over {len(todo)} mutants (worker {worker}/{workers}, mapped "
              f"tests up to {args.quick:.0f} s each)", flush=True)
        try:
            for m in todo:
                now = load_results(session).get(m["job_id"])
                if now is not None and not (args.retry_deferred and now["outcome"] == "deferred"):
                    continue
                rec = run_mapped(workdir, TestMap(meta["sha"]), trees, m, args)
                record(session, rec)
                print(f"[quick {meta['order'].index(m) + 1}/{len(meta['order'])}] {m['module']}:{m['line']} "
                      f"{m['operator'].split('/')[-1]}: {rec['outcome']} ({rec['seconds']} s, "
                      f"{len(rec['tests'])} tests)", flush=True)
        finally:
            lock.unlink(missing_ok=True)
        return
    done = {k: v for k, v in done.items() if v["outcome"] != "deferred"}
    print(f"session {args.session}: {len(order)} mutants at {meta['sha'][:7]}, {len(done)} with a result; "
          f"map {'exact' if tmap.exact else 'module-level (made at another commit)'}", flush=True)
    try:
        # Phase 1: each mutant against the test files that ran its function. While the map is
        # still being built (`map` running beside), a kill by the files mapped so far stands; a
        # mutant they let through is put back and tried again once the map is complete.
        deferred: set[str] = set()
        while True:
            tmap = tmap if tmap.complete else TestMap(meta["sha"])
            eq = load_equivalents()
            todo = [m for m in order if m["job_id"] not in done and m["job_id"] not in deferred
                    and not is_equivalent(m, eq)]
            if not todo:
                if not deferred:
                    break
                if not tmap.complete:
                    time.sleep(60)
                    continue
                deferred.clear()
                continue
            for m in todo:
                now = load_results(session).get(m["job_id"])
                if now is not None and now["outcome"] != "deferred":  # recorded meanwhile (recheck)
                    done[m["job_id"]] = now
                    continue
                tmap = tmap if tmap.complete else TestMap(meta["sha"])
                rec = run_mapped(workdir, tmap, trees, m, args)
                i = meta["order"].index(m) + 1
                if rec["outcome"] == "survived" and not tmap.complete:
                    deferred.add(m["job_id"])
                    print(f"[{i}/{len(order)}] {m['module']}:{m['line']}: let through by the files mapped so far; "
                          f"again once the map is complete", flush=True)
                    continue
                record(session, rec)
                done[m["job_id"]] = rec
                print(f"[{i}/{len(order)}] {m['module']}:{m['line']} {m['operator'].split('/')[-1]}: "
                      f"{rec['outcome']} ({rec['seconds']} s, {len(rec['tests'])} files)", flush=True)
        full_s = tmap.full_suite_seconds()
        # Phase 2: the queue of mutants the mapped tests let through, against the whole suite.
        if args.no_full_suite:
            return
        equivalent = load_equivalents()
        queue = [m for m in order if done[m["job_id"]]["phase"] == "mapped"
                 and done[m["job_id"]]["outcome"] == "survived" and not is_equivalent(m, equivalent)]
        print(f"full-suite queue: {len(queue)} mutants, limit {args.full_timeout or 3 * full_s:.0f} s each", flush=True)
        tests = sorted(tmap.tests, key=tmap.seconds) or ["tests"]
        for j, m in enumerate(queue, 1):
            outcome, diff, tail, secs = apply_and_test(workdir, m, tests, tmap, args.full_timeout or 3 * full_s)
            rec = {"job_id": m["job_id"], "phase": "full", "outcome": outcome, "tests": ["<all>"],
                   "seconds": round(secs, 1), "diff": diff, "time": time.strftime("%H:%M:%S")}
            if outcome != "killed":
                rec["tail"] = tail[-800:]
            record(session, rec)
            print(f"[full {j}/{len(queue)}] {m['module']}:{m['line']}: {outcome} ({secs:.0f} s)", flush=True)
    finally:
        lock.unlink(missing_ok=True)


def cmd_recheck(args: argparse.Namespace) -> None:
    """Run the session's survivors against test files written since (default: this checkout's
    tests/test_mut_*.py), copied into the work tree at the session's commit. Tests that fail
    there unmutated are deselected first; a survivor they kill is recorded as killed."""
    session = SESSIONS / args.session
    meta = json.loads((session / "meta.json").read_text())
    workdir = workdir_at(meta["sha"], Path(args.workdir))
    files = args.tests or sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").glob("test_mut_*.py"))
    for f in files:
        shutil.copy2(REPO / f, workdir / f)
    # names that moved since the session's commit, for test files written after the move
    for f in (HERE / "compat").rglob("*.py"):
        target = workdir / f.relative_to(HERE / "compat")
        if not target.exists():
            shutil.copy2(f, target)
    if "tests/test_plan_golden.py" in files:
        # the golden plans are the unmutated session commit's own output: written there, before
        # any mutant, by the same script and configurations as this checkout's
        (workdir / "tests/data/plans").mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / "scripts/golden_plans.py", workdir / "scripts/golden_plans.py")
        shutil.copy2(REPO / "tests/data/plans/configs.txt", workdir / "tests/data/plans/configs.txt")
        subprocess.run([sys.executable, "scripts/golden_plans.py", "--drop-unknown"], cwd=workdir, env=test_env(workdir), check=True)
    tmap = TestMap(meta["sha"])
    junit = workdir / "recheck-baseline.xml"
    rc, _tail, secs = run_bounded(pytest_cmd(workdir, files, [], False) + [f"--junitxml={junit}"], workdir,
                                 test_env(workdir), args.timeout)
    failing = [n for f in files for n in junit_failures(junit, f)]
    print(f"baseline of {len(files)} new test files at {meta['sha'][:7]}: exit {rc}, {secs:.0f} s, "
          f"{len(failing)} failing there (deselected)", flush=True)
    for f in files:
        tmap.tests[f] = {"seconds": secs / max(1, len(files)), "failed": failing, "lines": {}}
    done = load_results(session)
    eq = load_equivalents()
    for m in meta["order"]:
        rec = done.get(m["job_id"])
        if final_outcome(m, rec, eq) not in ("survived", "full-suite queue", "deferred") + (("pending",) if args.pending else ()):
            continue
        if args.modules and not any(x in m["module"] for x in args.modules):
            continue
        mine = [f for f in files if args.tests or Path(f).stem.removeprefix("test_mut_") in m["module"]]
        if not mine:
            continue
        outcome, diff, _tail, secs = apply_and_test(workdir, m, mine, tmap, args.timeout)
        print(f"{m['module']}:{m['line']} {m['operator'].split('/')[-1]} vs {', '.join(mine)}: {outcome} "
              f"({secs:.0f} s)", flush=True)
        if outcome in ("killed", "timeout"):
            record(session, {"job_id": m["job_id"], "phase": "recheck", "outcome": outcome, "tests": mine,
                             "seconds": round(secs, 1), "diff": diff, "time": time.strftime("%H:%M:%S")})


# ---------------------------------------------------------------------------------------------
# status


def load_equivalents() -> list[tuple[str, int, str]]:
    out = []
    if EQUIVALENTS.is_file():
        for ln in EQUIVALENTS.read_text().splitlines():
            if ln.strip() and not ln.startswith("#"):
                mod, line, mutation, _reason = [p.strip() for p in ln.split("|", 3)]
                out.append((mod, int(line), mutation.split(":")[0].split()[0]))
    return out


def is_equivalent(m: dict, equivalents: list[tuple[str, int, str]]) -> bool:
    return (m["module"], m["line"], m["operator"]) in equivalents


def final_outcome(m: dict, rec: dict | None, equivalents: list) -> str:
    if rec is not None and rec["outcome"] in ("killed", "timeout"):
        return rec["outcome"]
    if is_equivalent(m, equivalents):  # reviewed: no need to run it
        return "equivalent"
    if rec is None:
        return "pending"
    if rec["outcome"] == "deferred":  # the quick pass let it through; counted as a survivor until judged
        return "deferred"
    if rec["outcome"] == "no-mutation":
        return "equivalent"
    if is_equivalent(m, equivalents):
        return "equivalent"
    return "survived" if rec["phase"] == "full" else "full-suite queue"


def cmd_status(args: argparse.Namespace) -> None:
    session = SESSIONS / args.session
    meta = json.loads((session / "meta.json").read_text())
    done = load_results(session)
    eq = load_equivalents()
    table: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(OUTCOMES, 0))
    survivors = []
    for m in meta["order"]:
        out = final_outcome(m, done.get(m["job_id"]), eq)
        table[m["module"]][out] += 1
        if out in ("survived", "full-suite queue", "deferred"):
            survivors.append((m, done[m["job_id"]], out))
    cols = ("made",) + OUTCOMES
    head = f"{'module':40s}" + "".join(f"{c:>10s}" for c in ("made", "killed", "survived", "timeout", "equiv",
                                                                 "pending", "queue", "deferred"))
    print(f"session {args.session} at {meta['sha'][:7]}" + (f", lines changed since {meta['base'][:7]}"
                                                              if meta.get("base") else f", seed {meta['seed']}"))
    print(head)
    total = dict.fromkeys(OUTCOMES, 0)
    for mod in sorted(table):
        row = table[mod]
        for k in OUTCOMES:
            total[k] += row[k]
        print(f"{mod:40s}{sum(row.values()):>10d}" + "".join(f"{row[k]:>10d}" for k in OUTCOMES))
    print(f"{'total':40s}{sum(total.values()):>10d}" + "".join(f"{total[k]:>10d}" for k in OUTCOMES))
    judged = total["killed"] + total["timeout"] + total["survived"] + total["full-suite queue"] + total["deferred"]
    if judged:
        detected = total["killed"] + total["timeout"]
        print(f"score so far: {detected}/{judged} non-equivalent mutants detected = {100 * detected / judged:.1f}% "
              f"(timeouts counted as detected; survivors still queued for the full suite, and mutants the quick pass "
              f"deferred that no later test killed, counted as survived; "
              f"{total['pending']} not yet run)")
    del cols
    if args.survivors:
        for m, rec, out in survivors:
            print(f"\n{m['module']} | {m['line']} | {m['operator']} | {out}; tests: "
                  f"{', '.join(rec['tests']) or 'none executes this function'}")
            print("  " + rec.get("diff", "").replace("\n", "\n  "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=str(DEFAULT_WORKDIR),
                    help="git worktree the mutants are planted in (made if absent; never this checkout)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("map", help="build testmap.json: the lines each test file executes")
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--only", nargs="*", help="rebuild only test files whose path contains one of these")
    p.add_argument("--missing", action="store_true", help="map only test files the map lacks (resume)")
    p.add_argument("--timeout", type=float, default=3600)
    p = sub.add_parser("init", help="make a session's mutants")
    p.add_argument("--session", default="sample")
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--sample", type=int, default=None, help="seeded sample size (default 300; all in changed mode)")
    p.add_argument("--seed", type=int, default=21)
    p.add_argument("--base", default=None, help="changed-lines mode: mutate only lines changed since BASE "
                                                "(default for a session named changed*: merge-base with main, "
                                                "or HEAD~1 on main)")
    p.add_argument("--modules", nargs="*", help="only modules whose path contains one of these")
    p.add_argument("--force", action="store_true")
    p = sub.add_parser("run", help="run a session's mutants, resuming where it stopped")
    p.add_argument("--session", default="sample")
    p.add_argument("--min-timeout", type=float, default=600, help="per-mutant floor for the mapped tests, s")
    p.add_argument("--full-timeout", type=float, default=None, help="per-mutant limit for the whole suite, s "
                                                                    "(default 3x the map's summed seconds)")
    p.add_argument("--no-full-suite", action="store_true", help="stop after the mapped tests")
    p.add_argument("--quick", type=float, default=0, help="a quick pass: each mutant not yet judged against its "
                                                          "cheapest mapped tests up to this many mapped seconds; "
                                                          "kills stand, the rest are left for a full run")
    p.add_argument("--retry-deferred", action="store_true", help="with --quick: deferred mutants again (after "
                                                                    "the map grew or tests were added)")
    p.add_argument("--worker", default=None, help="I/N: this process runs every N-th mutant from the I-th, "
                                                 "in its own --workdir (two cores: two workers)")
    p = sub.add_parser("recheck", help="run survivors against test files written since")
    p.add_argument("--session", default="sample")
    p.add_argument("--tests", nargs="*", help="test files (default: tests/test_mut_*.py, each against "
                                              "the survivors of the module its name names)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--modules", nargs="*", help="only mutants of modules whose path contains one of these")
    p.add_argument("--pending", action="store_true", help="also mutants not run yet: a kill is recorded, "
                                                          "a survivor left for `run`")
    p = sub.add_parser("status", help="made/killed/survived/timeout/equivalent per module")
    p.add_argument("--session", default="sample")
    p.add_argument("--survivors", action="store_true", help="list each survivor with its diff")
    args = ap.parse_args()
    if args.cmd == "init" and args.sample is None and not (args.base or args.session.startswith("changed")):
        args.sample = 300
    if Path(args.workdir).resolve() == REPO.resolve():
        sys.exit("--workdir must not be this checkout: mutants go in a separate worktree")
    {"map": cmd_map, "init": cmd_init, "run": cmd_run, "recheck": cmd_recheck, "status": cmd_status}[args.cmd](args)


if __name__ == "__main__":
    main()
