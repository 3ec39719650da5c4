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

An MoE's checkpoint keeps one tensor per expert (``experts.3.w1.weight``) where transformers 5
holds the experts stacked (``experts.gate_up_proj`` [E, 2 x width, hidden]): its conversion
mapping (conversion_mapping.py, ``get_model_conversion_mapping``) renames keys and merges them,
``MergeModulelist(dim=0)`` (a stack of the experts) then ``Concatenate(dim)`` (gate beside up),
each checkpoint tensor cast to the weight's dtype first. The checkpoint's names are mapped to the
model's by transformers' own ``rename_source_key`` (so the router ``block_sparse_moe.gate``
becomes ``mlp.gate`` as it does in ``from_pretrained``); a stacked parameter's rows on dim 0 are
whole experts, so ``fill`` reads this rank's experts alone, one checkpoint tensor at a time, and
copies each into its place in the rank's shard: the same bytes transformers' stack and
concatenation give (they copy, the cast is elementwise), never the other ranks' experts. Any
other conversion of a tensor the model needs (a Chunk, a Transpose, a merge on another dim) is
refused.

What it cannot do, and then the runtime loads the whole model per rank as before (said in one
log line): a checkpoint tensor that transformers converts in a way ``fill`` does not (above), a
multimodal checkpoint, a model's own remote code, packed rows (their check runs a forward before
FSDP's), an MoE family whose conversions are not known to be the two above
(``host_offload.SHARDED_LOAD_MOE``). ``host_offload.sharded_load_refusal`` (torch-free) is the
planner's side of the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune.model.safetensors_io import header, tensors_of


@dataclass
class Experts:
    """A stacked expert parameter [E, ...] that transformers builds from one checkpoint tensor per
    expert and source: ``parts`` per source pattern, in the converter's order, each expert's
    (file, key) in expert order; ``dim`` the dim of one expert's slab the parts are concatenated
    on (transformers' ``Concatenate(dim)`` less the stacked dim), None for one part stacked."""

    parts: list[list[tuple[Path, str]]]
    dim: int | None


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
    experts: Experts | None = None  # a stacked expert parameter built from per-expert tensors


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
    docstring), and the slots ``fill`` loads. Raises Refused where a weight of the model is not
    a checkpoint tensor, or is built from them in a way ``fill`` does not implement."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    index = checkpoint_index(model_dir)
    with init_empty_weights(include_buffers=False):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    hf.tie_weights()  # from_pretrained ties them as it loads (tie_word_embeddings); from_config leaves them apart
    quantizer = None
    if bnb is not None:
        from transformers.modeling_utils import local_torch_dtype
        from transformers.quantizers import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(bnb, pre_quantized=False)
        # under the load's default dtype, as from_pretrained swaps the linears (in its init
        # context): a Linear4bit's bias is made in it (bf16 q/k/v biases, not fp32)
        with local_torch_dtype(dtype):
            quantizer.preprocess_model(hf, device_map={"": str(device)}, dtype=dtype)
    sources = checkpoint_sources(hf, index, quantizer)
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
            if full not in sources:
                raise Refused(f"the model's {full} is not a tensor of the checkpoint")
            src = sources[full]
            shape = index[src][1] if isinstance(src, str) else _stacked_shape(src, index)
            if list(p.shape) != shape:
                raise Refused(f"{full}: the checkpoint's shape {shape} is not the model's {list(p.shape)}")
            quant = _quant_settings(p) if type(p).__name__ == "Params4bit" else None
            if quant is not None and not isinstance(src, str):
                raise Refused(f"{full}: a 4-bit weight transformers builds from several checkpoint tensors")
            new = _placeholder(p, quant, mod, device)
            setattr(mod, attr, new)
            if isinstance(src, str):
                slots.append(Slot(mod, attr, index[src][0], src, quant))
            else:
                slots.append(Slot(mod, attr, src.parts[0][0][0], src.parts[0][0][1], experts=src))
            done[id(p)] = (new, slots[-1])
    _load_buffers(hf, index, sources)
    if quantizer is not None:
        quantizer.postprocess_model(hf)  # is_loaded_in_4bit (PEFT's 4-bit adapters), the config's quantization
    return hf, slots


