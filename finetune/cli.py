"""``finetune``: the front door. ``main`` answers what needs no config (a <TAB>, a group option
that does not exist), refuses a config that does not compose (Hydra's Compose API: no run dir
made), and hands the command to Hydra. Hydra's job, ``_task``, masks secrets in the files Hydra
saved, resolves the config into a RunSpec (finetune.resolver) and runs the mode:
finetune.run.loop.train, the planner, generate, or a sweep's job. The rest is Hydra's own settings
(conf/config.yaml): its callbacks make and lock the run dir before Hydra writes into it
(finetune.run.directory) and finish a sweep; its job logging writes no log file. A refused command
is one line, exit 2, and leaves no run dir behind, or an existing one as it was.

Imports stay light here (hydra, omegaconf): ``finetune --help`` never imports torch or mlx, nor
does ``mode=plan`` unless it reads the data's lengths with a tokenizer (finetune.data.lengths).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import OmegaConf

from finetune import completion, keyhelp, quiet, sweep
from finetune.config import (
    GROUPS,
    choose_data_group,
    config_error_line,
    group_options,
    register_configs,
)
from finetune.errors import UserError, debug, refuse
from finetune.evaluate import evaluate
from finetune.generate import generate
from finetune.run.loop import train
from finetune.planner import run_plan
from finetune.records import Plan
from finetune.redact import redact_hydra_files
from finetune.resolver import resolve
from finetune.run.directory import RunDirGuard, put_back, several_ranks
from finetune.run.supervisor import argv_value, supervise

# what tests and sweeps call here; the run dir's guard belongs to the command line (finetune.run.directory)
__all__ = ["RunDirGuard", "check_group_choices", "group_values", "main", "run", "sweep_job"]

CONFIG_MODULE = "finetune.conf"


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


def run(cfg: Any) -> Plan | dict[str, Any] | None:
    """Resolve a composed config into its checked RunSpec (every check, once, for every mode)
    and dispatch it by mode: the plan, the completion, or the run's summary. Tests and sweeps
    call this directly."""
    spec = resolve(cfg)
    if spec.mode == "plan":
        return run_plan(spec)
    if spec.mode == "generate":
        return generate(spec)
    if spec.mode == "eval":
        return evaluate(spec)
    return train(spec)


def sweep_job(cfg: Any, tree: Any = None) -> sweep.Job:
    """What the sweep reads of a multirun job's composed config (finetune.sweep.run_job);
    ``tree``: the config as a container, where the caller has it already."""
    tree = OmegaConf.to_container(cfg, resolve=False) if tree is None else tree
    return sweep.Job(run_dir=Path(str(cfg.run_dir)), mode=str(cfg.mode), objective=cfg.search_objective,
                     isolate_jobs=bool(cfg.isolate_jobs), fail_fast=bool(cfg.fail_fast),
                     tree={str(k): v for k, v in tree.items()} if isinstance(tree, dict) else {}, spec=lambda: resolve(cfg), run=lambda: run(cfg))


def check_composes(argv: list[str]) -> None:
    """Compose the command's config as Hydra will, with Hydra's Compose API (no run dir, no
    job), so that an unknown key or a bad value is refused in one line before ``hydra.main``
    makes anything. A sweep (``-m``) composes its first job and each further value of each
    sweep in its place, every one a job of the sweep (as Hydra's basic sweeper splits it); a
    sweep Hydra cannot enumerate (``interval``, ``glob``) is left to the sweeper. A command with
    Hydra's other flags (--help, --cfg, -sc, --config-dir...) goes to Hydra as it is."""
    flags = {a for a in argv if a.startswith("-")}
    overrides = [a for a in argv if not a.startswith("-")]
    if not overrides or flags - {"-m", "--multirun"}:  # the default config composes
        return
    from hydra import compose, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        jobs = [overrides]
        if flags or "hydra.mode=MULTIRUN" in overrides:
            choices = []
            for o in OverridesParser.create().parse_overrides(overrides):
                try:
                    choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
                                   if o.is_sweep_override() else [str(o.input_line)])
                except HydraException:  # a sweep only its sweeper enumerates (interval, glob)
                    continue
            first = [c[0] for c in choices]
            jobs = [first] + [first[:i] + [v] + first[i + 1:] for i, c in enumerate(choices) for v in c[1:]]
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            for job in jobs:
                compose(config_name="config", overrides=job)
    except Exception as e:
        line = config_error_line(e)
        if line is None:
            raise
        refuse(UserError(line))


