"""The config Hydra composes, and the checks' tables, made from the schema (finetune/spec.py).

The schema is one tree, ``finetune.spec``: each key a field with its default, meaning, range and
choices. Here it becomes what Hydra needs (the values live in YAML under ``conf/``): ``Config``,
the tree's mutable twin, registered in Hydra's ConfigStore as ``config_schema`` and listed first
in ``conf/config.yaml``'s defaults, so a misspelt key or a wrongly typed value fails at compose
time; and the tables the resolver and ``finetune --help`` read (``VALID``, ``BACKEND_KEYS``,
``RANGES``), derived from the fields' metadata. Nothing here imports torch or mlx.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.spec import (  # noqa: F401  (MODES re-exported: the CLI's help and completion read it here)
    CAPABILITIES,
    INF,
    MODES,
    BackendSpec,
    DataSpec,
    GenerateSpec,
    LoraSpec,
    MemorySpec,
    MethodSpec,
    ModelSpec,
    ObjectiveSpec,
    OptimSpec,
    PrecisionSpec,
    RunSpec,
    TrainSpec,
)

GROUPS = ("backend", "model", "method", "optim", "precision", "data", "objective", "train", "memory", "logger", "search")


def _config_type(t: Any) -> Any:
    """The type OmegaConf checks a key against, for a spec field of type ``t``: a tuple is a
    list, a path a string, a dict's values and a union other than ``X | None`` anything (a
    preset's model.config, method.lora.keys: checked by the resolver and the planner)."""
    if t is Path:
        return str
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return t if len(rest) == 1 and rest[0] in (str, int, float, bool) else Any
    if origin is tuple:
        return list[args[0]]  # type: ignore[valid-type]
    if origin is dict:
        return dict[str, Any]
    return t


def _config_fields(node: type) -> list[tuple[str, Any, Any]]:
    """(name, type, field) of each key of spec node ``node`` as the config holds it: a flat
    group's keys in its place, a derived field left out, a group as its twin."""
    out: list[tuple[str, Any, Any]] = []
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        t, md = hints[f.name], f.metadata
        if md.get("derived"):
            continue
        if dataclasses.is_dataclass(t) and md.get("flat"):
            out += _config_fields(t)  # type: ignore[arg-type]
        elif dataclasses.is_dataclass(t):
            twin = _twin(t)  # type: ignore[arg-type]
            out.append((f.name, twin, dataclasses.field(default_factory=twin, metadata=md)))
        else:
            if f.default_factory is not dataclasses.MISSING:
                made = dataclasses.field(default_factory=f.default_factory, metadata=md)
            elif isinstance(f.default, tuple):  # a list in the config: a fresh one per instance
                made = dataclasses.field(default_factory=functools.partial(list, f.default), metadata=md)
            else:
                made = dataclasses.field(default=f.default, metadata=md)
            out.append((md.get("name", f.name), _config_type(t), made))
    return out


@functools.cache
def _twin(node: type) -> Any:
    """The mutable twin of spec node ``node`` (``TrainSpec`` -> ``TrainConfig``, ``RunSpec`` ->
    ``Config``): the same keys, defaults, meanings and checks, for Hydra to merge the YAML and the
    overrides into."""
    name = "Config" if node is RunSpec else node.__name__.removesuffix("Spec") + "Config"
    twin = dataclasses.make_dataclass(name, _config_fields(node))
    twin.__doc__, twin.__module__ = node.__doc__, __name__  # pickled by name (a sweep's launchers)
    return twin


# The schema Hydra composes into, registered in its ConfigStore as ``config_schema`` (listed first
# in conf/config.yaml's defaults), made from finetune/spec.py's tree: a misspelt key or a wrongly
# typed value fails at compose time. Tests build one directly (Config(run_dir=...)) and set its keys.
Config = _twin(RunSpec)
BackendConfig = _twin(BackendSpec)
ModelConfig = _twin(ModelSpec)
MethodConfig = _twin(MethodSpec)
LoraConfig = _twin(LoraSpec)
OptimConfig = _twin(OptimSpec)
PrecisionConfig = _twin(PrecisionSpec)
DataConfig = _twin(DataSpec)
ObjectiveConfig = _twin(ObjectiveSpec)
TrainConfig = _twin(TrainSpec)
MemoryConfig = _twin(MemorySpec)
GenerateConfig = _twin(GenerateSpec)


