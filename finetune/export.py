"""``finetune-export``: move a LoRA/DoRA adapter between PEFT and mlx-lm, or fuse it into its base.

    finetune-export --to peft SRC DST      # mlx-lm adapter (or a backend=mlx run) -> PEFT
    finetune-export --to mlx SRC DST       # PEFT adapter (or a backend=cuda run) -> mlx-lm
    finetune-export --merge SRC DST        # adapter + base -> one HF-format model directory

SRC is an adapter directory in either format (ours or the peers' own: mlx-lm's
``adapters.safetensors`` + ``adapter_config.json``, PEFT's ``adapter_config.json`` +
``adapter_model.safetensors``) or a run directory holding one in ``adapter/``.

The two formats hold the same numbers in other shapes (read from mlx_lm/tuner/lora.py, dora.py and
peft/tuners/lora/layer.py, dora.py):

=================  ==============================  ==========================================
                   mlx-lm 0.32                      PEFT 0.21
=================  ==============================  ==========================================
down-projection    ``lora_a`` [in, r]              ``lora_A.weight`` [r, in]
up-projection      ``lora_b`` [r, out]             ``lora_B.weight`` [out, r]
update             ``scale * (x @ a) @ b``         ``lora_alpha / r * B(A(x))`` (rsLoRA: / sqrt r)
DoRA magnitude     ``m`` [out]                     ``lora_magnitude_vector`` [out]
layers             top ``num_layers`` blocks       ``layers_to_transform`` (any list)
modules            ``keys``: paths in a block      ``target_modules``: name suffixes
tensor names       ``model.layers.0.self_attn.     ``base_model.model.model.layers.0.self_attn.
                   q_proj.lora_a``                 q_proj.lora_A.weight``
=================  ==============================  ==========================================

DoRA's magnitude has one meaning on both sides: the norm of each output row of the adapted
weight ``W + scale * B @ A`` ([out, in], norm over ``in``; mlx ``norm(w, axis=1)``, PEFT
``norm(w, dim=1)``), so it is copied as is. Converting reorders and transposes tensors and never
does arithmetic on them (``lora_alpha = scale * r``), so every value, bf16 included, crosses
bit for bit. Reading and writing is this module's own safetensors code (numpy has no bf16), so
``--to`` imports neither torch nor mlx; ``--merge`` uses transformers + PEFT, or mlx-lm for an
MLX-quantized base.

Safety, as training has it: every loader gets ``trust_remote_code`` (off unless
``--trust-remote-code``), and base weights load from safetensors only unless ``--allow-pickle``
(a pickle runs code when loaded; see finetune/model_source.py ``check_weights``). No token or key
(an HF/W&B/MLflow environment variable's value, a value under a secret-named key of the adapter's
or the base's config) reaches a file this writes: each output is scrubbed in its temporary
directory (finetune/redact.py) and checked before it is renamed into place.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from finetune.errors import UserError
from finetune.io import atomic_dir, disk_errors
from finetune.redact import config_secrets, env_secrets, redact_dir, redact_tree, secrets_in_dir
from finetune.backends.mlx.hfconfig import MLX_TEXT_PREFIX, model_config as mlx_model_config
from finetune.model_source import (PICKLE_SUFFIXES, TEXT_KEY_MAPPING, TOKENIZER_FILES, hf_download, is_multimodal,
                                   load_causal_lm)
from finetune.planner.describe import FAMILIES, describe
from finetune.prompting import RECORD_FILE
from finetune.safetensors_io import Tensor, dtype_bytes, header, read_safetensors, tensors_of, write_safetensors

MLX_WEIGHTS, MLX_CONFIG = "adapters.safetensors", "adapter_config.json"
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
# what a merged model's directory copies from its base beside the weights (model_source's
# TOKENIZER_FILES, and the base's sampling defaults)
BASE_FILES = (*TOKENIZER_FILES, "generation_config.json")
_LAYER = re.compile(r"^(?P<prefix>.*?\blayers)\.(?P<index>\d+)\.(?P<rel>.+)$")

# ---- the adapter, in neither format ------------------------------------------------------
@dataclass
class Module:
    """One adapted linear layer, in PEFT's orientation: ``a`` [r, in], ``b`` [out, r]."""

    a: Tensor
    b: Tensor
    m: Tensor | None = None  # DoRA magnitude [out]


