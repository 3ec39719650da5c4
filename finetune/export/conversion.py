"""Format conversion: an adapter written in the other format (PEFT <-> mlx-lm), and what every
export's output goes through (where it came from, no secret in it, its record kept)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from finetune.backends.mlx.hfconfig import MLX_TEXT_PREFIX
from finetune.errors import UserError
from finetune.export.adapters import (LAYER, MLX_CONFIG, MLX_WEIGHTS, PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS,
                                      Adapter, read_adapter)
from finetune.export.basemodel import Base, check_against_base, resolve_base
from finetune.io import atomic_dir, disk_errors
from finetune.prompting import RECORD_FILE
from finetune.redact import config_secrets, env_secrets, redact_dir, redact_tree, secrets_in_dir
from finetune.model.safetensors_io import Tensor, write_safetensors

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


def scrub(out: Path, ad: Adapter, base: Base) -> None:
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
            hit = LAYER.match(mod)
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


def check_dst(dst: Path, src: Path, overwrite: bool) -> None:
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
    check_dst(dst, ad.path, overwrite)
    b = resolve_base(base or ad.base, ad, flag=base is not None, allow_pickle=allow_pickle)
    if to == "peft" and b.quantization:
        q = b.quantization
        raise UserError(f"base {b.path} is MLX-quantized ({q['bits']}-bit, group {q.get('group_size')}), which "
                        "transformers cannot load; pass --base with the unquantized checkpoint it came from (the "
                        "adapter then meets weights without the quantization error it trained on)")
    check_against_base(ad, b)
    with atomic_dir(dst) as tmp, disk_errors(tmp):
        WRITERS[to](ad, b, tmp)
        keep_record(ad, tmp)
        scrub(tmp, ad, b)
    return dst


def keep_record(ad: Adapter, out: Path) -> None:
    """The run's note beside the adapter (finetune.json: how its prompts were formatted, which
    mode=generate follows) goes with it into ``out``; neither library reads it."""
    if (ad.path / RECORD_FILE).is_file():
        shutil.copy2(ad.path / RECORD_FILE, out / RECORD_FILE)
