"""tests/warm_cli.py, the suite's CLI runs as forks of a warm process, answers as the fresh
process it stands in for: the same exit status, streams and files, and a fresh process wherever
the fork could differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import finetune_cmd
import warm_cli

pytestmark = pytest.mark.skipif(os.environ.get("FINETUNE_TEST_FRESH") == "1",
                                reason="FINETUNE_TEST_FRESH=1 runs every command fresh: no fork to compare")


def _both(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    forks = warm_cli.forks
    warm = warm_cli.run(cmd, **kw)
    if warm_cli.forks != forks + 1:
        pytest.fail(f"not forked: {warm_cli.fresh[-1:]}")
    return subprocess.run(cmd, **kw), warm


def test_a_refusal_is_the_same_from_a_fork(tmp_path) -> None:
    """One line, exit 2, no run dir: byte for byte what the fresh process says, through the
    console script, `python -m finetune` and `python -m finetune.cli` (a module the server has
    imported: runpy warned of it in a fork until the fork let go of it)."""
    for cmd in (finetune_cmd(), [sys.executable, "-m", "finetune"], [sys.executable, "-m", "finetune.cli"]):
        runs = {}
        for name, r in zip(("fresh", "warm"), _both([*cmd, "train.stepz=3", f"hydra.run.dir={tmp_path}/r"],
                                                     capture_output=True, text=True, timeout=120)):
            runs[name] = (r.returncode, r.stdout, r.stderr, (tmp_path / "r").exists())
        assert runs["fresh"] == runs["warm"] and runs["warm"][0] == 2 and not runs["warm"][3], runs


def test_the_fork_has_the_callers_cwd_env_umask_and_stdin(tmp_path) -> None:
    """Completion answers from the command's own environment (COMP_LINE is not import-time), a
    file argument is found from the command's cwd, and input= reaches the fork's stdin."""
    env = {**os.environ, "FINETUNE_WARM_PROBE": "1"}
    fresh, warm = _both([*finetune_cmd(), "-sc", "query=bash"], capture_output=True, text=True, timeout=120,
                        env={**env, "COMP_LINE": "finetune optim=pa", "COMP_POINT": "17"}, cwd=tmp_path)
    assert warm.returncode == fresh.returncode and warm.stdout == fresh.stdout and "paged_adamw_8bit" in warm.stdout
    fresh, warm = _both([*finetune_cmd(), "--help"], input=b"ignored\n", capture_output=True, timeout=120)
    assert warm.returncode == fresh.returncode == 0 and warm.stdout == fresh.stdout and isinstance(warm.stdout, bytes)


def test_what_a_fork_could_get_wrong_goes_to_a_fresh_process(tmp_path) -> None:
    forks = warm_cli.forks
    cases = [
        ([*finetune_cmd(), "--help"], {"env": {**os.environ, "HF_HUB_CACHE": str(tmp_path)}},
         "an environment of its own, first seen: HF_HUB_CACHE"),
        ([*finetune_cmd(), "--help"], {"start_new_session": True}, "keywords start_new_session"),
        ([sys.executable, "-X", "importtime", "-m", "finetune", "--help"], {}, "not a CLI command"),
        ([*finetune_cmd(), "--help", "--debug"], {}, "--debug"),
    ]
    for cmd, kw, why in cases:
        r = warm_cli.run(cmd, capture_output=True, text=True, timeout=120, **kw)
        assert r.returncode == 0 and why in warm_cli.fresh[-1], (cmd, warm_cli.fresh[-1:])
    assert warm_cli.forks == forks


def test_check_and_timeout_raise_as_subprocess_does(tmp_path) -> None:
    with pytest.raises(subprocess.CalledProcessError) as e:
        warm_cli.run([*finetune_cmd(), "train.stepz=3"], capture_output=True, text=True, timeout=120, check=True)
    assert e.value.returncode == 2 and "train.stepz" in e.value.stderr
    with pytest.raises(subprocess.TimeoutExpired):  # a 2-step run takes seconds; given 0.01 s it is killed
        warm_cli.run([*finetune_cmd(), "backend=cuda", "train.steps=2", f"hydra.run.dir={tmp_path}/r"],
                     capture_output=True, text=True, timeout=0.01)


def test_an_environment_seen_twice_gets_a_server_started_with_it(tmp_path) -> None:
    """HF_HUB_CACHE is read by huggingface_hub when imported: the second command with it forks from
    a server whose imports read it, and finds the hub cache's model as a fresh process does."""
    from test_model_source import lay_out_hub_cache

    cache = tmp_path / "hub"
    config = '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, ' \
             '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}'
    lay_out_hub_cache(cache, "meta-llama/Llama-3.1-8B", config)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_TOKEN")}
    env = {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    cmd = [*finetune_cmd(), "mode=plan", "model=llama3.1-8b", "backend=cuda", "memory.budget=80GiB"]
    first = warm_cli.run([*cmd, f"hydra.run.dir={tmp_path}/a"], capture_output=True, text=True, timeout=120, env=env)
    assert "first seen" in warm_cli.fresh[-1] and first.returncode == 0, first.stderr[-2000:]
    forks = warm_cli.forks
    warm = warm_cli.run([*cmd, f"hydra.run.dir={tmp_path}/b"], capture_output=True, text=True, timeout=120, env=env)
    assert warm_cli.forks == forks + 1 and warm.returncode == 0, (warm_cli.fresh[-1:], warm.stderr[-2000:])
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["model"]["layers"] == 2 and "config.json in the hub cache" in plan["model"]["source"], plan["model"]
    assert plan == json.loads((tmp_path / "a" / "plan.json").read_text())  # the fresh process's plan
