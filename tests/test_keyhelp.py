"""Each key's meaning in one place (the schema's field metadata), shown by `finetune --help`, the
README's key table and the shell completion; every mode listed and completed."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
from conftest import finetune_cmd
import warm_cli

from finetune import keyhelp
from finetune.completion import candidates
from finetune.config import (
    BACKEND_KEYS,
    MODES,
    RANGES,
    VALID,
    Config,
    range_text,
    schema_keys,
    schema_paths,
)

README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_leaf_key_has_a_one_line_help_string() -> None:
    leaves = [p for p in schema_paths() if not any(q.startswith(p + ".") for q in schema_paths())]
    assert [k.path for k in keyhelp.leaf_keys()] == leaves  # the listing is the schema's leaves, in order
    for k in keyhelp.leaf_keys():
        assert k.meaning and "\n" not in k.meaning, k.path
    # every node holding keys has a title (its dataclass docstring) for the help's section line
    assert all(title for _, title in keyhelp.sections())
    # a dataclass field without metadata would have no help: none is left
    def walk(node: type) -> None:
        for f in dataclasses.fields(node):
            assert f.metadata.get("help"), f"{node.__name__}.{f.name}"
            t = schema_keys(node)[f.name]
            if dataclasses.is_dataclass(t):
                walk(t)
    walk(Config)


def test_readme_key_table_is_the_schemas() -> None:
    """The README's table is generated (`python -m finetune.keyhelp README.md`); a key, a
    meaning, a default or a range changed in finetune/config.py without it fails here."""
    block = keyhelp.readme_block(README.read_text())
    assert block is not None, "README.md lost its key table markers"
    assert block == keyhelp.readme_table(keyhelp.default_tree()), \
        "README.md's key table is stale: run python -m finetune.keyhelp README.md"
    for k in keyhelp.leaf_keys():
        assert f"| `{k.path}` |" in block


def test_values_shown_are_the_resolvers_tables() -> None:
    for path, choices in VALID.items():
        assert keyhelp.options(path) == tuple(choices)
    assert keyhelp.options("mode") == tuple(MODES) == ("train", "plan", "generate", "eval")
    for path in RANGES:
        if not path.startswith("optim.betas."):
            assert str(range_text(path)) in keyhelp.values_text(path), path
    assert "cuda: ddp, fsdp; mlx: ddp" == keyhelp.values_text("backend.strategy")
    assert set(keyhelp.options("optim.name")) >= {"adamw", "adamw_8bit", "sgd"}
    assert all(keyhelp.options(p) for p in BACKEND_KEYS)
    assert keyhelp.options("train.packing") == ("true", "false")
    assert keyhelp.options("search_objective")[-1] == "null" and keyhelp.options("model.path") == ()


def _help(*overrides: str) -> str:
    r = warm_cli.run([*finetune_cmd(), *overrides, "--help"], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_help_lists_every_mode_and_each_keys_meaning_default_and_values() -> None:
    out = _help()
    lines = out.splitlines()
    for mode, what in MODES.items():  # the Modes section: each mode with the start of its meaning
        assert any(ln.startswith(f"  mode={mode} ") and what[:40] in ln for ln in lines), mode
    for k in keyhelp.leaf_keys():
        assert any(ln.startswith(f"  {k.path}=") for ln in lines), k.path
    flat = " ".join(out.split())  # the meanings wrap; read them unwrapped
    assert "train.steps=400 optimizer steps [>= 1]" in flat
    assert "train.schedule=cosine learning-rate schedule after warmup [constant, linear, cosine]" in flat
    assert "mode=train what the command does (finetune --help lists the modes) [train, plan, generate, eval]" in flat
    assert "backend.strategy=ddp several processes:" in flat and "[cuda: ddp, fsdp; mlx: ddp]" in flat
    assert "memory.budget=null memory per device: bytes, a size (40GiB) or a share (90%)" in flat
    assert "null: $FINETUNE_CACHE/tokens" in flat  # a $ in a meaning survives Hydra's template
    assert "finetune-export" in out and "finetune-report" in out
    # the value shown is the one the command would use, after its group choices
    sgd = " ".join(_help("optim=sgd", "model=llama2-7b").split())
    assert "optim.lr=0.01 peak learning rate" in sgd and "model.path=meta-llama/Llama-2-7b-hf hub id" in sgd


def _query(line: str, shell: str = "bash") -> str:
    env = {**os.environ, "COMP_LINE": line, "COMP_POINT": str(len(line))}
    r = warm_cli.run([*finetune_cmd(), "-sc", f"query={shell}"], check=False, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_completion_query_offers_every_mode_and_a_keys_choices() -> None:
    """As Hydra's installed bash function asks: COMP_LINE set, `finetune -sc query=bash`."""
    assert set(_query("finetune mode=").split()) == {f"mode={m}" for m in MODES}
    assert _query("finetune mode=p").split() == ["mode=plan"]
    assert set(_query("finetune -m train.schedule=co").split()) == {"train.schedule=constant", "train.schedule=cosine"}
    assert "optim=adamw,sgd" in _query("finetune -m optim=adamw,").split()  # a sweep of a group
    assert set(_query("finetune logger=").split()) >= {"logger=csv", "logger=wandb"}  # groups stay Hydra's
    fish = _query("finetune mode=", "fish").splitlines()
    assert f"mode=plan\t{MODES['plan']}" in fish  # fish shows each value with its meaning


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_tab_on_mode_offers_every_mode() -> None:
    """The function `finetune -sc install=bash` prints, run by bash on `finetune mode=<TAB>`."""
    script = finetune_cmd()
    if len(script) > 1:
        pytest.skip("no finetune console script in this environment")
    path = f"{Path(script[0]).parent}:{os.environ['PATH']}"
    run = ('eval "$(finetune -sc install=bash)"; COMP_LINE="finetune mode="; COMP_POINT=${#COMP_LINE}; '
           'COMP_CWORD=1; hydra_bash_completion; printf "%s\\n" "${COMPREPLY[@]}"')
    r = warm_cli.run(["bash", "-c", run], check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": path})
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(r.stdout.split()) == {f"mode={m}" for m in MODES}, r.stdout


def test_candidates_leave_hydras_words_to_hydra() -> None:
    assert candidates("optim=") is None and candidates("train.ste") is None and candidates("model.path=") is None
    assert candidates("optim.name=") is None  # chosen with its group
    assert [c for c, _ in candidates("+logger=[csv,t") or []] == ["+logger=[csv,tensorboard"]
    assert candidates("mode=x") == []
