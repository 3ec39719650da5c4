"""The base model an adapter is exported against: its config and its weights' names and shapes
(read from the safetensors headers, or weights-only from pickles with --allow-pickle; no weights
are loaded), and the checks an adapter must pass against it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.export.adapters import LAYER, MLX_CONFIG, Adapter, read_json
from finetune.model.source import PICKLE_SUFFIXES, TEXT_KEY_MAPPING, hf_download, is_multimodal
from finetune.model.describe import FAMILIES, describe
from finetune.model.safetensors_io import header, tensors_of


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
            return shape[0], shape[1] * 32 // quantized_bits(q, module)
        return shape[0], shape[1]


def quantized_bits(q: dict[str, Any], module: str) -> int:
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
    config = read_json(local / "config.json")
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
    config = read_json(Path(model_dir) / "config.json")
    if trust_remote_code or not config.get("auto_map"):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config.get("model_type") in CONFIG_MAPPING:
        return
    raise UserError(f"model {model_dir} (model_type={config.get('model_type')!r}) needs its own Python code "
                    f"({', '.join(sorted(config['auto_map']))} in its auto_map) to load; {fix} if you trust the source")


def _block_linears(base: Base) -> tuple[str, dict[str, str]] | None:
    """(model_type, {path inside a block: kind}) of the linear layers transformers builds in a
    block of ``base`` (finetune/model/describe.py, from its config.json), or None for a family
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
        hit = LAYER.match(path)
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
