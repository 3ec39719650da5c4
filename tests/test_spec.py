"""The run spec (issue 22): the composed config resolved once into a frozen, typed RunSpec, every
check done there, for every mode."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from finetune import config as schema
from finetune.errors import UserError
from finetune.resolver import resolve
from finetune.spec import RunSpec, World
from conftest import make_cfg, make_spec


def test_the_spec_is_frozen(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "mode=plan")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.train.batch_size = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.train = spec.train  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.world.world_size = 2  # type: ignore[misc]
    assert isinstance(spec.method.lora.keys, (tuple, str, type(None)))
    assert spec.optim.betas == (0.9, 0.999)


# spec group -> (schema dataclass, spec field -> schema field where renamed or moved)
GROUPS = {
    "backend": (schema.BackendConfig, {}),
    "model": (schema.ModelConfig, {}),
    "optim": (schema.OptimConfig, {}),
    "precision": (schema.PrecisionConfig, {}),
    "data": (schema.DataConfig, {}),
    "train": (schema.TrainConfig, {}),
    "memory": (schema.MemoryConfig, {}),
    "generate": (schema.GenerateConfig, {}),
}


def _plain(v):
    return tuple(v) if isinstance(v, list) else v


def test_defaults_are_the_schemas(tmp_path: Path) -> None:
    """Built from the schema's own defaults, every field of the spec holds the schema's value:
    the spec states no default of its own."""
    spec = resolve(schema.Config(run_dir=str(tmp_path), mode="plan"))
    want = schema.Config()
    for group, (cls, _) in GROUPS.items():
        got = getattr(spec, group)
        names = {f.name for f in dataclasses.fields(cls)}
        spec_names = {f.name for f in dataclasses.fields(got)} - {"resolved"}
        assert spec_names == names, group  # the same keys as the schema's group
        for name in names:
            assert getattr(got, name) == _plain(getattr(getattr(want, group), name)), f"{group}.{name}"
    lora, m = spec.method.lora, want.method
    assert dataclasses.asdict(lora) == {k: _plain(v) for k, v in dataclasses.asdict(m.lora).items()}
    assert (spec.method.name, spec.method.quant.bits, spec.method.quant.type, spec.method.quant.group_size,
            spec.method.quant.double_quant) == (m.name, m.quant_bits, m.quant_type, m.quant_group_size, m.double_quant)
    assert (spec.sweep.isolate_jobs, spec.sweep.fail_fast, spec.sweep.search_objective) == (
        want.isolate_jobs, want.fail_fast, want.search_objective)
    assert spec.paths.run_dir == tmp_path and spec.loggers == {} and spec.extra == {}
    assert spec.world == World(0, 1, None, None)


def test_composed_values_reach_the_spec(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "mode=plan", "train.batch_size=3", "train.grad_accum=5", "optim.betas=[0.8,0.9]",
                     "method.lora.keys=[q_proj,k_proj]", "backend=cuda", "logger=csv", 'prompt="hi"')
    assert (spec.train.batch_size, spec.train.grad_accum, spec.train.effective_batch) == (3, 5, 15)
    assert spec.optim.betas == (0.8, 0.9) and spec.method.lora.keys == ("q_proj", "k_proj")
    assert spec.backend.name == spec.backend.resolved == "cuda"
    assert list(spec.loggers) == ["csv"] and spec.generate.prompt == "hi"
    assert spec.record["train"]["batch_size"] == 3


@pytest.mark.parametrize("overrides, message", [
    # enumerated choices
    (["train.schedule=steep"], "train.schedule=steep is not valid; choose one of: constant, linear, cosine"),
    # the backend's capabilities
    (["backend=mlx", "optim=adamw_8bit"],
     "optim=adamw_8bit needs backend=cuda (bitsandbytes); mlx supports: "),
    # unknown keys
    (["+train.batch=2"], "train.batch is not a config key; did you mean: train.batch_size"),
    # ranges
    (["train.batch_size=0"], "train.batch_size=0 must be >= 1; set train.batch_size to a value >= 1"),
    (["method.lora.num_layers=0"], "method.lora.num_layers=0 must be >= 1 or -1 (-1 adapts every layer); "
                                   "set method.lora.num_layers to a value >= 1 or -1"),
    # the data source
    (["data=jsonl"], "data=jsonl needs a file: add data.path=/path/to/train.jsonl"),
    # the planner's (memory model's) refusals
    (["backend=cuda", "method=qlora", "method.quant_bits=8"],
     "method=qlora on backend=cuda quantizes to 4 bits as nf4 or fp4; set method.quant_bits=4 method.quant_type=nf4"),
    (["backend=cuda", "backend.strategy=fsdp", "backend.device_map=auto"],
     "backend.strategy=fsdp shards the model over ranks and backend.device_map=auto splits one process over GPUs; "
     "drop backend.device_map=auto (or use backend.strategy=ddp)"),
    (["backend=mlx", "method.lora.keys=[lm_head]"],
     "method.lora.keys: lm_head cannot be adapted on backend=mlx (mlx-lm adapts layers inside the decoder blocks "
     "only); drop lm_head, or use backend=cuda"),
])
@pytest.mark.parametrize("mode", ["plan", "train"])
def test_each_check_says_the_same_line(tmp_path: Path, overrides: list[str], message: str, mode: str) -> None:
    with pytest.raises(UserError) as e:
        make_spec(tmp_path, f"mode={mode}", *overrides)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("overrides, message", [
    (["generate.max_new_tokens=0"], "generate.max_new_tokens=0 must be >= 1"),
    (["train.schedule=steep"], "train.schedule=steep is not valid"),
    (["+generate.tokens=3"], "generate.tokens is not a config key"),
])
def test_generate_mode_is_validated(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        make_spec(tmp_path, "mode=generate", 'prompt="hi"', *overrides)


def test_joined_spec_plans_for_the_world(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "mode=plan", "backend=cuda")
    joined = spec.joined(World(rank=1, world_size=4), run_dir=tmp_path / "shared")
    assert (joined.world.rank, joined.world.world_size, joined.world.num_devices) == (1, 4, 4)
    assert joined.paths.run_dir == tmp_path / "shared" and spec.paths.run_dir == tmp_path  # a new spec
    split = make_spec(tmp_path, "mode=plan", "backend=cuda", "backend.device_map=auto", "backend.num_devices=2")
    assert split.joined(World(rank=0, world_size=4)).world.num_devices == 2
    assert resolve(make_cfg(tmp_path, "mode=plan", "backend.num_devices=3")).world.num_devices == 3
    assert isinstance(spec, RunSpec)