@dataclass
class Adapter:
    """A LoRA/DoRA adapter read from either format.

    ``modules`` is keyed by the module's path in the transformers model
    (``model.layers.0.self_attn.q_proj``), which is also its path in mlx-lm's model for the
    architectures whose weights mlx-lm loads under their hub names.
    """

    fmt: str  # "peft" | "mlx"
    path: Path
    dora: bool
    rank: int
    scale: float  # multiplies B @ A
    dropout: float
    modules: dict[str, Module]
    base: str | None  # the base model the adapter's config names
    trained_on_quantized: dict[str, Any] | None = None  # mlx: the quantization it trained on
    extra: dict[str, Any] = field(default_factory=dict)

    def layout(self) -> tuple[str, list[int], list[str]]:
        """(prefix, layer indices, block-relative module paths): ``model.layers``, [0, 1],
        ["self_attn.q_proj", ...]. Refuses adapters the two formats cannot both express: a
        module outside the decoder blocks, or a set of modules that is not every key in every
        adapted layer."""
        prefixes, layers, rels = set(), set(), []
        for path in self.modules:
            hit = _LAYER.match(path)
            if not hit:
                raise UserError(f"{self.path}: the adapter on {path} sits outside the decoder layers; only "
                                "adapters inside model.layers.N convert (mlx-lm's keys/num_layers cannot say it)")
            prefixes.add(hit["prefix"])
            layers.add(int(hit["index"]))
            if hit["rel"] not in rels:
                rels.append(hit["rel"])
        if len(prefixes) != 1:
            raise UserError(f"{self.path}: adapters under several layer stacks ({', '.join(sorted(prefixes))}); "
                            "only one decoder stack converts")
        (prefix,) = prefixes
        expected = {f"{prefix}.{i}.{r}" for i in layers for r in rels}
        if expected != set(self.modules):
            missing = min(expected - set(self.modules))
            raise UserError(f"{self.path}: the adapter covers some keys in some layers only (no {missing}); "
                            "mlx-lm adapts the same keys in each adapted layer, so this does not convert")
        return prefix, sorted(layers), sorted(rels)


def find_adapter_dir(src: str | Path) -> Path:
    """``src`` if it holds an adapter, else its ``adapter/`` (a run directory)."""
    src = Path(src).expanduser()
    if not src.exists():
        raise UserError(f"{src} does not exist; give an adapter directory or a run directory")
    for d in (src, src / "adapter"):
        if (d / MLX_CONFIG).is_file():
            return d
    raise UserError(f"{src} holds no adapter_config.json (nor does {src / 'adapter'}); give an adapter "
                    "directory (PEFT or mlx-lm) or a finetune run directory")


def detect_format(adapter_dir: Path) -> str:
    """"peft" or "mlx", from the config and the weight file beside it."""
    config = _read_json(adapter_dir / MLX_CONFIG)
    if "peft_type" in config:
        if not (adapter_dir / PEFT_WEIGHTS).is_file():
            bins = (adapter_dir / "adapter_model.bin").is_file()
            raise UserError(f"{adapter_dir} is a PEFT adapter without {PEFT_WEIGHTS}"
                            + ("; it has adapter_model.bin (pickle): re-save it with safe_serialization=True"
                               if bins else ""))
        return "peft"
    if "lora_parameters" in config or "fine_tune_type" in config:
        if config.get("fine_tune_type") == "full":
            raise UserError(f"{adapter_dir} is an mlx-lm full fine-tune, not an adapter; nothing to convert")
        if not (adapter_dir / MLX_WEIGHTS).is_file():
            raise UserError(f"{adapter_dir} is an mlx-lm adapter without {MLX_WEIGHTS}")
        return "mlx"
    raise UserError(f"{adapter_dir / MLX_CONFIG} is neither PEFT's (peft_type) nor mlx-lm's (lora_parameters)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable ({e}); fix or replace it") from None


def read_adapter(src: str | Path) -> Adapter:
    """Read an adapter directory (either format) or a run directory's ``adapter/``."""
    d = find_adapter_dir(src)
    return _read_peft(d) if detect_format(d) == "peft" else _read_mlx(d)


# PEFT options whose adapters mean something LoRA-in-mlx-lm cannot hold: (key, default, why)
_PEFT_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("modules_to_save", None, "fully trained modules beside the adapter"),
    ("bias", "none", "trained biases"),
    ("lora_bias", False, "a bias on lora_B"),
    ("fan_in_fan_out", False, "Conv1D-style transposed weights"),
    ("rank_pattern", {}, "a rank per module"),
    ("alpha_pattern", {}, "an alpha per module"),
    ("layer_replication", None, "replicated layers"),
    ("use_qalora", False, "QA-LoRA pooling"),
    ("target_parameters", None, "adapters on parameters rather than modules"),
    ("trainable_token_indices", None, "trained token embeddings"),
    ("alora_invocation_tokens", None, "activated LoRA"),
    ("use_bdlora", None, "block-diagonal LoRA"),
    ("arrow_config", None, "Arrow routing"),
)


