"""model_source.model_config: a hub id's config.json from the hub cache (no network), a preset's
released facts when the hub is out of reach, and one line naming the fixes otherwise; never the
tiny preset's numbers for another model. The released configs under tests/data/released/ are
checked against a meta-device build of each."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from conftest import finetune_cmd, make_cfg, needs_torch
import warm_cli

from finetune.errors import UserError
from finetune.model.source import local_config, model_config, stored_dtype

RELEASED = Path(__file__).resolve().parent / "data" / "released"
SHA = "b968826d9c46dd6066d109eabc6255188de91218"  # a commit sha as the hub writes it (40 hex digits)

# parameters of each released config built on the meta device (transformers 5.x AutoModelForCausalLM)
META_PARAMS = {
    "Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen3-30B-A3B": 30_532_122_624,
    "gpt-oss-20b": 20_914_757_184,
    "StarCoder2-15B": 15_957_889_024,
    "Gemma-2-9B": 9_241_705_984,
    "Llama-3.1-8B": 8_030_261_248,
    "Qwen3-8B": 8_190_735_360,
}
# presets whose config: is a released file here
PRESET_RELEASED = {"qwen3-8b": "Qwen3-8B", "qwen3-30b-a3b": "Qwen3-30B-A3B", "gpt-oss-20b": "gpt-oss-20b",
                   "llama3.1-8b": "Llama-3.1-8B", "mixtral-8x7b": "Mixtral-8x7B-v0.1"}


def released(slug: str) -> dict:
    return json.loads((RELEASED / slug / "config.json").read_text())


def lay_out_hub_cache(cache: Path, repo_id: str, config_text: str, sha: str = SHA) -> Path:
    """``repo_id``'s config.json in ``cache`` as huggingface_hub lays it out: the file under
    blobs/<its hash>, snapshots/<sha>/config.json linking to it, refs/main holding the sha."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    blob = repo / "blobs" / hashlib.sha256(config_text.encode()).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_text(config_text)
    snap = repo / "snapshots" / sha / "config.json"
    snap.parent.mkdir(parents=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)  # no newline, as the hub writes it
    return snap


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache in HF_HUB_CACHE and HF_HUB_OFFLINE=1. huggingface_hub reads both into
    ``constants`` at import, so the already-imported module is patched too."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_TOKEN", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_a_hub_id_is_read_from_the_hub_cache(tmp_path: Path, offline_hub: Path) -> None:
    text = (RELEASED / "Qwen3-8B" / "config.json").read_text()
    snap = lay_out_hub_cache(offline_hub, "Qwen/Qwen3-8B", text)
    label = f"Qwen/Qwen3-8B config.json in the hub cache ({offline_hub})"
    for over in ((), (f"model.revision={SHA}",)):
        cfg = make_cfg(tmp_path / "r", "model.path=Qwen/Qwen3-8B", *over).model
        assert model_config(cfg) == (released("Qwen3-8B"), label)
        # the stored dtype comes from the cached file too, not from the tiny preset's float32
        assert local_config(cfg) == (released("Qwen3-8B"), str(snap))
        assert stored_dtype(cfg) == ("bfloat16", f"{snap} torch_dtype")
    # a revision the cache does not hold is not answered from main's snapshot
    other = make_cfg(tmp_path / "r", "model.path=Qwen/Qwen3-8B", "model.revision=v2").model
    with pytest.raises(UserError, match=r"--revision v2\), point model.path"):
        model_config(other)


def test_offline_with_an_empty_cache_is_one_line_naming_the_fixes(tmp_path: Path, offline_hub: Path) -> None:
    cfg = make_cfg(tmp_path / "r", "model.path=Qwen/Qwen3-8B").model
    want = (f"model.path=Qwen/Qwen3-8B: no config.json in the hub cache ({offline_hub}) and the hub is unreachable "
            "(offline: HF_HUB_OFFLINE=1); download it (hf download Qwen/Qwen3-8B; a plan needs only hf download "
            "Qwen/Qwen3-8B config.json), point model.path at a local directory, or use its preset (model=qwen3-8b)")
    with pytest.raises(UserError) as e:
        model_config(cfg)
    assert str(e.value) == want
    with pytest.raises(UserError) as e:  # nor does the stored dtype fall back to tiny's float32
        stored_dtype(cfg)
    assert str(e.value) == want
    # a preset's facts never stand in for another repository
    cfg = make_cfg(tmp_path / "r", "model=qwen3-8b", "model.path=Qwen/Qwen3-30B-A3B").model
    with pytest.raises(UserError, match=r"use its preset \(model=qwen3-30b-a3b\)$"):
        model_config(cfg)
    cfg = make_cfg(tmp_path / "r", "model.path=someone/unknown-7b").model
    with pytest.raises(UserError, match=r"or use a preset \(model=<name>, see conf/model/\)$"):
        model_config(cfg)


