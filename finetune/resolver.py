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
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from finetune.backends import concrete_name
from finetune.config import Config, validate
from finetune.errors import UserError
from finetune.planner.model import resolve as resolve_setup
from finetune.spec import (BackendSpec, DataSpec, GenerateSpec, LoraSpec, MemorySpec, MethodSpec, ModelSpec,
                           OptimSpec, PathsSpec, PrecisionSpec, QuantSpec, RunSpec, SweepSpec, TrainSpec, World)


def _plain(node: Any) -> Any:
    """A config node as plain Python (interpolations resolved): dicts, and lists as tuples."""
    if isinstance(node, DictConfig) or OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return tuple(_plain(v) for v in node)
    return node


def _fields(node: Any, cls: type, **given: Any) -> Any:
    """``cls`` with each of its fields read from the config node of the same name, except
    those ``given``."""
    values = {f.name: _plain(node[f.name]) for f in dataclasses.fields(cls) if f.name not in given}
    return cls(**values, **given)


def as_dictconfig(cfg: Any) -> DictConfig:
    """A schema ``Config`` dataclass (or a dict) as the DictConfig the CLI would compose."""
    if isinstance(cfg, DictConfig):
        return cfg
    return OmegaConf.merge(OmegaConf.structured(Config), cfg)  # type: ignore[return-value]


def _spec(cfg: DictConfig, world: World) -> RunSpec:
    b, m, g = cfg.backend, cfg.method, cfg.generate
    method = MethodSpec(
        name=str(m.name),
        lora=_fields(m.lora, LoraSpec, keys=_plain(m.lora["keys"])),  # DictConfig.keys is a method: index it
        quant=QuantSpec(bits=int(m.quant_bits), type=str(m.quant_type), group_size=int(m.quant_group_size),
                        double_quant=bool(m.double_quant)))
    n = b.num_devices
    if world.num_devices is not None:
        n = world.num_devices
    elif world.world_size > 1 and b.device_map != "auto":
        n = world.world_size
    return RunSpec(
        mode=str(cfg.mode),
        backend=_fields(b, BackendSpec, resolved=concrete_name(str(b.name))),
        model=_fields(cfg.model, ModelSpec),
        method=method,
        optim=_fields(cfg.optim, OptimSpec),
        precision=_fields(cfg.precision, PrecisionSpec),
        data=_fields(cfg.data, DataSpec),
        train=_fields(cfg.train, TrainSpec),
        memory=_fields(cfg.memory, MemorySpec),
        loggers={str(k): dict(v or {}) for k, v in (_plain(cfg.logger) or {}).items()},
        generate=GenerateSpec(prompt=g.prompt or cfg.prompt, adapter=g.adapter,
                              max_new_tokens=int(g.max_new_tokens), temperature=float(g.temperature)),
        sweep=_fields(cfg, SweepSpec),
        paths=PathsSpec(run_dir=Path(str(cfg.run_dir))),
        world=World(rank=world.rank, world_size=world.world_size, local_devices=world.local_devices,
                    num_devices=int(n) if n else None),
        extra=dict(_plain(cfg.extra) or {}),
        record=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
    )


def _check_model_choices(spec: RunSpec) -> None:
    """The refusals that need the model description and the backend's memory model: the
    planner's own resolution of the setup (``finetune.planner.model.resolve``). Training goes
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
        _check_model_choices(spec)
    return spec
