"""The adapter in either format, read: a LoRA/DoRA adapter of PEFT or mlx-lm (a directory, or
a finetune run directory holding one in ``adapter/``) as one ``Adapter``, in PEFT's orientation.
The formats and how they differ: finetune/export/__init__.py."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.backends.mlx.hfconfig import MLX_TEXT_PREFIX
from finetune.errors import UserError
from finetune.model.safetensors_io import Tensor, read_safetensors

MLX_WEIGHTS, MLX_CONFIG = "adapters.safetensors", "adapter_config.json"
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
LAYER = re.compile(r"^(?P<prefix>.*?\blayers)\.(?P<index>\d+)\.(?P<rel>.+)$")

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
            hit = LAYER.match(path)
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
    config = read_json(adapter_dir / MLX_CONFIG)
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


def read_json(path: Path) -> dict[str, Any]:
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
    cfg = read_json(d / PEFT_CONFIG)
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
    cfg = read_json(d / MLX_CONFIG)
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
