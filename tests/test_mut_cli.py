"""The finetune command line where an argument's place must not matter: memory.supervise=true
as the very first argument still runs the training as a supervised child. The child process
is a stand-in (subprocess.call recorded, as the OS would be asked), so nothing trains. Written
for survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_memory_supervise_as_the_first_argument_runs_the_training_in_a_supervised_child(monkeypatch, tmp_path):
    from finetune import cli

    children = []

    def call(cmd, env=None, **kwargs):  # the child finetune process, as subprocess.call would start it
        children.append((cmd, (env or {}).get("FINETUNE_SUPERVISED")))
        return 0  # it finished

    monkeypatch.setattr(subprocess, "call", call)
    monkeypatch.delenv("FINETUNE_SUPERVISED", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    monkeypatch.setattr(sys, "argv", ["finetune", "memory.supervise=true", "train.steps=2", run_dir])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 0
    assert children == [([sys.executable, "-m", "finetune.cli", "memory.supervise=true", "train.steps=2", run_dir],
                         "1")]


def test_a_refused_command_leaves_an_existing_run_dir_as_it_was(tmp_path):
    """Hydra writes .hydra/ and its log before the command is refused (a missing data file,
    say): the run dir's guard takes them back, new files and directories removed, changed
    ones rewritten as they were, and the user's own files left."""
    from finetune.cli import RunDirGuard

    fresh = tmp_path / "fresh"  # a run dir of the user's own notes, no .hydra/ yet
    fresh.mkdir()
    (fresh / "notes.txt").write_text("mine")
    guard = RunDirGuard(fresh, ".hydra")
    (fresh / ".hydra").mkdir()
    (fresh / ".hydra" / "config.yaml").write_text("train:\n  steps: 2\n")
    (fresh / "finetune.log").write_text("INFO composing\n")
    guard.restore()
    assert sorted(p.name for p in fresh.iterdir()) == ["notes.txt"]

    earlier = tmp_path / "earlier"  # an earlier run's directory: its .hydra/ holds its config
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / ".hydra" / "config.yaml").write_text("a: 1\n")
    guard = RunDirGuard(earlier, ".hydra")
    (earlier / ".hydra" / "config.yaml").write_text("b: 2\n")  # this command's config, sorting after the old
    guard.restore()
    assert (earlier / ".hydra" / "config.yaml").read_text() == "a: 1\n"
    assert sorted(p.name for p in (earlier / ".hydra").iterdir()) == ["config.yaml"]

    bare = tmp_path / "bare"  # hydra.output_subdir=null: no .hydra/ at all
    bare.mkdir()
    guard = RunDirGuard(bare, None)
    (bare / "finetune.log").write_text("INFO composing\n")
    guard.restore()
    assert list(bare.iterdir()) == []