def _task(cfg: Any) -> Any:
    """The job Hydra runs, once its files are in the run dir: secrets masked in them, then the
    mode; a refused command puts the run dir back as it was (finetune.run.directory) and says why."""
    try:
        # .hydra/*.yaml: no token or key a user passed or planted
        tree = OmegaConf.to_container(cfg, resolve=False)
        redact_hydra_files(cfg.get("run_dir"), tree)
        if sweep.in_multirun():  # each job from its own baseline (a fresh process), pruned by plan
            return sweep.run_job(sweep_job(cfg, tree))
        return run(cfg)
    except UserError as e:
        put_back(OmegaConf.select(cfg, "run_dir", throw_on_resolution_failure=False))
        refuse(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def _generate_run_dir(argv: list[str]) -> str | None:
    """``mode=generate`` leaves no run dir behind: Hydra makes one for every run (and .hydra/ in
    it) before the task starts, so unless the command names one (``hydra.run.dir=``) it gets a
    temporary directory, returned here for ``main`` to remove, and no .hydra/. A multirun keeps
    its sweep dirs."""
    if argv_value(argv, "mode") != "generate" or any(a in ("-m", "--multirun") for a in argv) \
            or any(a.lstrip("+~").startswith("hydra.run.dir=") for a in argv):
        return None
    tmp = tempfile.mkdtemp(prefix="finetune-generate-")
    quote = '"' if "'" in tmp else "'"  # a quoted value: TMPDIR may hold spaces or ( ) [ ] ,
    argv += [f"hydra.run.dir={quote}{tmp}{quote}", "hydra.output_subdir=null"]
    return tmp


def main() -> None:
    if "--debug" in sys.argv[1:]:
        sys.argv.remove("--debug")
        os.environ["HYDRA_FULL_ERROR"] = "1"
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    # a <TAB> on a key's value (mode=, train.schedule=co, optim=adamw,): every value it takes
    if (completions := completion.answer(sys.argv[1:], os.environ)) is not None:
        print(completions)
        sys.exit(0)
    quiet.install(debug())  # the known third-party lines that tell a user nothing (--debug: all)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        check_group_choices(sys.argv[1:])
    except UserError as e:
        refuse(e)
    # data.path=train.jsonl alone trains on that file: the group that reads it, said in one line
    chosen, note = choose_data_group(sys.argv[1:])
    if note:
        sys.argv[1:] = chosen
        print(note, file=sys.stderr)
    if argv_value(sys.argv[1:], "memory.supervise") == "true" and not os.environ.get("FINETUNE_SUPERVISED"):
        sys.exit(supervise(sys.argv[1:]))
    import hydra

    register_configs()
    keyhelp.register()  # ${finetune_keys:} in the --help template: every mode and key, with its meaning
    check_composes(sys.argv[1:])
    argv = sys.argv[1:]
    scratch = _generate_run_dir(argv)
    sys.argv[1:] = argv
    try:
        hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")(_task)()
    except sweep.SweepStopped as stop:  # fail_fast=true: the first failed job ended the sweep
        sys.exit(sweep.stopped(stop))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    code = sweep.multirun_exit_code()  # a multirun with failed jobs: 1, naming them in one line
    if several_ranks():
        _leave_rank(code)
    sys.exit(code)


def _leave_rank(code: int) -> NoReturn:
    """One rank of several, its run written and its process group destroyed: leave without the
    interpreter's teardown. A collective library's threads can still hold work whose teardown
    aborts the process there (pytorch/pytorch#179291; CI saw one rank of a finished gloo run end
    in SIGABRT, "terminate called without an active exception"), turning a finished run into a
    failed launch. Everything the run writes is closed by now; the streams are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