def _leaves(node: type, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted config path, spec type, field) of every key of spec node ``node``, in order."""
    out: list[tuple[str, Any, Any]] = []
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        t, md = hints[f.name], f.metadata
        if md.get("derived"):
            continue
        if dataclasses.is_dataclass(t):
            out += _leaves(t, prefix if md.get("flat") else f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            out.append((prefix + md.get("name", f.name), t, f))
    return out


def _interval_text(lo: float, hi: float, lo_in: bool, hi_in: bool) -> str:
    def num(x: float) -> str:  # 2**32 - 1 in full, not 4.29497e+09
        return str(int(x)) if float(x).is_integer() else f"{x:g}"

    if hi == INF:
        return f">= {num(lo)}" if lo_in else f"> {num(lo)}"
    return f"in {'[' if lo_in else '('}{num(lo)}, {num(hi)}{']' if hi_in else ')'}"


_KEYS = _leaves(RunSpec)
# The tables the resolver checks against, read from the fields' metadata (finetune/spec.py).
# key -> its choices (backend.name is checked against the registry, finetune.backends.BACKENDS)
VALID = {p: f.metadata["choices"] for p, _, f in _KEYS if isinstance(f.metadata.get("choices"), tuple)}
# Checked against the chosen backend's capabilities (finetune/backends/<name>/capabilities.py),
# never against a list restated here; a group's choice is named before a setting's.
BACKEND_KEYS = tuple(sorted((p for p, _, f in _KEYS if f.metadata.get("choices") == CAPABILITIES),
                            key=lambda p: not p.endswith(".name")))
# Every numeric key of the schema and its range: (low, high, low inclusive, high inclusive,
# None allowed); a tuple's values as key.0, key.1. tests/test_bad_input.py sweeps this table with
# a value outside each range.
RANGES: dict[str, tuple[float, float, bool, bool, bool]] = {}
# keys whose valid values are no one interval: key -> (its range, one value beside it that is
# valid too), checked by the resolver's check_ranges, and how a user reads that
RANGE_OR: dict[str, tuple[tuple[float, float, bool, bool], Any]] = {}
RANGE_TEXT: dict[str, str] = {}
# why a bound is there, where it is not plain arithmetic
RANGE_HINTS = {p: f.metadata["hint"] for p, _, f in _KEYS if "hint" in f.metadata}
for _path, _type, _field in _KEYS:
    if "range" not in _field.metadata:
        continue
    _rng = (*_field.metadata["range"], type(None) in typing.get_args(_type))
    if "also" in _field.metadata:
        RANGE_OR[_path] = (_field.metadata["range"], _field.metadata["also"])
        RANGE_TEXT[_path] = f"{_interval_text(*_field.metadata['range'])} or {_field.metadata['also']}"
    elif typing.get_origin(_type) is tuple:
        RANGES.update({f"{_path}.{i}": _rng for i, _ in enumerate(typing.get_args(_type))})
    else:
        RANGES[_path] = _rng


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="config_schema", node=Config)


def compose(run_dir: Any, *overrides: str) -> Any:
    """The config `finetune OVERRIDES...` would run, composed outside the CLI (tests, scripts
    that drive finetune.cli.run in-process), with its run dir set to ``run_dir``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_configs()
    GlobalHydra.instance().clear()
    chosen, _ = choose_data_group(list(overrides))  # as the CLI chooses it (finetune.cli.main)
    with initialize_config_module(config_module="finetune.conf", version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="config", overrides=chosen)
        except Exception as e:  # the one line the CLI prints for the same overrides
            line = config_error_line(e)
            if line is None:
                raise
            GlobalHydra.instance().clear()
            raise UserError(line) from e
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = str(run_dir)
    OmegaConf.set_struct(cfg, True)
    GlobalHydra.instance().clear()
    return cfg


