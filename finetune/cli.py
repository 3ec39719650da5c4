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


def debug() -> bool:
    """``--debug`` or ``HYDRA_FULL_ERROR=1``: errors show their traceback (for bug reports)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _fail(e: BaseException) -> None:
    """A bad input: one line naming the fix, exit 2; the traceback only under --debug."""
    if debug():
        raise e
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    sys.exit(2)


def _remove_unused_run_dir(cfg: Any) -> None:
    """After a bad input: a run dir holding only what Hydra wrote into it (.hydra/, its log)
    goes, so nothing is left that looks like a run's result."""
    import shutil
    from pathlib import Path

    try:
        d = Path(str(cfg.run_dir))
    except Exception:  # no run dir resolved (an error in the config itself)
        return
    if d.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in d.iterdir()):
        shutil.rmtree(d, ignore_errors=True)


_TASK_STARTED = False  # an OSError before this is Hydra making the run dir


def _task(cfg: Any) -> Any:
    global _TASK_STARTED
    _TASK_STARTED = True
    try:
        from finetune import sweep
        from finetune.redact import redact_hydra_files

        redact_hydra_files(cfg)  # .hydra/*.yaml: no token or key a user passed or planted
        if sweep.in_multirun():  # each job from its own baseline (a fresh process), pruned by plan
            return sweep.run_job(cfg, run)
        return run(cfg)
    except UserError as e:
        _remove_unused_run_dir(cfg)
        _fail(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def _one_line_config_errors() -> None:
    """Hydra prints a composition error (an unknown key, a string where a number belongs, a run
    dir it cannot create) over several lines and exits 1; print ours, one line, exit 2."""
    import hydra._internal.utils as hydra_utils

    from finetune.config import config_error_line

    report = hydra_utils.run_and_report

    def run_and_report(func: Any) -> Any:
        def guarded() -> Any:
            try:
                return func()
            except OSError as e:  # the run dir: Hydra makes it (and .hydra/) before the task
                if debug() or _TASK_STARTED:
                    raise
                where = getattr(e, "filename", None) or ""
                _fail(UserError(f"cannot write {where} ({e.strerror or e}); set hydra.run.dir= to a "
                                "writable directory"))
            except Exception as e:
                line = config_error_line(e)
                if line is None or debug():
                    raise
                _fail(UserError(line))

        return report(guarded)

    hydra_utils.run_and_report = run_and_report


def main() -> None:
    if "--debug" in sys.argv[1:]:
        sys.argv.remove("--debug")
        os.environ["HYDRA_FULL_ERROR"] = "1"
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        check_group_choices(sys.argv[1:])
    except UserError as e:
        _fail(e)
    if argv_value(sys.argv[1:], "memory.supervise") == "true" and not os.environ.get("FINETUNE_SUPERVISED"):
        sys.exit(supervise(sys.argv[1:]))
    import hydra

    register_configs()
    _one_line_config_errors()
    hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")(_task)()


if __name__ == "__main__":
    main()