def _read_peft(d: Path) -> Adapter:
    cfg = _read_json(d / PEFT_CONFIG)
    if cfg.get("peft_type") != "LORA":
        raise UserError(f"{d}: peft_type={cfg.get('peft_type')}; only LoRA and DoRA adapters convert")
    experts = [t for t in cfg.get("target_parameters") or [] if "experts" in str(t)]
    if experts:
        raise UserError(f"{d}: target_parameters={json.dumps(experts)} adapts stacked experts, which PEFT holds as "
                        "[experts*r, in] per stacked parameter (gate and up fused) and mlx-lm as [experts, r, in] per "
                        "gate/up/down projection; no exact conversion: retrain without experts in method.lora.keys")
    for key, default, what in _PEFT_REFUSED:
        value = cfg.get(key, default)
        if value not in (default, None, {}, [], False):
            raise UserError(f"{d}: {key}={json.dumps(value)} ({what}) has no mlx-lm equivalent; "
                            "retrain without it to convert")
    init = str(cfg.get("init_lora_weights", True)).lower()
    if init.startswith(("pissa", "olora", "corda", "loftq")):
        raise UserError(f"{d}: init_lora_weights={cfg['init_lora_weights']} rewrote the base weights at init; "
                        "convert it to a plain LoRA first (PEFT: save_pretrained(path_initial_model_for_"
                        "weight_conversion=...))")
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", 8))
    scale = alpha / (r ** 0.5 if cfg.get("use_rslora") else r)
    tensors, _ = read_safetensors(d / PEFT_WEIGHTS)
    parts: dict[str, dict[str, Tensor]] = {}
    for name, t in tensors.items():
        if not name.startswith(PEFT_PREFIX):
            raise UserError(f"{d}: tensor {name} does not start with {PEFT_PREFIX}; not a PEFT causal-LM adapter")
        path, _, leaf = name[len(PEFT_PREFIX):].partition(".lora_")
        leaf = "lora_" + leaf
        if leaf not in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector"):
            raise UserError(f"{d}: tensor {name} ({leaf}) has no mlx-lm equivalent (only lora_A, lora_B and "
                            "DoRA's lora_magnitude_vector on linear layers convert)")
        parts.setdefault(path, {})[leaf] = t
    modules = {}
    dora = bool(cfg.get("use_dora"))
    for path, p in parts.items():
        if "lora_A.weight" not in p or "lora_B.weight" not in p or dora != ("lora_magnitude_vector" in p):
            raise UserError(f"{d}: {path} lacks lora_A/lora_B" + (" or its DoRA magnitude" if dora else ""))
        modules[path] = Module(p["lora_A.weight"], p["lora_B.weight"], p.get("lora_magnitude_vector"))
    ad = Adapter("peft", d, dora, r, scale, float(cfg.get("lora_dropout", 0.0)), modules,
                 cfg.get("base_model_name_or_path"),
                 extra={"lora_alpha": alpha, "use_rslora": bool(cfg.get("use_rslora"))})
    _check_shapes(ad)
    return ad


def _read_mlx(d: Path) -> Adapter:
    cfg = _read_json(d / MLX_CONFIG)
    lp = cfg.get("lora_parameters") or {}
    if "scale" not in lp or "rank" not in lp:
        raise UserError(f"{d / MLX_CONFIG}: lora_parameters needs rank and scale (mlx-lm's keys)")
    tensors, _ = read_safetensors(d / MLX_WEIGHTS)
    parts: dict[str, dict[str, Tensor]] = {}
    for name, t in tensors.items():
        path, _, leaf = name.rpartition(".")
        path = path.removeprefix(MLX_TEXT_PREFIX)  # a multimodal base's text model: its own names
        if leaf not in ("lora_a", "lora_b", "m"):
            raise UserError(f"{d}: tensor {name} is not lora_a/lora_b/m; only LoRA and DoRA on linear layers convert")
        parts.setdefault(path, {})[leaf] = t
    dora = cfg.get("fine_tune_type", "lora") == "dora"
    modules = {}
    for path, p in parts.items():
        if "lora_a" not in p or "lora_b" not in p or dora != ("m" in p):
            raise UserError(f"{d}: {path} lacks lora_a/lora_b" + (" or its DoRA magnitude m" if dora else ""))
        if p["lora_a"].data.ndim != 2:
            raise UserError(f"{d}: {path} is a switch (mixture-of-experts) LoRA, [experts, r, in] per projection; "
                            "PEFT holds expert adapters as [experts*r, in] with gate and up fused, so this does not "
                            "convert exactly: retrain without the experts (switch_mlp) in the keys")
        modules[path] = Module(p["lora_a"].T, p["lora_b"].T, p.get("m"))
    quant = cfg.get("quantization")
    ad = Adapter("mlx", d, dora, int(lp["rank"]), float(lp["scale"]), float(lp.get("dropout", 0.0)), modules,
                 cfg.get("model"), trained_on_quantized=quant if isinstance(quant, dict) else None,
                 extra={"num_layers": cfg.get("num_layers"), "pre_quantized": bool(cfg.get("pre_quantized"))})
    _check_shapes(ad)
    return ad


def _check_shapes(ad: Adapter) -> None:
    if not ad.modules:
        raise UserError(f"{ad.path}: the adapter holds no tensors")
    for path, mod in ad.modules.items():
        r_a, _ = mod.a.shape
        out, r_b = mod.b.shape
        if r_a != ad.rank or r_b != ad.rank:
            raise UserError(f"{ad.path}: {path} has rank {r_a}/{r_b}, the config says {ad.rank}")
        if mod.m is not None and mod.m.shape != (out,):
            raise UserError(f"{ad.path}: {path} DoRA magnitude has shape {mod.m.shape}, expected ({out},)")