# config.json facts of model.config checked where the config has them (a preset's, tiny's, a
# user's override): what the 14 architecture keys beside config: had (issue 32), in HF's names
CONFIG_FACT_RANGES: dict[str, tuple[float, float, bool, bool, bool]] = {
    "model.config.hidden_size": (1, INF, True, False, False),
    "model.config.num_hidden_layers": (1, INF, True, False, False),
    "model.config.num_attention_heads": (1, INF, True, False, False),
    "model.config.num_key_value_heads": (1, INF, True, False, False),
    "model.config.head_dim": (1, INF, True, False, True),
    "model.config.intermediate_size": (1, INF, True, False, False),
    "model.config.vocab_size": (1, INF, True, False, False),
    "model.config.max_position_embeddings": (1, INF, True, False, False),
    "model.config.rope_theta": (0, INF, False, False, False),
    "model.config.rms_norm_eps": (0, 1, False, False, False),
}
# The keys a preset stated beside config: until issue 32, and where the fact is now: a user
# typing the old key is told the new one
MOVED_KEYS = {f"model.{old}": f"model.config.{new}" for old, new in (
    ("model_type", "model_type"), ("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
    ("intermediate_size", "intermediate_size"), ("vocab_size", "vocab_size"),
    ("tie_embeddings", "tie_word_embeddings"), ("attn_bias", "attention_bias"), ("mlp_bias", "mlp_bias"),
    ("max_position", "max_position_embeddings"), ("rope_theta", "rope_theta"), ("rms_norm_eps", "rms_norm_eps"))}
# the sweep's top-level key of old: `objective` now names the training objective's group (sft, dpo, ...)
MOVED_KEYS["objective"] = "search_objective"

def range_text(dotted: str) -> str | None:
    """The valid values of numeric key ``dotted`` as a user reads them (">= 1", "in [0, 1)"),
    from RANGES (or RANGE_TEXT); None for a key without a range."""
    if dotted in RANGE_TEXT:
        return RANGE_TEXT[dotted]
    if dotted not in RANGES and dotted not in CONFIG_FACT_RANGES:
        return None
    if dotted in RANGES:
        return _interval_text(*RANGES[dotted][:4])
    return _interval_text(*CONFIG_FACT_RANGES[dotted][:4])


# Free-form nodes: their keys are the user's (extra) or each logger option's own YAML.
_OPEN = ("extra",)


def schema_keys(node_type: Any) -> dict[str, Any]:
    import dataclasses
    import typing

    hints = typing.get_type_hints(node_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(node_type)}


def nearest_keys(key: str, valid: list[str]) -> str:
    import difflib

    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    shown = near or valid[:8]
    return f"{'did you mean' if near else 'valid keys'}: {', '.join(shown)}"


def schema_paths(node_type: Any = None, prefix: str = "") -> list[str]:
    """Every key of the schema as its full dotted path (``optim.lr``, ``method.lora.rank``),
    the nodes that hold others included."""
    import dataclasses

    out = []
    for name, t in schema_keys(node_type or Config).items():
        out.append(prefix + name)
        if dataclasses.is_dataclass(t):
            out += schema_paths(t, f"{prefix}{name}.")
    return out


def nearest_config_keys(full: str) -> str:
    """The schema's keys nearest an unknown ``full`` key, as full paths a user can type: the
    last part of the key against the last part of every path in the schema, so ``lr`` finds
    ``optim.lr`` and ``train.stepz`` finds ``train.steps`` (a path under the same parent ranks
    first among equals); else the keys of the nearest node that exists."""
    import difflib

    if full in MOVED_KEYS:  # a preset's architecture key of old: now its config.json fact
        return f"did you mean: {MOVED_KEYS[full]}"
    parent, _, last = full.rpartition(".")
    paths = schema_paths()
    near = [p for p in paths if p.rpartition(".")[2] == last]  # the right name under another parent
    if not near:
        scored = sorted(((difflib.SequenceMatcher(None, last, p.rpartition(".")[2]).ratio()
                          + (0.1 if p.rpartition(".")[0] == parent else 0.0), p) for p in paths), key=lambda x: -x[0])
        best = scored[0][0] if scored else 0.0
        near = [p for score, p in scored if score >= 0.65 and score >= best - 0.08][:3]
    if near:
        return f"did you mean: {', '.join(near)}"
    siblings = [p for p in paths if p.rpartition(".")[0] == parent] or [p for p in paths if "." not in p]
    return f"valid keys: {', '.join(siblings[:8])}"


def group_options(group: str) -> list[str]:
    """Options of a config group, from the YAML files installed with the package."""
    from importlib import resources

    root = resources.files("finetune.conf") / group
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def data_group_keys(name: str) -> set[str] | None:
    """The ``data.*`` keys data group ``name`` reads: those its YAML under conf/data/ sets
    (None: no such option)."""
    from importlib import resources

    import yaml

    path = resources.files("finetune.conf") / "data" / f"{name}.yaml"
    if not path.is_file():
        return None
    return set((yaml.safe_load(path.read_text()) or {}).keys())


# A hub data set id: owner/name (hf.co/datasets/<owner>/<name>), as `datasets.load_dataset` takes it
_HUB_DATASET_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def data_group_of_path(value: str) -> str:
    """The data group a ``data.path`` value names: ``hf`` for what can only be a hub data set
    id (owner/name, no such local file, no .json/.jsonl suffix) where the hf group exists, else
    ``jsonl`` (a file, or a path whose absence data=jsonl reports)."""
    path = Path(value).expanduser()
    try:
        exists = path.exists()
    except OSError:  # a name too long for the file system: not a file here
        exists = False
    if exists or {".json", ".jsonl"} & set(path.suffixes) or not _HUB_DATASET_ID.match(value):
        return "jsonl"
    return "hf" if data_group_keys("hf") is not None else "jsonl"


def choose_data_group(overrides: list[str]) -> tuple[list[str], str | None]:
    """The overrides with the data group that reads ``data.path`` added where none was chosen,
    and the line that says so (None: nothing added).

    ``finetune data.path=train.jsonl`` trains on that file (``data=jsonl``); a hub data set id
    (``data.path=openai/gsm8k``) becomes ``data=hf data.hf_name=openai/gsm8k``, and
    ``data.hf_name=...`` alone ``data=hf``. An explicit ``data=`` is left as it is: a key it
    does not read is refused by the resolver (``check_data_keys``), naming the group to
    choose. A sweep of paths gets a group only where every value names the same one."""
    given: dict[str, tuple[int, str]] = {}
    for i, arg in enumerate(overrides):
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "data":
            return overrides, None
        given.setdefault(key, (i, value))
    if "data.path" in given:
        i, value = given["data.path"]
        values = [v.strip().strip("'\"") for v in value.split(",")]
        if "(" in value or any(v in ("", "null") for v in values):  # a sweep function, or no path
            return overrides, None
        groups = {data_group_of_path(v) for v in values}
        if len(groups) != 1:
            return overrides, None
        # the group goes right after the key (Hydra's own options, --cfg job, may follow the overrides)
        if groups == {"hf"}:
            hub = overrides[i].replace("data.path=", "data.hf_name=", 1)
            return [*overrides[:i], hub, "data=hf", *overrides[i + 1:]], (
                f"data.path={value} is a hub data set id, not a local file: training on data=hf "
                f"data.hf_name={value} (type those to say so)")
        return [*overrides[:i + 1], "data=jsonl", *overrides[i + 1:]], (
            f"data.path={value}: training on that file's records, data=jsonl (type data=jsonl to say so)")
    if "data.hf_name" in given and given["data.hf_name"][1] not in ("", "null"):
        i, value = given["data.hf_name"]
        return [*overrides[:i + 1], "data=hf", *overrides[i + 1:]], (
            f"data.hf_name={value}: training on that hub data set, data=hf (type data=hf to say so)")
    return overrides, None


def logger_keys(name: str) -> set[str] | None:
    from importlib import resources

    import yaml

    path = resources.files("finetune.conf") / "logger" / f"{name}.yaml"
    if not path.is_file():
        return None
    doc = yaml.safe_load(path.read_text()) or {}
    return set((doc.get(name) or {}).keys())


def config_error_line(exc: BaseException) -> str | None:
    """One line naming the fix for a Hydra/OmegaConf composition error (an unknown key, a
    string where a number belongs, an unparsable override); None for anything else."""
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        OmegaConfBaseException,
        ValidationError,
    )

    try:
        from hydra.errors import HydraException
    except ImportError:  # pragma: no cover
        HydraException = ()  # type: ignore[assignment,misc]
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        full = str(getattr(cause, "full_key", "") or getattr(cause, "key", "") or "")
        parent, _, key = full.rpartition(".")
        if parent.startswith("logger."):  # a logger's keys are its option's YAML
            valid = sorted(logger_keys(parent.split(".")[-1]) or [])
            return f"{full} is not a config key" + (f"; {nearest_keys(key, valid)}" if valid else "")
        return f"{full} is not a config key; {nearest_config_keys(full)}"
    if isinstance(cause, ValidationError):
        full = str(getattr(cause, "full_key", "") or "")
        msg = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        want = "a value of the schema's type"
        try:
            node_type = Config
            for part in full.split("."):
                node_type = schema_keys(node_type)[part]
            wanted: dict[type | None, str] = {int: "a whole number", float: "a number", bool: "true or false"}
            args = getattr(node_type, "__args__", ())
            want = wanted.get(next((t for t in (bool, int, float) if t in (node_type, *args)), None), want)
            if type(None) in args:  # a key that may be null says so
                want = f"{want.replace(' or ', ', ')} or null"
        except (KeyError, TypeError):
            pass
        return f"{full}: {msg}; give {full} {want}"
    if isinstance(exc, (HydraException, OmegaConfBaseException)):
        first = str(exc).strip().splitlines()
        text = " ".join(ln.strip() for ln in first) if first else type(exc).__name__
        return f"{text[:300]} (see finetune --help for the keys and groups)"
    return None