def test_cli_plan_of_an_uncached_hub_id_offline_exits_2_in_one_line(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    cache.mkdir()
    r = warm_cli.run([*finetune_cmd(), "mode=plan", "model.path=Qwen/Qwen3-8B", f"hydra.run.dir={tmp_path}/r"],
                       check=False, capture_output=True, text=True, timeout=120, env=_env(cache))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    want = (f"error: model.path=Qwen/Qwen3-8B: no config.json in the hub cache ({cache}) and the hub is "
            "unreachable (offline: HF_HUB_OFFLINE=1); download it (hf download Qwen/Qwen3-8B; a plan needs only hf "
            "download Qwen/Qwen3-8B config.json), point model.path at a local directory, or use its preset (model=qwen3-8b)")
    assert lines == [want], r.stderr
    assert "Traceback" not in r.stderr and "tiny" not in r.stdout + r.stderr


def test_cli_plan_of_a_cached_hub_id_plans_that_model(tmp_path: Path) -> None:
    """The env applies at import here: the CLI finds Qwen3-8B in HF_HUB_CACHE with no network and
    plans its 8.19 B parameters (within the planner's 0.5% of the meta-device count)."""
    cache = tmp_path / "hub"
    snap = lay_out_hub_cache(cache, "Qwen/Qwen3-8B", (RELEASED / "Qwen3-8B" / "config.json").read_text())
    r = warm_cli.run([*finetune_cmd(), "mode=plan", "model.path=Qwen/Qwen3-8B", f"hydra.run.dir={tmp_path}/r"],
                       check=False, capture_output=True, text=True, timeout=120, env=_env(cache))
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "r" / "plan.json").read_text())
    assert f"{snap} torch_dtype" in plan["dtypes"]["stored"]
    assert abs(plan["params_total"] - META_PARAMS["Qwen3-8B"]) <= 0.005 * META_PARAMS["Qwen3-8B"], plan["params_total"]
    assert plan["model"]["name"] == "Qwen/Qwen3-8B" and plan["model"]["model_type"] == "qwen3"
    assert (r.stdout + r.stderr).lstrip().startswith("plan: Qwen/Qwen3-8B "), (r.stdout + r.stderr)[:200]


def test_cli_run_of_a_hub_id_with_only_its_config_cached_asks_for_the_whole_snapshot(tmp_path: Path) -> None:
    """A plan reads a hub id's config.json alone from the cache; a run needs the weights and the
    tokenizer too: offline, one line naming `hf download <id> --revision REV`, exit 2, no
    traceback, and no run dir left behind."""
    cache = tmp_path / "hub"
    snap = lay_out_hub_cache(cache, "Qwen/Qwen3-8B", (RELEASED / "Qwen3-8B" / "config.json").read_text())
    r = warm_cli.run([*finetune_cmd(), "backend=cuda", "model.path=Qwen/Qwen3-8B", f"model.revision={SHA}",
                        "train.steps=1", f"hydra.run.dir={tmp_path}/r"],
                       check=False, capture_output=True, text=True, timeout=120, env=_env(cache))
    assert r.returncode == 2, r.stderr
    want = (f"error: model.path=Qwen/Qwen3-8B: the hub cache holds only part of its snapshot ({snap.parent}: no "
            "weights (*.safetensors) and no tokenizer files) and the hub is unreachable (offline: HF_HUB_OFFLINE=1); "
            f"a run needs the whole snapshot: download it (hf download Qwen/Qwen3-8B --revision {SHA})")
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [want], r.stderr
    assert r.stderr.rstrip().endswith(want) and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("preset, slug", sorted(PRESET_RELEASED.items()))
def test_a_preset_plans_from_its_released_facts_offline(tmp_path: Path, offline_hub: Path, preset: str,
                                                        slug: str) -> None:
    cfg = make_cfg(tmp_path / "r", f"model={preset}").model
    hf, label = model_config(cfg)
    assert hf == released(slug)
    assert label == (f"model.config of preset {preset} (released config.json facts; {cfg.path}: "
                     "the hub is unreachable (offline: HF_HUB_OFFLINE=1))")
    assert stored_dtype(cfg)[1] == f"model.dtype of preset {preset}"  # no network for a preset's own dtype


def test_a_preset_without_a_path_and_tiny(tmp_path: Path) -> None:
    from finetune.model.tiny import tiny_config

    tiny = make_cfg(tmp_path / "r").model
    assert model_config(tiny) == (tiny_config(tiny), "preset tiny (the config.json build_tiny writes)")
    assert model_config(tiny)[0]["hidden_size"] == 64
    mixtral = make_cfg(tmp_path / "r", "model=mixtral-8x7b", "model.path=null").model
    assert model_config(mixtral) == (released("Mixtral-8x7B-v0.1"), "model.config of preset mixtral-8x7b")
    bare = make_cfg(tmp_path / "r", "model=qwen3-8b", "model.path=null", "model.config=null").model
    with pytest.raises(UserError, match=r"^model=qwen3-8b has no model.path and no model.config; set model.path="):
        model_config(bare)


def test_a_local_directory_and_a_loaded_model_dir(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    cfg = make_cfg(tmp_path / "r", f"model.path={d}").model
    with pytest.raises(UserError, match=rf"^model.path={d} has no config.json; point it at an HF-format model"):
        model_config(cfg)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert model_config(cfg) == ({"model_type": "llama", "hidden_size": 8}, str(d / "config.json"))
    other = tmp_path / "loaded"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert model_config(cfg, model_dir=other) == ({"model_type": "qwen3"}, str(other / "config.json"))
    missing = make_cfg(tmp_path / "r", f"model.path={tmp_path / 'nowhere'}").model
    with pytest.raises(UserError, match="does not exist; give an existing directory or a hub id"):
        model_config(missing)


@needs_torch
@pytest.mark.parametrize("slug", sorted(META_PARAMS))
def test_released_configs_build_on_the_meta_device(slug: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(RELEASED / slug)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == META_PARAMS[slug]