# ---- the base model -----------------------------------------------------------------------
@dataclass
class Base:
    """What conversion needs from the base model: its config and its weights' names and shapes
    (read from the safetensors headers; no weights are loaded)."""

    path: Path
    name: str  # as the adapter or --base named it
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    pickle_only: bool = False  # weights only in pickles (read with --allow-pickle)
    # a multimodal checkpoint: ``shapes`` holds its language model's weights under the text-only
    # model's names (what a PEFT adapter trained by finetune names); mlx-lm's wrapper adds MLX_TEXT_PREFIX
    multimodal: bool = False

    @property
    def num_layers(self) -> int:
        c = self.config.get("text_config") or self.config
        return int(c.get("num_hidden_layers") or self.config["num_hidden_layers"])

    @property
    def quantization(self) -> dict[str, Any] | None:
        q = self.config.get("quantization")  # MLX's block (mlx_lm.convert -q); HF's is quantization_config
        return q if isinstance(q, dict) and "bits" in q else None

    def linear_shape(self, module: str) -> tuple[int, int] | None:
        """[out, in] of ``module``'s weight (an MLX-packed weight unpacked: in * bits / 32)."""
        shape = self.shapes.get(module + ".weight")
        if shape is None or len(shape) != 2:
            return None
        q = self.quantization
        if q and module + ".scales" in self.shapes:
            return shape[0], shape[1] * 32 // _bits(q, module)
        return shape[0], shape[1]


def _bits(q: dict[str, Any], module: str) -> int:
    """Bits of ``module`` in an MLX quantization block (mlx-lm may give a module its own entry)."""
    own = q.get(module)
    return int(own["bits"]) if isinstance(own, dict) and "bits" in own else int(q["bits"])


def resolve_base(name: str | None, adapter: Adapter, flag: bool, allow_pickle: bool = False) -> Base:
    """The base model ``--base`` names (``flag``) or the adapter's config names: a local
    directory, or a hub id already in the Hugging Face cache. Its weights must be safetensors,
    or pickles with ``allow_pickle`` (their shapes then read by torch's weights-only unpickler
    onto the meta device: no code from the file runs, no tensor data is read)."""
    if not name:
        raise UserError(f"{adapter.path} names no base model; pass --base /path/to/base")
    local = Path(str(name)).expanduser()
    where = "--base" if flag else f"the adapter's config ({adapter.path / MLX_CONFIG})"
    hub = not local.is_dir()
    if hub:
        try:
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(str(name), allow_patterns=["*.json", "*.safetensors"],
                                           local_files_only=True))
        except Exception:  # noqa: BLE001  (offline, unknown id, gated: the same answer for the user)
            raise UserError(f"base model {name} (from {where}) is neither a local directory nor in the Hugging Face "
                            f"cache; download it ({hf_download(str(name))}) or pass --base /path/to/base") from None
    if not (local / "config.json").is_file():
        raise UserError(f"base model {local} (from {where}) has no config.json; "
                        "pass --base with an HF-format model directory")
    safetensors, pickles = _weight_files(local)
    if not safetensors and not pickles:
        if hub:  # a config.json fetched alone (a plan's) is not the model
            raise UserError(f"base model {name} (from {where}): the Hugging Face cache holds only part of its snapshot "
                            f"({local}: no weights); download the whole snapshot ({hf_download(str(name))}) "
                            "or pass --base /path/to/base")
        raise UserError(f"base model {local} (from {where}) holds no weights (*.safetensors); "
                        "pass --base with a complete model directory")
    if not safetensors and not allow_pickle:
        raise UserError(f"base model {local} (from {where}) has only pickle weights ({pickles[0].name}), which run "
                        "code when loaded; convert them to safetensors, or add --allow-pickle if you trust the source")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in safetensors:
        shapes.update({k: tuple(v["shape"]) for k, v in tensors_of(header(f)[0]).items()})
    if not safetensors:
        shapes = _pickle_shapes(pickles)
    config = _read_json(local / "config.json")
    multimodal = is_multimodal(config)
    if multimodal:  # the language model's weights, named as the text-only model finetune trains (cuda)
        shapes = {text: v for k, v in shapes.items() if (text := _text_name(k)) is not None}
    return Base(local, str(name), config, shapes, pickle_only=not safetensors, multimodal=multimodal)


def _text_name(key: str) -> str | None:
    """A multimodal checkpoint's weight name as its text-only model names it, or None (the vision tower's)."""
    for pattern, repl in TEXT_KEY_MAPPING.items():
        if re.match(pattern, key):
            return re.sub(pattern, repl, key)
    return None


def _weight_files(d: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, pickle weight files) of a model directory, as model_source's
    check_weights counts them (training_args.bin is not weights)."""
    files = sorted(p for p in d.iterdir() if p.is_file())
    return ([p for p in files if p.name.endswith(".safetensors")],
            [p for p in files if p.name.endswith(PICKLE_SUFFIXES) and "training_args" not in p.name])


def _pickle_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    try:
        import torch
    except ImportError:
        raise UserError("reading pickle weights (--allow-pickle) needs torch (pip install '.[cuda]'); or convert "
                        "the base to safetensors") from None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            sd = torch.load(f, map_location="meta", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001  (not a state dict, or one the safe unpickler refuses)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"{f} is not a weights-only state dict ({first[:160]}); convert it to safetensors") from None
        shapes.update({k: tuple(v.shape) for k, v in sd.items() if hasattr(v, "shape")})
    return shapes


def check_remote_code(model_dir: Path, trust_remote_code: bool, fix: str) -> None:
    """UserError, naming ``fix`` (the flag or key that trusts it), when the model's config.json
    needs the model's own Python code (an ``auto_map`` for an architecture transformers does
    not know) and ``trust_remote_code`` is off: one line, where transformers would raise a
    multi-line ValueError; the code is never imported. A known architecture loads with
    transformers' own class, whatever auto_map says, so it passes."""
    config = _read_json(Path(model_dir) / "config.json")
    if trust_remote_code or not config.get("auto_map"):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config.get("model_type") in CONFIG_MAPPING:
        return
    raise UserError(f"model {model_dir} (model_type={config.get('model_type')!r}) needs its own Python code "
                    f"({', '.join(sorted(config['auto_map']))} in its auto_map) to load; {fix} if you trust the source")


