"""``finetune``: the thin command-line entry. The work lives in finetune.loop.train(cfg).

Imports stay light here (hydra, omegaconf): ``finetune --help`` and ``mode=plan`` never import
torch or mlx.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import resources
from typing import Any

from finetune.config import GROUPS, UserError, register_configs
from finetune.supervisor import argv_value, supervise

CONFIG_MODULE = "finetune.conf"


def group_options(group: str) -> list[str]:
    """Options of a config group, from the YAML files installed with the package."""
    root = resources.files(CONFIG_MODULE) / group
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def group_values(value: str) -> list[str]:
    """The options an override's value names: ``a`` -> [a]; a sweep ``a,b`` -> [a, b]; a list
    (``logger=[tensorboard,mlflow]``) or a sweep of lists (``[a],[a,b]``) -> every name in
    them. A sweep function (``choice(a,b)``, ``glob(*)``) -> [], left to Hydra."""
    if "(" in value:
        return []
    return [v.strip() for v in value.replace("[", ",").replace("]", ",").split(",") if v.strip()]


def check_group_choices(argv: list[str]) -> None:
    """Reject ``group=unknown`` before Hydra does, in one line naming the valid options."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.lstrip("+~").partition("=")
        if key in GROUPS:
            options = group_options(key)
            for v in group_values(value):
                if v not in options:
                    raise UserError(f"{key}={v} is not an option; choose one of: {', '.join(options)}")


def run(cfg: Any) -> dict[str, Any] | None:
    """Dispatch a composed config by mode. Tests and sweeps call this directly."""
    if cfg.mode == "plan":
        from finetune.config import validate
        from finetune.planner import run_plan

        validate(cfg)
        return run_plan(cfg)
    if cfg.mode == "generate":
        from finetune.generate import generate

        return generate(cfg)
    from finetune.loop import train

    return train(cfg)


def _task(cfg: Any) -> Any:
    try:
        from finetune import sweep

        if sweep.in_multirun():  # each job from its own baseline (a fresh process), pruned by plan
            return sweep.run_job(cfg, run)
        return run(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        check_group_choices(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if argv_value(sys.argv[1:], "memory.supervise") == "true" and not os.environ.get("FINETUNE_SUPERVISED"):
        sys.exit(supervise(sys.argv[1:]))
    import hydra

    register_configs()
    hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")(_task)()


if __name__ == "__main__":
    main()
