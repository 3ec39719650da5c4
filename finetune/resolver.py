"""The resolver: the composed config in, a frozen ``RunSpec`` out, every check done once (issue 22).

``resolve(cfg, world)`` is the only reader of the composed config (a DictConfig) besides the CLI
entry. It runs, in this order and for every mode (``mode=generate`` included), the checks that
used to be split over four layers: enumerated choices, the backend's capabilities, unknown keys,
ranges and the data source (``finetune.config.validate``); then, for ``mode=plan`` and
``mode=train``, the refusals that need the model description and the backend's memory model (the
planner's: method, pre-quantized checkpoints, device and ranks, LoRA targets, the family,
attention), raising the same one-line UserErrors as before.

It sits above the planner (it calls the planner's checks); ``finetune.spec`` holds the types
below it, so the planner and the backends read a spec without importing this module.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from finetune.backends import BACKENDS, capabilities, concrete_name
from finetune.budget import parse_budget
from finetune.config import (
    BACKEND_KEYS,
    CONFIG_FACT_RANGES,
    RANGE_HINTS,
    RANGE_OR,
    RANGES,
    VALID,
    Config,
    DataConfig,
    data_group_keys,
    logger_keys,
    nearest_config_keys,
    nearest_keys,
    range_text,
    schema_keys,
)
from finetune.evaluate import check as check_eval
from finetune.errors import UserError
from finetune.model.source import config_overrides, read_model_config
from finetune.planner.setup import describe_model, resolve as resolve_setup
from finetune.spec import RunSpec, World

# -- the config's checks: choices, the backend's capabilities, ranges, unknown keys ------------

def _value(cfg: DictConfig, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def check_backend_support(backend: str, cfg: DictConfig) -> None:
    """Raise UserError if ``backend`` cannot run a choice in ``cfg``, naming what it can run
    (and, where another backend runs it, why this one does not)."""
    caps = capabilities(backend)
    for dotted in BACKEND_KEYS:
        value = _value(cfg, dotted)
        allowed = caps.choices(dotted)
        if value in allowed:
            continue
        group = dotted.removesuffix(".name")
        elsewhere = [b for b in BACKENDS if b != backend and value in capabilities(b).choices(dotted)]
        if elsewhere and dotted in caps.why_not:
            raise UserError(f"{group}={value} {caps.why_not[dotted]}; {backend} supports: {', '.join(allowed)}")
        if elsewhere:
            raise UserError(f"{group}={value} is not run by backend={backend} (backend={elsewhere[0]} runs it); "
                            f"{backend} supports: {', '.join(allowed)}")
        raise UserError(f"{dotted}={value} is not valid; choose one of: {', '.join(allowed)}")


def validate(cfg: DictConfig) -> None:
    """Check enumerated choices (the backend's against its capabilities) and ranges; raise
    UserError naming the fix."""
    backend = concrete_name(str(cfg.backend.name))  # an unregistered name: one line naming the registered ones
    for dotted, choices in VALID.items():
        node = _value(cfg, dotted)
        if node not in choices:
            raise UserError(f"{dotted}={node} is not valid; choose one of: {', '.join(choices)}")
    check_backend_support(backend, cfg)
    check_known_keys(cfg)
    check_ranges(cfg)
    check_data_keys(cfg)
    if cfg.data.name == "jsonl" and not cfg.data.path:
        raise UserError("data=jsonl needs a file: add data.path=/path/to/train.jsonl")
    if cfg.data.name == "hf" and not cfg.data.hf_name:
        raise UserError("data=hf needs a data set: add data.hf_name=<hub id>")


# what to say beside the group to choose, for a key another data group reads
_DATA_KEY_HINTS = {"num_samples": "data.max_samples caps the records of a file or a hub data set",
                   "max_samples": "data.num_samples sets how many samples data=synthetic makes"}


def check_data_keys(cfg: DictConfig) -> None:
    """Raise UserError for a ``data.*`` key set (away from its default) that the chosen data
    group does not read, naming the group that does: ``data=synthetic data.path=x`` would
    otherwise train on the built-in samples and say nothing. What each group reads is its YAML
    under conf/data/."""
    name = str(cfg.data.name)
    reads = {g: data_group_keys(g) for g in VALID["data.name"]}
    mine = reads.get(name)
    if mine is None:
        return
    defaults = DataConfig()
    for key in schema_keys(DataConfig):
        value = cfg.data[key]
        if key in mine or value == getattr(defaults, key):
            continue
        readers = [f"data={g}" for g, keys in reads.items() if keys and key in keys]
        hint = f" ({_DATA_KEY_HINTS[key]})" if key in _DATA_KEY_HINTS else ""
        raise UserError(f"data.{key}={value} is not read by data={name}, which would ignore it; choose "
                        f"{' or '.join(readers)}, or drop data.{key}{hint}")


def check_ranges(cfg: DictConfig) -> None:
    """Raise UserError for the first numeric key outside its range (``RANGES``; model.config's
    facts, ``CONFIG_FACT_RANGES``), or a string or bool where a number belongs, naming the range."""
    def fail(dotted: str, value: Any, rng: str) -> None:
        hint = RANGE_HINTS.get(dotted)
        fix = "set optim.betas=[0.9,0.999]" if dotted.startswith("optim.betas.") else f"set {dotted} to a value {rng}"
        raise UserError(f"{dotted}={value} must be {rng}{f' ({hint})' if hint else ''}; {fix}")

    betas = list(cfg.optim.betas)
    if len(betas) != 2:
        raise UserError(f"optim.betas={betas} needs two values; set optim.betas=[0.9,0.999]")
    # model.config's facts where the config has them (a preset's, tiny's, a user's override)
    facts = cfg.model.config if isinstance(cfg.model.config, DictConfig) else {}
    for dotted, (lo, hi, lo_in, hi_in, nullable) in [*RANGES.items(), *CONFIG_FACT_RANGES.items()]:
        value: Any
        if dotted.startswith("model.config."):
            value, nullable = facts.get(dotted.rpartition(".")[2]), True
        else:
            value = _value(cfg, dotted) if not dotted.startswith("optim.betas.") else betas[int(dotted[-1])]
        if value is None and nullable:
            continue
        rng = str(range_text(dotted))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            fail(dotted, value, f"a number {rng}")
        if (value < lo if lo_in else value <= lo) or (value > hi if hi_in else value >= hi):
            fail(dotted, value, rng)
    for dotted, ((lo, hi, lo_in, hi_in), also) in RANGE_OR.items():  # method.lora.num_layers: >= 1 or -1
        value = _value(cfg, dotted)
        outside = not isinstance(value, (int, float)) or not (
            (value >= lo if lo_in else value > lo) and (value <= hi if hi_in else value < hi))
        if isinstance(value, bool) or (outside and value != also):
            fail(dotted, value, str(range_text(dotted)))
    budget = cfg.memory.budget
    if budget is not None:
        parse_budget(budget, 2**40)  # the size only checks a percentage's range here


def check_known_keys(cfg: DictConfig) -> None:
    """Raise UserError for a key the schema does not have (added with ``+key=...``), anywhere in
    the tree, naming the nearest valid keys. A logger's keys are those of its option's YAML."""
    import dataclasses

    def walk(node: Any, node_type: Any, prefix: str) -> None:
        valid = schema_keys(node_type)
        for key in list(node.keys()):
            if key not in valid:
                raise UserError(f"{prefix}{key} is not a config key; {nearest_config_keys(f'{prefix}{key}')}")
            t = valid[key]
            if dataclasses.is_dataclass(t) and node.get(key) is not None:
                walk(node[key], t, f"{prefix}{key}.")

    walk(cfg, Config, "")
    for name, settings in (cfg.get("logger") or {}).items():
        known = logger_keys(str(name))
        if known is None or settings is None:
            continue  # an unknown logger is named by finetune.loggers.build
        for key in settings.keys():
            if key not in known:
                raise UserError(f"logger.{name}.{key} is not a config key; {nearest_keys(str(key), sorted(known))}")



# -- the spec -------------------------------------------------------------------------------

def _plain(node: Any) -> Any:
    """A config node as plain Python (interpolations resolved): dicts, and lists as tuples."""
    if isinstance(node, DictConfig) or OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return tuple(_plain(v) for v in node)
    return node


def _build(node: Any, cls: Any) -> Any:
    """Spec node ``cls`` with each key read from config ``node`` where the schema puts it (a flat
    group's keys in ``node`` itself, a key under its config ``name``); its derived fields keep
    their defaults, for the resolver to set."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        t, md = _hints(cls)[f.name], f.metadata
        if md.get("derived"):
            continue
        if dataclasses.is_dataclass(t):
            values[f.name] = _build(node if md.get("flat") else node[f.name], t)
        else:  # indexed: a DictConfig's .keys is a method (method.lora.keys)
            value = _plain(node[md.get("name", f.name)])
            values[f.name] = Path(str(value)) if t is Path else value
    return cls(**values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def as_dictconfig(cfg: Any) -> DictConfig:
    """A schema ``Config`` dataclass (or a dict) as the DictConfig the CLI would compose."""
    if isinstance(cfg, DictConfig):
        return cfg
    return OmegaConf.merge(OmegaConf.structured(Config), cfg)  # type: ignore[return-value]


def _spec(cfg: DictConfig, world: World) -> RunSpec:
    """The spec of ``cfg`` (every key where the schema, finetune/spec.py, puts it), with what the
    resolver derives: the concrete backend, the prompt's short form, the loggers' settings, the
    world and the record."""
    spec = _build(cfg, RunSpec)
    b = spec.backend
    n = b.num_devices
    if world.num_devices is not None:
        n = world.num_devices
    elif world.world_size > 1 and b.device_map != "auto":
        n = world.world_size
    return dataclasses.replace(
        spec,
        backend=dataclasses.replace(b, resolved=concrete_name(str(b.name))),
        generate=dataclasses.replace(spec.generate, prompt=spec.generate.prompt or spec.prompt),
        loggers={str(k): dict(v or {}) for k, v in (spec.loggers or {}).items()},
        extra=dict(spec.extra or {}),
        world=World(rank=world.rank, world_size=world.world_size, local_devices=world.local_devices,
                    num_devices=int(n) if n else None),
        record=OmegaConf.to_container(cfg, resolve=True),
    )


def _with_model_handle(spec: RunSpec) -> RunSpec:
    """The spec with its model described, once for the run (``RunSpec.model_handle``): the
    planner, the governor, both runtimes, the checkpointer and calibration read that handle.
    Training goes ahead on a model the planner cannot read (its governor then acts on
    measurements only); a what-if of facts set over a hub checkpoint's config.json is for a plan
    only (a run would train the checkpoint as it is)."""
    try:
        handle = describe_model(spec.model)
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - said again, with the reason, by the governor before loading
        if spec.mode != "train":
            raise
        return spec
    if spec.mode == "train" and handle.overridden:
        raise _not_for_a_run(spec, handle.overridden)
    return dataclasses.replace(spec, model_handle=handle)


def _not_for_a_run(spec: RunSpec, overridden: tuple[str, ...]) -> UserError:
    return UserError(f"model.config.{overridden[0]} is set over the config.json of {spec.model.path}, which mode={spec.mode} "
                     "loads as it is (the override would be ignored); drop it, or plan the what-if with mode=plan")


def _check_model_choices(spec: RunSpec) -> None:
    """The refusals that need the model description and the backend's memory model: the
    planner's own resolution of the setup (``finetune.planner.setup.resolve``). Training goes
    ahead on a model the planner cannot read (its governor then acts on measurements only)."""
    try:
        resolve_setup(spec)
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - said again, with the reason, by the governor before loading
        if spec.mode != "train":
            raise


def resolve(cfg: Any, world: World | None = None) -> RunSpec:
    """The frozen, typed spec of a composed config, every check done.

    Args:
        cfg: the composed config (``finetune.config.compose``, the CLI's DictConfig), or a
            schema ``Config`` dataclass.
        world: the processes of the run (rank, size); one process when None. Under a launcher
            the loop derives the joined spec with ``RunSpec.joined``.

    Raises:
        UserError: one line naming the fix, for the first check that fails.
    """
    cfg = as_dictconfig(cfg)
    validate(cfg)
    spec = _spec(cfg, world or World())
    if spec.mode in ("plan", "train"):
        spec = _with_model_handle(spec)
        _check_model_choices(spec)
    elif spec.model.path is not None and config_overrides(spec.model):
        # mode=generate loads the checkpoint as it is: facts set against it are refused, not ignored
        overridden = read_model_config(spec.model).overridden  # a checkpoint on disk refuses them itself
        if overridden:
            raise _not_for_a_run(spec, overridden)
    if spec.mode == "generate" and not spec.generate.prompt:
        raise UserError('mode=generate needs a prompt: add prompt="..." (or generate.prompt="...")')
    check_eval(spec)  # mode=eval, and a train run's eval.tasks: refused before anything loads
    return spec