def checkpoint_sources(hf: Any, index: dict[str, tuple[Path, list[int]]],
                       quantizer: Any | None = None) -> dict[str, str | Experts]:
    """Each of the model's parameter and buffer names -> the checkpoint tensor it loads from,
    or the per-expert tensors a stacked expert parameter is built from: the checkpoint's keys
    renamed as ``from_pretrained`` renames them (transformers' own conversion mapping and
    ``rename_source_key``, core_model_loading.py convert_and_load_state_dict_in_model: every
    renaming, then at most one converter; a key the renamings take out of the model's names
    is tried as it is). Raises Refused for a converter whose operations ``fill`` does not do."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(hf, None, quantizer)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {k: c for c in converters for k in c.source_patterns}  # the last converter of a pattern, as transformers
    names: dict[str, bool] = {n: True for n, _ in hf.named_parameters(remove_duplicate=False)}
    names.update((n, True) for n, _ in hf.named_buffers(remove_duplicate=False))
    out: dict[str, str | Experts] = {}
    merged: dict[str, dict[str, list[str]]] = {}
    for key in sorted(index, key=dot_natural_key):  # transformers' order: a converter's list in expert order
        new, pattern = rename_source_key(key, renamings, converters, hf.base_model_prefix, names)
        if new not in names and key in names:
            new, pattern = rename_source_key(key, [], [], base_model_prefix=hf.base_model_prefix, meta_state_dict=names)
        if new not in names:
            continue  # a checkpoint tensor the model has no place for: from_pretrained leaves it too
        if pattern is None:
            out[new] = key
        else:
            merged.setdefault(new, {}).setdefault(pattern, []).append(key)
    for new, parts in merged.items():
        conv = by_pattern[next(iter(parts))]
        dim = expert_merge_dim(conv.operations)
        if isinstance(dim, str):
            raise Refused(f"the model's {new}: transformers builds it from the checkpoint's {conv.source_patterns} "
                          f"by {dim}, which the sharded load does not do")
        if dim is None and len(parts) != 1:
            raise Refused(f"the model's {new}: transformers stacks {len(parts)} checkpoint patterns into it")
        # Concatenate takes the sources in the converter's order (core_model_loading.py Concatenate.convert)
        keys = [parts[pat] for pat in conv.source_patterns if pat in parts]
        out[new] = Experts([[(index[k][0], k) for k in ks] for ks in keys], dim)
    return out


def expert_merge_dim(ops: list[Any]) -> int | None | str:
    """The operations of a transformers WeightConverter that ``fill`` does: ``MergeModulelist(0)``
    (the experts stacked on dim 0: None, one source) or that and ``Concatenate(d)``, d >= 1 (the
    sources side by side in each expert's slab: d - 1). Anything else: what they are, named."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    kinds = [type(op) for op in ops]
    if kinds and kinds[0] is MergeModulelist and ops[0].dim == 0:
        if len(ops) == 1:
            return None
        if len(ops) == 2 and kinds[1] is Concatenate and ops[1].dim >= 1:
            return int(ops[1].dim) - 1
    return " then ".join(f"{type(op).__name__}(dim={getattr(op, 'dim', '?')})" for op in ops) or "no operation"


def _stacked_shape(src: Experts, index: dict[str, tuple[Path, list[int]]]) -> list[int]:
    """The shape transformers' stack and concatenation give, [E, ...]: every expert's tensors
    of one part the same shape, every part the same number of experts (else Refused)."""
    shapes = []
    for part in src.parts:
        each = {tuple(index[k][1]) for _, k in part}
        if len(each) != 1 or len(part) != len(src.parts[0]):
            raise Refused(f"{part[0][1]}: the experts' tensors differ in number or shape")
        shapes.append(list(each.pop()))
    slab = shapes[0]
    if src.dim is not None:
        slab = list(slab)
        if any(len(sh) != len(slab) or sh[:src.dim] + sh[src.dim + 1:] != slab[:src.dim] + slab[src.dim + 1:]
               for sh in shapes):
            raise Refused(f"{src.parts[0][0][1]}: the parts' shapes do not concatenate")
        slab[src.dim] = sum(sh[src.dim] for sh in shapes)
    return [len(src.parts[0]), *slab]


@torch.no_grad()
def _load_buffers(hf: Any, index: dict[str, tuple[Path, list[int]]], sources: dict[str, str | Experts]) -> None:
    """The persistent buffers the checkpoint holds, whole (small; FSDP does not shard buffers)."""
    from safetensors import safe_open

    for name, mod in hf.named_modules():
        for attr, buf in mod._buffers.items():
            full = f"{name}.{attr}" if name else attr
            src = sources.get(full)
            if buf is None or attr in mod._non_persistent_buffers_set or not isinstance(src, str):
                continue
            with safe_open(str(index[src][0]), framework="pt") as f:
                buf.copy_(f.get_tensor(src).to(buf.dtype))


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
    from torch.distributed.tensor import DTensor

    for s in slots:
        p = getattr(s.module, s.attr)
        if s.experts is not None:
            mine = expert_rows(s.experts, rank, world, p.shape, p.dtype, shard_device)
        else:
            mine = rows(s, rank, world, dtype, device, shard_device, p.dtype)
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


def rank_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [lo, hi) of ``n`` that FSDP2 gives ``rank`` of ``world`` (torch.chunk on dim 0:
    ceil(n / world) each, the last ranks fewer or none)."""
    step = -(-n // world)
    return min(n, rank * step), min(n, (rank + 1) * step)


def rows(s: Slot, rank: int, world: int, dtype: torch.dtype, device: torch.device, shard_device: torch.device,
         into: torch.dtype) -> torch.Tensor:
    """This rank's rows of one checkpoint tensor (``fill``: its rows alone, cast to ``into``; a
    4-bit weight quantized whole on ``device`` first, its constants set on the module), on
    ``shard_device``."""
    from safetensors import safe_open

    # one mapping of the file per tensor: its pages leave the process's RSS when it closes
    with safe_open(str(s.file), framework="pt") as f:
        if s.quant is None:  # this rank's rows alone
            lo, hi = rank_rows(f.get_slice(s.key).get_shape()[0], rank, world)
            mine = f.get_slice(s.key)[lo:hi]
            # a copy: safetensors may hand back a view of the mapped file
            mine = mine.to(device=shard_device, dtype=into).clone()
        else:
            import bitsandbytes as bnb

            # transformers' Bnb4bitQuantize: the weight whole in the load's dtype, quantized where
            # it loads (so every rank's constants are the one-process run's)
            q = bnb.nn.Params4bit(f.get_tensor(s.key).to(dtype), requires_grad=False, module=s.module,
                                  **s.quant).to(device)
            q.quant_state.to(device)
            s.module.quant_state = q.quant_state
            chunks = torch.chunk(q.data, world, dim=0)
            mine = (chunks[rank] if rank < len(chunks) else q.data[:0]).to(shard_device).clone()
            del q, chunks
    return mine


def expert_rows(src: Experts, rank: int, world: int, shape: torch.Size, into: torch.dtype,
                shard_device: torch.device) -> torch.Tensor:
    """This rank's experts of a stacked parameter (torch.chunk's rows on dim 0, as FSDP2 shards
    it: ceil(E / world) experts a rank, the last ranks fewer or none), each read from its own
    checkpoint tensors, one at a time: cast to the parameter's dtype as transformers casts each
    before it merges them (core_model_loading.py spawn_materialize), and copied into its place
    in the expert's slab (MergeModulelist's stack, Concatenate's parts in order)."""
    from safetensors import safe_open

    lo, hi = rank_rows(shape[0], rank, world)
    out = torch.empty((hi - lo, *shape[1:]), dtype=into, device=shard_device)
    for i, e in enumerate(range(lo, hi)):
        at = 0
        for part in src.parts:
            file, key = part[e]
            with safe_open(str(file), framework="pt") as f:  # one mapping per tensor, closed after it
                one = f.get_tensor(key).to(into)
                if src.dim is None:
                    out[i].copy_(one)
                else:
                    out[i].narrow(src.dim, at, one.shape[src.dim]).copy_(one)
                    at += one.shape[src.dim]
                del one
    return out


def config_of(model_dir: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