def _block_linears(base: Base) -> tuple[str, dict[str, str]] | None:
    """(model_type, {path inside a block: kind}) of the linear layers transformers builds in a
    block of ``base`` (finetune/planner/describe.py, from its config.json), or None for a family
    the description does not know exactly. The names on disk are not always the modules'
    names: transformers 5 saves Mixtral's router as ``block_sparse_moe.gate`` (the name mlx-lm
    loads) while its module is ``mlp.gate``, a router that is no linear layer for PEFT."""
    try:
        desc = describe(base.config, str(base.path / "config.json"))
    except UserError:
        return None
    if desc.model_type not in FAMILIES:
        return None
    return desc.model_type, {lin.path: lin.kind for b in desc.blocks for lin in b.linears}


def check_against_base(ad: Adapter, base: Base) -> None:
    """Every adapted module is a linear layer of the base with the adapter's in/out widths, and
    (for the families finetune describes) a linear layer of transformers' block under the same
    path as in mlx-lm's: the attention and dense-MLP projections, whose names the two libraries
    share (Phi-3's qkv_proj and gate_up_proj, StarCoder2's c_fc and c_proj included). A router
    or an expert is refused in one line: their layouts differ between the two."""
    if not base.shapes:
        raise UserError(f"base model {base.path} has no weights to check the adapter against; "
                        "pass --base with a complete model directory")
    known = _block_linears(base)
    for path, mod in ad.modules.items():
        hit = _LAYER.match(path)
        if known and hit:
            mtype, linears = known
            leaf = hit["rel"].rsplit(".", 1)[-1]  # the router under its saved name (block_sparse_moe.gate)
            kind = linears.get(hit["rel"]) or next((v for k, v in linears.items()
                                                    if v == "router" and k.rsplit(".", 1)[-1] == leaf), None)
            if kind not in ("attention", "mlp"):
                what = {"router": "the mixture-of-experts router", "expert": "stacked experts"}.get(
                    kind or "", f"not a linear layer of transformers' {mtype} block")
                names = ", ".join(k for k, v in linears.items() if v in ("attention", "mlp"))
                raise UserError(f"{ad.path}: {path} is {what}; only the attention and MLP projections "
                                f"convert between PEFT and mlx-lm ({names})")
        shape = base.linear_shape(path)
        if shape is None:
            raise UserError(f"{ad.path}: {path} is not a linear layer of base {base.path} "
                            "(mlx-lm may name this architecture's modules differently from transformers); "
                            "cannot map it")
        want = (mod.b.shape[0], mod.a.shape[1])
        if shape != want:
            raise UserError(f"{ad.path}: {path} is [out, in] = {list(want)} in the adapter but {list(shape)} in "
                            f"base {base.path}; pass --base with the model it was trained on")


# ---- writers ------------------------------------------------------------------------------
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("finetune")
    except PackageNotFoundError:
        return "unknown"


def provenance(ad: Adapter, base: Base, what: str) -> dict[str, Any]:
    """Where an export came from: the source's format and path, the base, the tool's version
    (a path or URL holding a secret is masked: this goes into safetensors headers too)."""
    made = {"tool": "finetune-export", "version": _version(), "made": what, "source_format": ad.fmt,
            "source": str(ad.path.resolve()), "base": str(base.path), "dora": ad.dora, "rank": ad.rank,
            "scale": ad.scale,
            # mlx qlora: the adapter learned against these quantized weights; loaded onto the
            # full-precision base (or bitsandbytes NF4) it meets slightly different ones
            "trained_on_quantized": ad.trained_on_quantized}
    return redact_tree(made, export_secrets(ad, base))


# the base's files that carry settings (a token saved with a tokenizer lands in its config)
_BASE_CONFIGS = ("config.json", "tokenizer_config.json", "generation_config.json")


def export_secrets(ad: Adapter, base: Base) -> list[str]:
    """Values no exported file may hold, longest first: those of secret-named environment
    variables (HF_TOKEN, WANDB_API_KEY, MLFLOW_TRACKING_TOKEN...), the values under
    secret-named keys of the adapter's config (mlx-lm keeps every training argument there), and
    the string values under such keys of the base's config files (their numbers are vocabulary
    ids, which masking would corrupt)."""
    found = set(env_secrets())
    try:
        found |= set(config_secrets(json.loads((ad.path / MLX_CONFIG).read_text())))
    except (OSError, ValueError):
        pass
    for name in _BASE_CONFIGS:
        try:
            found |= {v for v in config_secrets(json.loads((base.path / name).read_text())) if not v.isdigit()}
        except (OSError, ValueError):
            continue
    return sorted(found, key=len, reverse=True)


