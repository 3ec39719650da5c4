"""``finetune``: the thin command-line entry. It resolves the composed config into a RunSpec
(finetune.resolver) and hands it to the mode: finetune.loop.train, the planner, generate.

Imports stay light here (hydra, omegaconf): ``finetune --help`` never imports torch or mlx, nor
does ``mode=plan`` unless it reads the data's lengths with a tokenizer (finetune.plandata).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import OmegaConf

from finetune.config import GROUPS, group_options, register_configs
from finetune.errors import UserError
from finetune.supervisor import argv_value, supervise
from finetune import checkpoints, completion, keyhelp, quiet, sweep
from finetune.config import choose_data_group, config_error_line
from finetune.generate import generate
from finetune.loop import train
from finetune.planner import run_plan
from finetune.records import Plan
from finetune.redact import redact_hydra_files
from finetune.resolver import resolve

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
    return train(spec)


def sweep_job(cfg: Any, tree: Any = None) -> sweep.Job:
    """What the sweep reads of a multirun job's composed config (finetune.sweep.run_job);
    ``tree``: the config as a container, where the caller has it already."""
    tree = OmegaConf.to_container(cfg, resolve=False) if tree is None else tree
    return sweep.Job(run_dir=Path(str(cfg.run_dir)), mode=str(cfg.mode), objective=cfg.objective,
                     isolate_jobs=bool(cfg.isolate_jobs), fail_fast=bool(cfg.fail_fast),
                     tree={str(k): v for k, v in tree.items()} if isinstance(tree, dict) else {}, spec=lambda: resolve(cfg), run=lambda: run(cfg))


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


class RunDirGuard:
    """A single training run's directory as it was before Hydra wrote into it, and its lock.

    Hydra writes ``.hydra/{config,hydra,overrides}.yaml`` and opens its log before our code
    runs. The guard is made just before that (``_guard_run_dir``): it takes the run dir's lock
    first, so a second run into a busy directory is refused having written nothing, and it
    keeps what those files held, so a command refused later (a resume of another run, a
    missing data file) puts them back and leaves an existing run's directory as it was."""

    HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")

    def __init__(self, run_dir: Path, subdir: str | None):
        self.run_dir = run_dir
        self.hydra_dir = run_dir / subdir if subdir else None
        self.hydra_dir_existed = bool(self.hydra_dir and self.hydra_dir.is_dir())
        self.files: dict[Path, bytes | None] = {}
        if self.hydra_dir is not None:
            for name in self.HYDRA_FILES:
                f = self.hydra_dir / name
                self.files[f] = f.read_bytes() if f.is_file() else None
        self.logs = {f: f.stat().st_size for f in run_dir.glob("*.log") if f.is_file()}
        self.lock = checkpoints.lock_run_dir(run_dir)

    def restore(self) -> None:
        """Put back what this command wrote before the run began (nothing once it has begun)."""
        if self.lock.begun:
            return
        for f, old in self.files.items():
            try:
                if old is None:
                    f.unlink(missing_ok=True)
                elif not f.is_file() or f.read_bytes() != old:
                    f.write_bytes(old)
            except OSError:
                pass
        if self.hydra_dir is not None and not self.hydra_dir_existed:
            try:
                self.hydra_dir.rmdir()  # only when empty: nothing of anyone else's goes
            except OSError:
                pass
        for f in self.run_dir.glob("*.log"):
            try:
                if f not in self.logs:
                    f.unlink()
                elif f.stat().st_size > self.logs[f]:
                    os.truncate(f, self.logs[f])
            except OSError:
                pass
        self.lock.release(remove=True)


_GUARD: RunDirGuard | None = None


def _several_ranks() -> bool:
    """A launcher started this process as one of several (torchrun, srun, mlx.launch, mpirun):
    rank 0's Trainer takes the lock once the ranks agree on one run dir."""
    env = os.environ
    return any(int(env.get(k) or 1) > 1 for k in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")) \
        or "MLX_RANK" in env


def _guard_run_dir() -> None:
    """Make the RunDirGuard of a single training run just before Hydra writes into its
    directory: Hydra's ``run_job`` configures its log (the first file it opens there) and
    then saves ``.hydra/``; the run dir is already known to its HydraConfig."""
    import hydra.core.utils as hydra_core_utils

    original = hydra_core_utils.configure_log

    def configure_log(*args: Any, **kwargs: Any) -> Any:
        global _GUARD
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():  # a multirun's launcher, before its first job: no run dir
            return original(*args, **kwargs)
        hc = HydraConfig.get()
        mode = next((o.split("=", 1)[1] for o in hc.overrides.task if o.startswith("mode=")), "train")
        if hc.mode == RunMode.RUN and mode == "train" and not _several_ranks():
            _GUARD = RunDirGuard(Path(hc.runtime.output_dir), hc.output_subdir)
        return original(*args, **kwargs)

    hydra_core_utils.configure_log = configure_log


def _task(cfg: Any) -> Any:
    global _TASK_STARTED
    _TASK_STARTED = True
    try:
        # .hydra/*.yaml: no token or key a user passed or planted
        tree = OmegaConf.to_container(cfg, resolve=False)
        redact_hydra_files(cfg.get("run_dir"), tree)
        if sweep.in_multirun():  # each job from its own baseline (a fresh process), pruned by plan
            return sweep.run_job(sweep_job(cfg, tree))
        return run(cfg)
    except UserError as e:
        if _GUARD is not None:
            _GUARD.restore()
        _remove_unused_run_dir(cfg)
        _fail(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def _one_line_config_errors() -> None:
    """Hydra prints a composition error (an unknown key, a string where a number belongs, a run
    dir it cannot create) over several lines and exits 1; print ours, one line, exit 2."""
    import hydra._internal.utils as hydra_utils

    report = hydra_utils.run_and_report

    def run_and_report(func: Any) -> Any:
        def guarded() -> Any:
            try:
                return func()
            except UserError as e:  # the run dir's guard refused it before Hydra wrote anything
                if debug():
                    raise
                _fail(e)
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
        _fail(e)
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
    _one_line_config_errors()
    _guard_run_dir()

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
    if _several_ranks():
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
