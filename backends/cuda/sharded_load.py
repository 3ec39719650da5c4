"""FSDP's sharded load: every rank builds the model with no weights, FSDP2 shards it, and each
rank then reads the checkpoint one tensor at a time and keeps only its own rows. No rank ever
holds the whole model, on the host or on the device (issue 34: "each rank loads only its shard").

How, in three stages the runtime calls around its own (backends/cuda/runtime.py setup):

1. ``skeleton``: transformers builds the model under accelerate's ``init_empty_weights`` (the
   parameters on the meta device, the buffers real: the rotary tables are computed as
   ``from_pretrained`` computes them); for qlora, transformers' own bitsandbytes quantizer
   swaps the linears for ``Linear4bit`` (the same ``replace_with_bnb_linear`` that
   ``from_pretrained`` runs). Every parameter is then replaced by a placeholder of its final
   shape and dtype that costs one element: ``torch.zeros(()).expand(shape)`` (a 4-bit weight:
   its packed storage, ``[numel / 2 / storage bytes, 1]``, as a ``Params4bit``), so PEFT's
   adapters, which take the device and dtype of the layer they wrap, are built for real (with
   the seeded random stream of the one-process run). The checkpoint's persistent buffers load whole.
2. The runtime adds the adapters; ``to_meta`` swaps each placeholder for a meta parameter
   (FSDP2 refuses a placeholder's zero strides) and ``fully_shard`` (distributed.shard_model)
   shards it into a meta shard of this rank's rows (torch.chunk on dim 0).
3. ``fill``: for each base weight, this rank's rows of the checkpoint's tensor are read
   (safetensors' slices; one file mapping per tensor, closed after it) and cast to the dtype
   ``from_pretrained`` casts to; a 4-bit weight is read whole and quantized as transformers'
   quantizer does (``Params4bit(...).to(device)``: so its quantization constants, which every
   rank keeps whole, are the one-process run's to the bit) and its packed rows kept. The rows
   replace the meta shard through ``load_state_dict(assign=True)``. One tensor at a time.

What it cannot do, and then the runtime loads the whole model per rank as before (said in one
log line): a checkpoint whose tensor names are not the model's (transformers renames or fuses
them on load: the stacked experts of an MoE, legacy names), a multimodal checkpoint, a model's
own remote code, packed rows (their check runs a forward before FSDP's).
``host_offload.sharded_load_refusal`` (torch-free) is the planner's side of the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune.model.safetensors_io import header, tensors_of


@dataclass
class Slot:
    """One base weight to fill: the module holding it, its attribute, the checkpoint tensor's
    file and name, and for a 4-bit weight the Params4bit settings it is quantized with."""

    module: torch.nn.Module
    attr: str
    file: Path
    key: str
    quant: dict[str, Any] | None = None
    aliases: list[tuple[torch.nn.Module, str]] = field(default_factory=list)  # tied: the same weight elsewhere


class Refused(Exception):
    """The sharded load does not apply to this checkpoint; the message says why (logged)."""


def checkpoint_index(model_dir: Path) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor of the checkpoint's safetensors: name -> (file, shape), from the headers."""
    out: dict[str, tuple[Path, list[int]]] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise Refused("no safetensors files")
    for f in files:
        for name, meta in tensors_of(header(f)[0]).items():
            out[name] = (f, list(meta["shape"]))
    return out