def _scrub(out: Path, ad: Adapter, base: Base) -> None:
    """Mask every secret in what was written into ``out`` (an atomic write's temporary
    directory), then check none is left; a secret left in a file that cannot be masked (a
    tensor file) stops the export before anything is renamed into place."""
    secrets = export_secrets(ad, base)
    redact_dir(out, secrets)
    left = secrets_in_dir(out, secrets)
    if left:
        f, _ = left[0]
        raise UserError(f"{f.name} would hold a token or key (the value of a secret environment variable or config "
                        "key); nothing written: remove the secret from the adapter's or base's files and export again")


def write_peft(ad: Adapter, base: Base, out: Path) -> None:
    """PEFT's adapter_config.json + adapter_model.safetensors for ``ad`` into ``out``."""
    _, layers, rels = ad.layout()
    tensors: dict[str, Tensor] = {}
    for path, mod in ad.modules.items():
        tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = mod.a
        tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = mod.b
        if mod.m is not None:
            tensors[f"{PEFT_PREFIX}{path}.lora_magnitude_vector"] = mod.m
    all_layers = layers == list(range(base.num_layers))
    targets = _peft_targets(rels, base, set(ad.modules), None if all_layers else layers)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base.path) if Path(base.name).expanduser().is_dir() else base.name,
        "r": ad.rank,
        "lora_alpha": ad.scale * ad.rank,  # PEFT's scaling is lora_alpha / r; mlx-lm's scale is that ratio
        "lora_dropout": ad.dropout,
        "use_rslora": False,
        "use_dora": ad.dora,
        "target_modules": targets,
        "layers_to_transform": None if all_layers else layers,
        "layers_pattern": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    # PEFT warns about any key its LoraConfig lacks (as if saved by a newer PEFT), so where this
    # came from rides in the weights file's own metadata, which PEFT and vLLM carry but ignore.
    meta = {"format": "pt", "finetune_export": json.dumps(provenance(ad, base, "peft adapter"))}
    write_safetensors(out / PEFT_WEIGHTS, tensors, meta)
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _peft_targets(rels: list[str], base: Base, adapted: set[str], layers: list[int] | None) -> list[str]:
    """target_modules that make PEFT adapt exactly ``adapted`` in ``base``: the short names
    (``q_proj``, as PEFT and vLLM write them) where they pick nothing else, else the paths
    inside a block (``self_attn.q_proj``; PEFT matches a target as a name suffix)."""
    modules = {k[: -len(".weight")] for k in base.shapes if k.endswith(".weight")}

    def picks(targets: list[str]) -> set[str]:
        out = set()
        for mod in modules:
            if not any(mod == t or mod.endswith("." + t) for t in targets):
                continue
            hit = _LAYER.match(mod)
            if layers is None or (hit and int(hit["index"]) in layers):
                out.add(mod)
        return out

    short = sorted({r.rsplit(".", 1)[-1] for r in rels})
    if len(short) == len(rels) and picks(short) == adapted:
        return short
    if picks(rels) == adapted:
        return rels
    extra = sorted(picks(rels) - adapted)[:1]
    raise UserError(f"target_modules {rels} would also adapt {extra} in base {base.path}; PEFT cannot say this "
                    "set of modules")


def write_mlx(ad: Adapter, base: Base, out: Path) -> None:
    """mlx-lm's adapter_config.json + adapters.safetensors for ``ad`` into ``out``."""
    _, layers, rels = ad.layout()
    n = base.num_layers
    top = list(range(n - len(layers), n))
    if layers != top:
        raise UserError(f"{ad.path}: adapters on layers {layers} of {n}; mlx-lm adapts only the top num_layers "
                        f"layers ({top} for {len(layers)}), so this does not convert")
    tensors: dict[str, Tensor] = {}
    prefix = MLX_TEXT_PREFIX if base.multimodal else ""  # mlx-lm's multimodal wrapper names its text model so
    for path, mod in ad.modules.items():
        tensors[f"{prefix}{path}.lora_a"] = mod.a.T
        tensors[f"{prefix}{path}.lora_b"] = mod.b.T
        if mod.m is not None:
            tensors[f"{prefix}{path}.m"] = mod.m
    config = {
        "model": str(base.path) if Path(base.name).expanduser().is_dir() else base.name,
        "fine_tune_type": "dora" if ad.dora else "lora",
        "num_layers": len(layers),
        "lora_parameters": {"rank": ad.rank, "scale": ad.scale, "dropout": ad.dropout, "keys": rels},
        "exported_from": provenance(ad, base, "mlx adapter"),  # mlx-lm reads only the keys it knows
    }
    write_safetensors(out / MLX_WEIGHTS, tensors, {"format": "mlx"})
    (out / MLX_CONFIG).write_text(json.dumps(config, indent=4) + "\n")


WRITERS = {"peft": write_peft, "mlx": write_mlx}


