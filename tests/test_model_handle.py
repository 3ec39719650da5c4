"""The model described once (issue 32): a run builds one model handle and hands it on, so the
model's config.json is described once per run, counted by profiling the CLI; presets are
config.json facts, and overriding one (``model.config.KEY=VALUE``) is planned and built, or
refused in one line, never ignored."""

from __future__ import annotations

import hashlib
import json
import os
import pstats
import sys
from pathlib import Path

import pytest

from finetune.errors import UserError
from finetune.model.source import local_model_dir
from finetune.planner import plan
from finetune.model.tiny import BUILDER_VERSION, _cache_key, tiny_config
from conftest import REPO, finetune_cmd, make_spec, needs_mlx, needs_torch
import warm_cli

RELEASED = REPO / "tests" / "data" / "released"


def _offline(cache: Path) -> dict[str, str]:
    """An environment whose hub cache is ``cache`` and whose hub is out of reach."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_TOKEN", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def _calls(prof: Path, name: str, file_end: str) -> int:
    """How many times the profile ``prof`` saw the function ``name`` of a file ending ``file_end`` called."""
    stats = pstats.Stats(str(prof)).stats  # type: ignore[attr-defined]
    return sum(nc for (f, _, n), (_, nc, _, _, _) in stats.items() if n == name and f.endswith(file_end))


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs_torch), pytest.param("mlx", marks=needs_mlx)])
def test_a_run_describes_its_model_once(tmp_path: Path, backend: str) -> None:
    """A default run (two steps) under cProfile: describe() of finetune/model/describe.py runs
    once, and our config.json reader once (it was 8 describes: the resolver, each governor
    check, each plan, the loop, the runtime, the checkpointer, calibration)."""
    prof, run = tmp_path / "run.prof", tmp_path / "run"
    r = warm_cli.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "finetune.cli", f"backend={backend}",
                        "train.steps=2", "train.progress=false", f"hydra.run.dir={run}"],
                       cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "summary.json").is_file()
    assert _calls(prof, "describe", "finetune/model/describe.py") == 1
    assert _calls(prof, "read_model_config", "finetune/model/source.py") == 1


def test_a_hub_preset_plans_the_layers_it_is_given(tmp_path: Path) -> None:
    """`finetune mode=plan model=llama3.1-8b model.config.num_hidden_layers=16` plans 16 layers:
    from the preset's released facts (no hub at hand), and over the hub's own config.json where
    the hub cache has it (32 layers there); the plan says it is a what-if."""
    from test_model_source import lay_out_hub_cache

    cache = tmp_path / "hub"
    cache.mkdir()
    cached = tmp_path / "hub-cached"
    lay_out_hub_cache(cached, "meta-llama/Llama-3.1-8B", (RELEASED / "Llama-3.1-8B" / "config.json").read_text())
    for hub, where in ((cache, "model.config of preset llama3.1-8b"), (cached, "config.json in the hub cache")):
        out = tmp_path / f"plan-{hub.name}"
        r = warm_cli.run([*finetune_cmd(), "mode=plan", "model=llama3.1-8b", "model.config.num_hidden_layers=16",
                            "backend=cuda", "memory.budget=80GiB", f"hydra.run.dir={out}"],
                           capture_output=True, text=True, timeout=300, env=_offline(hub), check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        p = json.loads((out / "plan.json").read_text())
        assert p["model"]["layers"] == 16, p["model"]
        assert where in p["model"]["source"] and "model.config.num_hidden_layers=16" in p["model"]["source"]
        assert any("what-if" in n for n in p["notes"]), p["notes"]
    full = warm_cli.run([*finetune_cmd(), "mode=plan", "model=llama3.1-8b", "backend=cuda", "memory.budget=80GiB",
                           f"hydra.run.dir={tmp_path / 'plan-32'}"],
                          capture_output=True, text=True, timeout=300, env=_offline(cached), check=False)
    assert full.returncode == 0, full.stderr[-3000:]
    p32 = json.loads((tmp_path / "plan-32" / "plan.json").read_text())
    assert p32["model"]["layers"] == 32 and p32["params_total"] > p["params_total"]


def test_the_old_key_is_refused_naming_the_fact(tmp_path: Path) -> None:
    """`model.num_layers=16` (a preset's key until issue 32) is one line naming
    model.config.num_hidden_layers, exit 2, no run dir left."""
    run = tmp_path / "r"
    r = warm_cli.run([*finetune_cmd(), "mode=plan", "model=llama3.1-8b", "model.num_layers=16",
                        f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: model.num_layers is not a config key; did you mean: model.config.num_hidden_layers"], \
        r.stderr
    assert "Traceback" not in r.stderr and not run.exists()
    for old, new in (("+model.hidden_size=128", "model.config.hidden_size"),
                     ("+model.tie_embeddings=false", "model.config.tie_word_embeddings")):
        with pytest.raises(UserError, match=rf"^model\.\w+ is not a config key; did you mean: {new}$"):
            make_spec(tmp_path / "x", "mode=plan", old)


def test_a_run_or_generate_refuses_a_hub_what_if(tmp_path: Path) -> None:
    """A run trains the hub checkpoint as its config.json says: a fact set over it would be
    ignored, so mode=train (and mode=generate) refuse it in one line, before any download."""
    cache = tmp_path / "hub"
    cache.mkdir()
    for mode in ("train", "generate"):
        run = tmp_path / mode
        r = warm_cli.run([*finetune_cmd(), f"mode={mode}", "model=llama3.1-8b", "model.config.num_hidden_layers=16",
                            'prompt="hi"', "backend=cuda", f"hydra.run.dir={run}"],
                           capture_output=True, text=True, timeout=300, env=_offline(cache), check=False)
        assert r.returncode == 2, r.stderr
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith("error: model.config.num_hidden_layers=16 is set over the "
                                                         "config.json of meta-llama/Llama-3.1-8B"), r.stderr
        assert "mode=plan" in errors[0] and not run.exists()


def test_a_checkpoint_on_disk_refuses_a_fact_its_config_contradicts(tmp_path: Path) -> None:
    """model.path at a directory: its config.json is the model; a model.config fact that says
    otherwise is one line naming both values, one that agrees is accepted."""
    d = local_model_dir(make_spec(tmp_path / "a", "mode=plan").model, seed=0)
    with pytest.raises(UserError) as e:
        make_spec(tmp_path / "b", "mode=plan", f"model.path={d}", "model.config.num_hidden_layers=4")
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"model.config.num_hidden_layers=4 contradicts {d / 'config.json'} "
                                                "(num_hidden_layers: 2)"), line
    spec = make_spec(tmp_path / "c", "mode=plan", f"model.path={d}", "model.config.num_hidden_layers=2")
    assert spec.model_handle is not None and spec.model_handle.desc.layers == 2


def test_the_tiny_model_is_planned_and_built_from_its_facts(tmp_path: Path) -> None:
    """model.config.num_hidden_layers=3 plans 3 layers and builds them (config.json and the
    weights); the handle's description is the built model's, located without describing again."""
    spec = make_spec(tmp_path, "mode=plan", "model.config.num_hidden_layers=3", "model.config.hidden_size=96",
                     "model.config.num_attention_heads=6")
    assert plan(spec, recommend=False)["model"]["layers"] == 3
    d = local_model_dir(spec.model, seed=0)
    config = json.loads((d / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"], config["max_window_layers"]) == \
        (3, 96, 16, 3)
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.2.mlp.up_proj.weight" in names and "model.layers.3.mlp.up_proj.weight" not in names
    from finetune.planner.setup import locate_model

    handle = spec.model_handle
    assert handle is not None and Path(str(handle.config_path)).parent == d
    assert locate_model(handle, spec.model, d).desc is handle.desc  # the same description, not a new one


def test_the_default_tiny_model_keeps_its_cache_key(tmp_path: Path) -> None:
    """The default config.json facts give builder 2's key (its 12 numbers and the seed), so a
    tiny model built before issue 32 is the one reused, byte for byte; other facts give another."""
    spec = make_spec(tmp_path, "mode=plan")
    legacy = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": None,
              "intermediate_size": 128, "vocab_size": 512, "tie_embeddings": True, "attn_bias": True,
              "max_position": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
    want = hashlib.sha256(json.dumps([BUILDER_VERSION, legacy, 0], sort_keys=True).encode()).hexdigest()[:12]
    assert _cache_key(tiny_config(spec.model), 0) == want
    other = make_spec(tmp_path, "mode=plan", "model.config.hidden_act=gelu")
    assert _cache_key(tiny_config(other.model), 0) != want
