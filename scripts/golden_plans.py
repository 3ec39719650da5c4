"""Write (or check) the plan.json of each configuration in tests/data/plans/configs.txt.

The files are the planner's output at the commit that wrote them, made with the hub offline, no
cache and the machine pinned (``pin_machine``: a CPU-only host of the build box's RAM; a plan
prices the device it would run on, and a box's RAM moves by a few hundred KiB from boot to boot),
so the same tree gives the same bytes anywhere. `tests/test_plan_golden.py` holds the
planner to them: a refactor must leave every byte as it was; a change to the planner's math
rewrites them with this script, and the diff shows every figure that moved.

    python scripts/golden_plans.py          # rewrite tests/data/plans/*.json
    python scripts/golden_plans.py --check  # exit 1 and name the files that differ

`--drop-unknown` (for the mutation runner, at an older commit) first removes from configs.txt
the configurations that commit's config schema refuses, then writes the rest.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "tests" / "data" / "plans"


PINNED_RAM = 25_276_502_016  # bytes: psutil's total on the box that wrote the files


def pin_machine() -> None:
    """Plan as on the box that wrote the files, whatever this one is: no CUDA device, not Apple
    Silicon, PINNED_RAM of RAM. Set in ``finetune.budget`` before the backends import its
    functions by name."""
    sys.path.insert(0, str(REPO))
    import finetune.budget as b

    if any(m.startswith("finetune.backends.") for m in sys.modules):
        raise RuntimeError("pin_machine must run before the backends are imported")
    b.system_ram = lambda: PINNED_RAM
    b.cuda_devices = lambda: (0, None)
    b.apple_silicon = lambda: False


def configs() -> list[tuple[str, list[str]]]:
    out = []
    for line in (PLANS / "configs.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, overrides = line.partition(":")
            out.append((name.strip(), overrides.split()))
    return out


def plan_bytes(overrides: list[str]) -> str:
    """plan.json's text for these overrides, as `finetune mode=plan` writes it."""
    sys.path.insert(0, str(REPO))
    from finetune.config import compose
    from finetune.planner import plan

    try:  # the planner takes the resolved spec (issue 22); an older commit (the mutation runner's) the config
        from finetune.resolver import resolve
    except ImportError:
        def resolve(cfg):  # type: ignore[no-redef]
            return cfg

    with tempfile.TemporaryDirectory() as d:
        cfg = compose(Path(d) / "run", *overrides)
        return json.dumps(plan(resolve(cfg)), indent=2) + "\n"


def main(argv: list[str]) -> int:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="empty-hub-")
    pin_machine()
    differ = []
    if "--drop-unknown" in argv:
        keep = []
        for line in (PLANS / "configs.txt").read_text().splitlines(keepends=True):
            name, _, overrides = line.split("#", 1)[0].partition(":")
            try:
                if name.strip():
                    plan_bytes(overrides.split())
            except Exception:  # this commit's schema refuses it (a UserError, wherever it lives)
                continue
            keep.append(line)
        (PLANS / "configs.txt").write_text("".join(keep))
    for name, overrides in configs():
        text = plan_bytes(overrides)
        path = PLANS / f"{name}.json"
        if "--check" in argv:
            if not path.is_file() or path.read_text() != text:
                differ.append(name)
        else:
            path.write_text(text)
    if differ:
        print("plan.json differs for: " + ", ".join(differ), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
