"""Merging: an adapter fused into its base, written as one HF-format model directory (with
transformers + PEFT, or mlx-lm for an MLX-quantized base or where torch is absent)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from finetune.backends.mlx.hfconfig import model_config as mlx_model_config
from finetune.errors import UserError
from finetune.export.adapters import read_adapter, read_json
from finetune.export.basemodel import Base, check_against_base, check_remote_code, quantized_bits, resolve_base
from finetune.export.conversion import WRITERS, check_dst, keep_record, provenance, scrub
from finetune.io import atomic_dir, disk_errors
from finetune.model.source import TOKENIZER_FILES, load_causal_lm
from finetune.model.safetensors_io import dtype_bytes, header, tensors_of

# what a merged model's directory copies from its base beside the weights (model_source's
# TOKENIZER_FILES, and the base's sampling defaults)
BASE_FILES = (*TOKENIZER_FILES, "generation_config.json")


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
            after += n * 32 // quantized_bits(q, mod) * _float_bytes(header_dtypes[mod + ".scales"], 2)
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
    check_dst(dst, ad.path, overwrite)
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
            config = read_json(tmp / "config.json")
            config["exported_from"] = provenance(ad, b, "merged model")
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            keep_record(ad, tmp)
            scrub(tmp, ad, b)
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
