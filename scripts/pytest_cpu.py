"""CPU seconds per test, this process's and its children's: where the suite's time goes on a
box that other jobs load (wall-clock durations then measure the load as much as the test).

    PYTHONPATH=scripts python3 -m pytest -q -p pytest_cpu         # writes .pytest_cpu.jsonl
    python3 scripts/pytest_cpu.py [.pytest_cpu.jsonl]             # per file, most CPU first

Children are counted when waited for (subprocess.run, a sweep's jobs, torchrun's ranks); each
xdist worker appends its own lines. Not a test: nothing asserts on a time."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

OUT = Path(os.environ.get("PYTEST_CPU_OUT", ".pytest_cpu.jsonl"))


def _cpu() -> tuple[float, float]:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    s0, c0 = _cpu()
    w0 = time.perf_counter()
    yield
    s1, c1 = _cpu()
    with OUT.open("a") as f:
        f.write(json.dumps({"test": item.nodeid, "self_s": round(s1 - s0, 3), "children_s": round(c1 - c0, 3),
                            "wall_s": round(time.perf_counter() - w0, 3), "pid": os.getpid()}) + "\n")


def main(path: str = str(OUT)) -> None:
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for line in Path(path).read_text().splitlines():
        d = json.loads(line)
        p = per[d["test"].split("::")[0]]
        p[0] += d["self_s"]
        p[1] += d["children_s"]
        p[2] += d["wall_s"]
        p[3] += 1
    print(f"{'cpu s':>8} {'self':>7} {'children':>8} {'wall s':>8} {'tests':>5}  file")
    for name, (s, c, w, n) in sorted(per.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        print(f"{s + c:8.1f} {s:7.1f} {c:8.1f} {w:8.1f} {int(n):5d}  {name}")
    tot = [sum(v[i] for v in per.values()) for i in range(3)]
    print(f"{tot[0] + tot[1]:8.1f} {tot[0]:7.1f} {tot[1]:8.1f} {tot[2]:8.1f}        all")


if __name__ == "__main__":
    main(*sys.argv[1:])