def skeleton(model_dir: Path, config: Any, dtype: torch.dtype, attn: str | None, bnb: Any | None,
             device: torch.device) -> tuple[Any, list[Slot]]:
    """The model with one-element placeholders for its weights (stage 1 of the module
    docstring), and the slots ``fill`` loads. Raises Refused where the checkpoint's names are
    not the model's."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    index = checkpoint_index(model_dir)
    with init_empty_weights(include_buffers=False):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    hf.tie_weights()  # from_pretrained ties them as it loads (tie_word_embeddings); from_config leaves them apart
    quantizer = None
    if bnb is not None:
        from transformers.quantizers import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(bnb, pre_quantized=False)
        quantizer.preprocess_model(hf, device_map={"": str(device)}, dtype=dtype)
    slots: list[Slot] = []
    done: dict[int, tuple[torch.nn.Parameter, Slot]] = {}  # tied weights: one placeholder, one slot
    for name, mod in hf.named_modules(remove_duplicate=False):
        for attr, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = f"{name}.{attr}" if name else attr
            if id(p) in done:
                new, slot = done[id(p)]
                setattr(mod, attr, new)
                slot.aliases.append((mod, attr))
                continue
            if full not in index:
                raise Refused(f"the model's {full} is not a tensor of the checkpoint (transformers renames or fuses "
                              "this model's weights as it loads them)")
            file, shape = index[full]
            if list(p.shape) != shape:
                raise Refused(f"{full}: the checkpoint's shape {shape} is not the model's {list(p.shape)}")
            quant = _quant_settings(p) if type(p).__name__ == "Params4bit" else None
            new = _placeholder(p, quant, mod, device)
            setattr(mod, attr, new)
            slots.append(Slot(mod, attr, file, full, quant))
            done[id(p)] = (new, slots[-1])
    _load_buffers(hf, index)
    if quantizer is not None:
        quantizer.postprocess_model(hf)  # is_loaded_in_4bit (PEFT's 4-bit adapters), the config's quantization
    return hf, slots


@torch.no_grad()
def _load_buffers(hf: Any, index: dict[str, tuple[Path, list[int]]]) -> None:
    """The persistent buffers the checkpoint holds, whole (small; FSDP does not shard buffers)."""
    from safetensors import safe_open

    for name, mod in hf.named_modules():
        for attr, buf in mod._buffers.items():
            full = f"{name}.{attr}" if name else attr
            if buf is None or attr in mod._non_persistent_buffers_set or full not in index:
                continue
            with safe_open(str(index[full][0]), framework="pt") as f:
                buf.copy_(f.get_tensor(full).to(buf.dtype))


def _quant_settings(p: Any) -> dict[str, Any]:
    return {"blocksize": p.blocksize, "compress_statistics": p.compress_statistics, "quant_type": p.quant_type,
            "quant_storage": p.quant_storage}


def _placeholder(p: torch.Tensor, quant: dict[str, Any] | None, mod: torch.nn.Module,
                 device: torch.device) -> torch.nn.Parameter:
    """A parameter of ``p``'s final shape and dtype holding one element (an expanded zero)."""
    if quant is None:
        one = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
        return torch.nn.Parameter(one, requires_grad=p.requires_grad)
    import bitsandbytes as bnb

    storage = quant["quant_storage"]
    # bitsandbytes.functional.quantize_4bit's packed output: two 4-bit values a byte, viewed as storage
    rows = (p.numel() + 1) // (storage.itemsize * 2)
    one = torch.zeros((), dtype=storage, device=device).expand(rows, 1)
    return bnb.nn.Params4bit(one, requires_grad=False, module=mod, bnb_quantized=True, **quant)


def to_meta(slots: list[Slot]) -> None:
    """Before ``fully_shard``: each placeholder swapped for a meta parameter of its shape and
    dtype (FSDP2 shards a meta parameter into a meta shard, and refuses a placeholder's
    zero strides), on every module that holds it (tied weights)."""
    for s in slots:
        p = getattr(s.module, s.attr)
        meta = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        for mod, attr in [(s.module, s.attr), *s.aliases]:
            setattr(mod, attr, meta)


@torch.no_grad()
def fill(slots: list[Slot], rank: int, world: int, dtype: torch.dtype, device: torch.device,
         shard_device: torch.device) -> None:
    """Stage 3: each slot's checkpoint tensor read, cast (4-bit ones quantized whole on
    ``device``, their constants set on the module), and this rank's rows (torch.chunk's, as
    FSDP2 chunks) put in place of its meta shard, on ``shard_device`` (the host under
    cpu_offload). ``load_state_dict(assign=True)``: FSDP2's hook on it re-pads the shard and
    takes it as the one it gathers from (_fsdp_param.py reset_sharded_param)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    for s in slots:
        p = getattr(s.module, s.attr)
        # one mapping of the file per tensor: its pages leave the process's RSS when it closes
        with safe_open(str(s.file), framework="pt") as f:
            if s.quant is None:  # this rank's rows alone (torch.chunk's: ceil(rows / world) each)
                n = f.get_slice(s.key).get_shape()[0]
                step = -(-n // world)
                mine = f.get_slice(s.key)[min(n, rank * step):min(n, (rank + 1) * step)]
                # a copy: safetensors may hand back a view of the mapped file
                mine = mine.to(device=shard_device, dtype=p.dtype).clone()
            else:
                import bitsandbytes as bnb

                # transformers' Bnb4bitQuantize: the weight whole in the load's dtype, quantized where
                # it loads (so every rank's constants are the one-process run's)
                q = bnb.nn.Params4bit(f.get_tensor(s.key).to(dtype), requires_grad=False, module=s.module,
                                      **s.quant).to(device)
                q.quant_state.to(device)
                s.module.quant_state = q.quant_state
                rows = torch.chunk(q.data, world, dim=0)
                mine = (rows[rank] if rank < len(rows) else q.data[:0]).to(shard_device).clone()
                del q, rows
        if isinstance(p, DTensor):
            if tuple(p.to_local().shape) != tuple(mine.shape):
                raise RuntimeError(f"{s.key}: rank {rank}'s shard is {tuple(p.to_local().shape)}, its "
                                   f"rows {tuple(mine.shape)}")
            value = DTensor.from_local(mine, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
        else:  # not sharded (one rank's world): the weight whole
            value = mine
        new = torch.nn.Parameter(value, requires_grad=p.requires_grad)
        for mod, attr in [*s.aliases, (s.module, s.attr)]:
            mod.load_state_dict({attr: new}, strict=False, assign=True)


def config_of(model_dir: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