def _check_dst(dst: Path, src: Path, overwrite: bool) -> None:
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise UserError(f"DST {dst} is SRC or inside it; choose another output directory")
    if dst.exists() and not overwrite:
        raise UserError(f"{dst} exists; choose a new output directory or add --overwrite")


def convert(src: str | Path, dst: str | Path, to: str, base: str | None = None, overwrite: bool = False,
            allow_pickle: bool = False) -> Path:
    """Write the adapter in ``src`` (either format) as a ``to`` ("peft" | "mlx") adapter into
    ``dst``, atomically. Returns ``dst``. Raises UserError naming what cannot be converted.
    ``allow_pickle``: a base with pickle weights only is read (its shapes, weights-only)."""
    if to not in WRITERS:
        raise UserError(f"--to {to} is not a format; choose one of: {', '.join(WRITERS)}")
    ad = read_adapter(src)
    dst = Path(dst).expanduser()
    _check_dst(dst, ad.path, overwrite)
    b = resolve_base(base or ad.base, ad, flag=base is not None, allow_pickle=allow_pickle)
    if to == "peft" and b.quantization:
        q = b.quantization
        raise UserError(f"base {b.path} is MLX-quantized ({q['bits']}-bit, group {q.get('group_size')}), which "
                        "transformers cannot load; pass --base with the unquantized checkpoint it came from (the "
                        "adapter then meets weights without the quantization error it trained on)")
    check_against_base(ad, b)
    with atomic_dir(dst) as tmp, disk_errors(tmp):
        WRITERS[to](ad, b, tmp)
        _keep_record(ad, tmp)
        _scrub(tmp, ad, b)
    return dst


def _keep_record(ad: Adapter, out: Path) -> None:
    """The run's note beside the adapter (finetune.json: how its prompts were formatted, which
    mode=generate follows) goes with it into ``out``; neither library reads it."""
    if (ad.path / RECORD_FILE).is_file():
        shutil.copy2(ad.path / RECORD_FILE, out / RECORD_FILE)


# ---- merge --------------------------------------------------------------------------------
def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)"


def _float_bytes(dtype: str, default: int) -> int:
    """Bytes per element of a float dtype mlx-lm keeps when it dequantizes (F32, F16, BF16),
    else ``default`` (a U8 scale dequantizes to 16 bits)."""
    return int(dtype_bytes(dtype) or default) if dtype in ("F32", "F16", "BF16") else default


def dequantize_cost(base: Base) -> tuple[int, int]:
    """(bytes of the quantized base's weights now, bytes once dequantized to the dtype of its
    scales, as mlx-lm's fuse --dequantize writes them)."""
    q = base.quantization or {}
    now = sum(f.stat().st_size for f in base.path.glob("*.safetensors"))
    header_dtypes: dict[str, str] = {}
    for f in base.path.glob("*.safetensors"):
        header_dtypes.update({k: v["dtype"] for k, v in tensors_of(header(f)[0]).items()})
    after = 0
    for name, shape in base.shapes.items():
        mod, _, leaf = name.rpartition(".")
        quantized = mod + ".scales" in base.shapes
        if quantized and leaf in ("scales", "biases"):
            continue
        n = int(np.prod(shape))
        if quantized and leaf == "weight":
            after += n * 32 // _bits(q, mod) * _float_bytes(header_dtypes[mod + ".scales"], 2)
        else:
            after += n * _float_bytes(header_dtypes[name], 4)
    return now, after


