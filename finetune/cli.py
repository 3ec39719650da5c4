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

CONFIG_MODULE = "finetune.conf"


def group_options(group: str) -> list[str]:
    """Options of a config group, from the YAML files installed with the package."""
    root = resources.files(CONFIG_MODULE) / group
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def check_group_choices(argv: list[str]) -> None:
    """Reject ``group=unknown`` before Hydra does, in one line naming the valid options."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.lstrip("+~").partition("=")
        if key in GROUPS:
            options = group_options(key)
            for v in value.split(","):  # sweeps: a,b,c
                if v and v not in options and not v.startswith(("choice(", "range(", "glob(")):
                    raise UserError(f"{key}={v} is not an option; choose one of: {', '.join(options)}")


def run(cfg: Any) -> dict[str, Any] | None:
    """Dispatch a composed config by mode. Tests and sweeps call this directly."""
    if cfg.mode == "plan":
        from finetune.config import validate
        from finetune.planner import run_plan

        validate(cfg)
        return run_plan(cfg)
    from finetune.loop import train

    return train(cfg)


def _task(cfg: Any) -> Any:
    try:
        return run(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def _argv_value(argv: list[str], key: str) -> str | None:
    for a in argv:
        if a.startswith(key + "="):
            return a.split("=", 1)[1]
    return None


def supervise(argv: list[str]) -> int:
    """Run the job in a child process; if the child dies by a signal or abort (MLX aborts the
    process on a Metal allocation failure, which cannot be caught), restart it from its last
    checkpoint with half the micro-batch and twice the accumulation (same effective batch)."""
    import json
    import subprocess
    import time
    from pathlib import Path

    from omegaconf import OmegaConf

    from finetune.governor import smaller_divisor

    run_dir = _argv_value(argv, "hydra.run.dir") or time.strftime("outputs/%Y-%m-%d/%H-%M-%S_supervised")
    args = [a for a in argv if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "FINETUNE_SUPERVISED": "1"}
    for restart in range(4):
        rc = subprocess.call([sys.executable, "-m", "finetune.cli", *args], env=env)
        if rc >= 0 and rc != 134:  # finished, or an ordinary error the child already reported
            return rc
        composed = Path(run_dir, ".hydra", "config.yaml")
        if restart == 3 or not composed.is_file():
            print(f"error: the run died (exit {rc}) and supervision gave up; see {run_dir}", file=sys.stderr)
            return 1
        cfg = OmegaConf.load(composed)
        eff = int(cfg.train.batch_size) * int(cfg.train.grad_accum)
        micro, step = int(cfg.train.batch_size), 0
        ckpts = sorted(Path(run_dir, "checkpoints").glob("step_*"))
        if ckpts:
            state = json.loads((ckpts[-1] / "trainer_state.json").read_text())
            micro, step = min(micro, int(state["micro_batch"])), int(state["step"])
        new = smaller_divisor(eff, micro)
        if new is None:
            print(f"error: the run died (exit {rc}) at micro-batch 1; it does not fit: try finetune mode=plan",
                  file=sys.stderr)
            return 1
        event = {"step": step, "trigger": "process_died", "action": "restart_lower_micro_batch",
                 "before": {"batch_size": micro, "grad_accum": eff // micro, "exit": rc},
                 "after": {"batch_size": new, "grad_accum": eff // new, "resume_from_step": step}}
        with Path(run_dir, "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"event": event}) + "\n")
        print(f"[supervisor] child died (exit {rc}); restarting from step {step} with micro-batch {new}", file=sys.stderr)
        keep = ("train.batch_size=", "train.grad_accum=", "train.resume=")
        args = [a for a in args if not a.startswith(keep)]
        args += [f"train.batch_size={new}", f"train.grad_accum={eff // new}", f"train.resume={'true' if ckpts else 'false'}"]
    return 1


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        check_group_choices(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if _argv_value(sys.argv[1:], "memory.supervise") == "true" and not os.environ.get("FINETUNE_SUPERVISED"):
        sys.exit(supervise(sys.argv[1:]))
    import hydra

    register_configs()
    hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")(_task)()


if __name__ == "__main__":
    main()