def merge(src: str | Path, dst: str | Path, base: str | None = None, dequantize: bool = False,
          overwrite: bool = False, engine: str | None = None, trust_remote_code: bool = False,
          allow_pickle: bool = False) -> Path:
    """Fuse the adapter in ``src`` into its base and write an HF-format model directory (config,
    safetensors, tokenizer) into ``dst``, atomically.

    An MLX-quantized base is fused with mlx-lm and must be dequantized to leave as an HF model;
    that costs disk and memory, so it happens only with ``dequantize=True``. Other bases fuse
    with transformers + PEFT (``merge_and_unload``), or mlx-lm where torch is absent
    (``engine`` forces one: "peft" | "mlx"). ``trust_remote_code`` goes to every loader (the
    base's own Python runs only when set); ``allow_pickle`` lets transformers load a base whose
    weights are pickles (mlx-lm loads safetensors only).
    """
    import importlib.util

    ad = read_adapter(src)
    dst = Path(dst).expanduser()
    _check_dst(dst, ad.path, overwrite)
    b = resolve_base(base or ad.base, ad, flag=base is not None, allow_pickle=allow_pickle)
    check_against_base(ad, b)
    if b.quantization:
        now, after = dequantize_cost(b)
        if not dequantize:
            raise UserError(f"base {b.path} is MLX-quantized ({b.quantization['bits']}-bit); an HF model needs it "
                            f"dequantized: {_bytes(after)} on disk instead of {_bytes(now)}, about as much memory "
                            "while merging; add --dequantize to do it")
        engine = "mlx"
        print(f"dequantizing {b.path}: {_bytes(now)} -> {_bytes(after)}", file=sys.stderr)
    if engine is None:
        engine = "peft" if importlib.util.find_spec("torch") and importlib.util.find_spec("peft") else "mlx"
    if engine == "mlx" and importlib.util.find_spec("mlx_lm") is None:
        raise UserError("--merge needs transformers + peft (pip install '.[cuda]') or mlx-lm (pip install '.[mlx]')")
    if engine == "mlx" and b.pickle_only:
        raise UserError(f"base model {b.path} has only pickle weights, which mlx-lm does not load; convert them to "
                        "safetensors (or merge with transformers + peft installed)")
    with tempfile.TemporaryDirectory(prefix=".finetune-export-", dir=dst.parent if dst.parent.exists() else None) as t:
        native = Path(t) / "adapter"
        want = "peft" if engine == "peft" else "mlx"
        if ad.fmt == want:
            native = ad.path
        else:
            native.mkdir()
            WRITERS[want](ad, b, native)
        with atomic_dir(dst) as tmp, disk_errors(tmp):
            if engine == "peft":
                _merge_peft(b, native, tmp, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
            else:
                _merge_mlx(b, native, tmp, trust_remote_code=trust_remote_code)
            config = _read_json(tmp / "config.json")
            config["exported_from"] = provenance(ad, b, "merged model")
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            _keep_record(ad, tmp)
            _scrub(tmp, ad, b)
    return dst


def _merge_peft(base: Base, adapter_dir: Path, out: Path, trust_remote_code: bool, allow_pickle: bool) -> None:
    import torch
    from peft import PeftModel

    check_remote_code(base.path, trust_remote_code, "add --trust-remote-code")
    # use_safetensors=True: transformers refuses pickle weights instead of falling back to them.
    # The adapter PEFT loads is always adapter_model.safetensors (detect_format / write_peft).
    # a multimodal checkpoint: its language model alone, as training loaded it
    model = load_causal_lm(base.path, trust_remote_code, dtype="auto", use_safetensors=None if allow_pickle else True)
    with torch.no_grad():
        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    for name in BASE_FILES:
        if (base.path / name).is_file() and not (out / name).exists():
            shutil.copy2(base.path / name, out / name)


def _merge_mlx(base: Base, adapter_dir: Path, out: Path, trust_remote_code: bool) -> None:
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import dequantize_model, load, save

    # mlx-lm reads model*.safetensors only; the tokenizer's own code runs only when trusted

    hf_keys = mlx_model_config(base.path)  # transformers-5 keys in mlx-lm's words, for loading only
    model, tokenizer, config = load(str(base.path), adapter_path=str(adapter_dir), return_config=True,
                                    model_config=hf_keys, tokenizer_config={"trust_remote_code": trust_remote_code},
                                    trust_remote_code=trust_remote_code)
    config = {k: v for k, v in config.items() if k not in hf_keys}  # the merge's config.json stays the base's
    fused = [(n, m.fuse(dequantize=True)) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused))
    if base.quantization:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    save(out, str(base.path), model, tokenizer, config, donate_model=False)
    (out / "README.md").unlink(missing_ok=True)  # mlx-lm's model card names an upload that did not happen


# ---- command line -------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``finetune-export``: see the module docstring. Exit 0, or 2 with one ``error:`` line."""
    ap = argparse.ArgumentParser(
        prog="finetune-export", description="Move a LoRA/DoRA adapter between PEFT and mlx-lm, or merge it into "
        "its base.", epilog="e.g. finetune-export --to peft outputs/RUN peft-adapter/;  "
        "finetune-export --merge outputs/RUN merged/")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--to", choices=sorted(WRITERS), help="write the adapter in this format")
    how.add_argument("--merge", action="store_true", help="fuse the adapter into its base: an HF model directory")
    ap.add_argument("src", help="adapter directory (PEFT or mlx-lm) or a finetune run directory")
    ap.add_argument("dst", help="output directory (written whole or not at all)")
    ap.add_argument("--base", default=None, help="base model directory or hub id (default: the adapter's own config)")
    ap.add_argument("--dequantize", action="store_true",
                    help="--merge onto an MLX-quantized base: write it dequantized (in the dtype of its "
                    "scales, usually 16-bit), which costs disk; without it the cost is printed")
    ap.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="--merge: let the base's own Python code run (custom architectures); only for a source you "
                    "trust (default: off, as model.trust_remote_code)")
    ap.add_argument("--allow-pickle", action="store_true",
                    help="accept a base whose weights are pickles (*.bin), which run code when loaded; only for a "
                    "source you trust (default: safetensors only, as model.allow_pickle)")
    a = ap.parse_args(argv)
    try:
        if a.merge:
            out = merge(a.src, a.dst, base=a.base, dequantize=a.dequantize, overwrite=a.overwrite,
                        trust_remote_code=a.trust_remote_code, allow_pickle=a.allow_pickle)
        else:
            out = convert(a.src, a.dst, a.to, base=a.base, overwrite=a.overwrite, allow_pickle=a.allow_pickle)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only or missing parent: DST is left as it was
        where = e.filename or a.dst
        print(f"error: cannot write {where} ({e.strerror or e}); nothing was written to {a.dst}: free space or "
              "choose another output directory", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
