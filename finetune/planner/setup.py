"""What the planner prices: the architecture, the resolved setup and the parameter inventory.

Generic: the backend's own knowledge (dtypes it stores, quantization, where it runs) comes from
its memory model, ``finetune/backends/<name>/memory.py``, which ``memory_model`` loads.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from finetune import precision as prec_mod
from finetune.backends import capabilities, memory_model
from finetune.errors import UserError
from finetune.model.source import checkpoint_elements, is_multimodal, read_model_config, stored_dtype, stored_quantization
from finetune.model.types import ModelDesc, ModelHandle
from finetune.model.describe import _EAGER_ONLY, HEAD, describe, lora_keys, reconcile
from finetune.model.inventory import DTYPE_BYTES, GIB, MIB, Setup, Tensor  # noqa: F401  (re-exported: the planner's names)
from finetune.spec import ModelSpec, RunSpec

SCHEMA_VERSION = 1

# Full fine-tuning: gradients grow while activations are freed, layer by layer, so the peak of
# forward+backward is below activations + gradients. Measured (mlx) ~ max + half of min.
GRAD_ACTIVATION_OVERLAP = 0.5


# ---- the model ---------------------------------------------------------------------------------

def describe_model(model: ModelSpec, model_dir: Any = None) -> ModelHandle:
    """The model's handle: ``describe`` of its config.json (``read_model_config``), the dtype
    and quantization it stores, and, for a family not described exactly, held against its
    checkpoint's safetensors headers where this machine has them (``reconcile``; a multimodal
    checkpoint's language model alone; not a quantized checkpoint, whose packed tensors count
    otherwise, nor a what-if of overridden facts, which no checkpoint holds). A run builds it
    once (the resolver), and locates it at the model's directory (``locate_model``)."""
    got = read_model_config(model, model_dir)
    hf = got.config
    arch = describe(hf, got.where)
    if got.overridden:
        facts = ", ".join("model.config." + o for o in got.overridden)
        note = (f"planned with {facts} over the checkpoint's config.json: a what-if (a run trains the checkpoint "
                "as it is, and refuses it)")
        arch = replace(arch, notes=(*arch.notes, note))
    handle = ModelHandle(desc=arch, config=hf, config_path=str(got.path) if got.path is not None else None,
                         stored_dtype=stored_dtype(model, model_dir, local=got.local),
                         quantization=stored_quantization(model, model_dir, local=got.local),
                         overridden=got.overridden,
                         directory=str(model_dir) if model_dir is not None else None)
    return _reconciled(handle, model, model_dir)


def _reconciled(handle: ModelHandle, model: ModelSpec, model_dir: Any) -> ModelHandle:
    """``handle`` held against its checkpoint's tensors where it needs it and they were not read yet."""
    hf, arch = handle.config, handle.desc
    if arch.described or handle.elements is not None or handle.overridden \
            or "quantization" in hf or "quantization_config" in hf:
        return handle
    found = checkpoint_elements(model, model_dir, text_only=is_multimodal(hf))
    return replace(handle, desc=reconcile(arch, found), elements=found) if found is not None else handle


def locate_model(handle: ModelHandle | None, model: ModelSpec, model_dir: Any) -> ModelHandle:
    """The run's handle at the model's directory ``model_dir`` (downloaded, or the tiny model
    built): the same description where that directory's config.json is the one described
    (its tensors read now where a family not described exactly needs them), else described
    anew from that directory (a config.json the first description could not read: a preset's
    facts stood in for a hub checkpoint not yet downloaded)."""
    cj = Path(str(model_dir)) / "config.json"
    if handle is not None and handle.config_path is not None and Path(handle.config_path).resolve() == cj.resolve():
        if handle.directory is not None and Path(handle.directory).resolve() == Path(str(model_dir)).resolve():
            return handle
        return _reconciled(replace(handle, directory=str(model_dir)), model, model_dir)
    return describe_model(model, model_dir)


def model_handle(spec: RunSpec, model_dir: Any = None) -> ModelHandle:
    """The run's model handle (``RunSpec.model_handle``, located at ``model_dir`` where given),
    or, for a spec the resolver could not describe, one described now."""
    handle = spec.model_handle
    if model_dir is None:
        return handle if handle is not None else describe_model(spec.model)
    return locate_model(handle, spec.model, model_dir)


# ---- the resolved setup -----------------------------------------------------------------------

ATTENTION_CHOICES = ("auto", "sdpa", "eager", "flash_attention_2")


def attention(desc: ModelDesc, wanted: str) -> str:
    """The attention implementation the run uses: ``auto`` is transformers' own choice for the
    model (sdpa where its modeling code supports it, else eager; flash_attention_2 only when
    asked for). Refuses one the model does not support, in one line."""
    if wanted not in ATTENTION_CHOICES:
        raise UserError(f"backend.attn_implementation={wanted} is not valid; choose one of: {', '.join(ATTENTION_CHOICES)}")
    if wanted == "auto":
        return desc.attn_default
    if wanted != "eager" and desc.model_type in _EAGER_ONLY:
        raise UserError(f"backend.attn_implementation={wanted}: transformers runs {desc.model_type} only with eager "
                        f"attention ({_EAGER_ONLY[desc.model_type]}); use backend.attn_implementation=auto (or eager)")
    return wanted


def _packed_setup(setup: Setup, spec: RunSpec, state: Any, seq_len: int | None, pair_span: float | None = None,
                  row_targets: int | None = None, longest: int | None = None) -> None:
    """train.packing: price one row per micro-batch, as wide as ``seq_len`` when given (the
    longest packed micro-batch the data gives, ``finetune.data`` ``max_micro_tokens``), else
    ``tokens_per_micro``; the row's block mask is a [1, 1, T, T] bool on cuda (transformers
    builds it from position_ids for sdpa and eager). The head runs on target rows unless the
    cuda loss is compiled or sharded (backends/cuda/runtime.py _loss_sum): at most
    ``row_targets`` of them where the data says so (``max_micro_targets``: the most targets a
    packed micro-batch of the run's steps holds), else the share ``head_fraction`` bounds."""
    t = spec.train
    caps = capabilities(setup.backend)
    if not caps.chunked_loss_with_compile and (t.compile or (setup.strategy == "fsdp" and setup.world_size > 1)):
        setup.target_head = False
    tokens = state.tokens_per_micro if state is not None else t.packed_tokens
    if not tokens:
        return
    effective = setup.effective_batch
    width = int(seq_len) if seq_len else tokens
    setup.packed, setup.batch, setup.seq_len = True, 1, width
    # a packed row's longest sample is cut at train.seq_len (and a pad segment is no longer
    # than its step's longest sample, backends/base.py pack_layout); the data's own longest
    # where it was read
    setup.longest_sample = min(width, t.seq_len, int(longest) if longest else t.seq_len)
    # the data's own span and targets where they were measured at these tokens per micro-batch
    # (the governor may have lowered them since: a smaller row may hold a larger share)
    setup.pair_span = setup.longest_sample
    if pair_span and tokens == t.packed_tokens:
        setup.pair_span = min(setup.pair_span, math.ceil(pair_span))
    if row_targets and tokens == t.packed_tokens:
        setup.target_fraction = min(setup.target_fraction, int(row_targets) / max(1, width - 1))
    # micro-batches per step: the step's samples at the widest over the packed width (at
    # least 2 wherever they do not fit one: gradients then accumulate)
    setup.grad_accum = max(1, -(-effective * t.seq_len // tokens))
    setup.padding_mask = caps.packed_block_mask


def _dtypes(backend: str, precision: str, method: str, stored: str, dtype_source: str,
            notes: list[str]) -> Any:
    """The dtypes both runtimes load with (finetune/precision.py), noting what precision=auto
    chose from the checkpoint's stored dtype."""
    dt = prec_mod.resolve(backend, precision, method, stored)
    if dt.note:
        notes.append(dt.note)
    if precision == "auto":
        notes.append(f"precision=auto: the checkpoint stores {stored} ({dtype_source}); weights {dt.weights}"
                     + (f", adapters {dt.adapters}" if method in ("lora", "dora", "qlora") else ""))
    return dt


def _adapted_layers(method: str, n: int, layers: int, notes: list[str]) -> tuple[int, ...]:
    """Indices of the layers that carry adapters (every layer for full fine-tuning):
    ``method.lora.num_layers`` = ``n`` top layers, all of them for n <= 0 or n >= ``layers``."""
    if method == "full" or n <= 0 or n >= layers:
        # PEFT layers_to_transform=None and mlx-lm linear_to_lora_layers(model.layers[-max(n, 0):])
        # both adapt every layer for n <= 0 (mlx: -1 -> layers[0:]).
        if method != "full" and n > layers:
            notes.append(f"method.lora.num_layers={n} exceeds the model's {layers} layers (mlx refuses it)")
        return tuple(range(layers))
    return tuple(range(layers - n, layers))


def _pre_quantized_base(setup: Setup) -> None:
    """A pre-quantized checkpoint's own quantization, as mlx_lm.load rebuilds it (QuantizedLinear /
    QuantizedEmbedding); method=qlora quantizes nothing more."""
    if setup.pre_quant:
        setup.quant_bits, setup.quant_group = setup.pre_quant["bits"], setup.pre_quant["group_size"]
        setup.notes.append(f"model is pre-quantized ({setup.pre_quant['bits']}-bit, group "
                           f"{setup.pre_quant['group_size']}, from {setup.pre_quant['source']}): "
                           "LoRA trains on the quantized base")


def resolve(spec: RunSpec, seq_len: int | None = None, state: Any = None,
            head_fraction: float | None = None, pair_span: float | None = None,
            row_targets: int | None = None, longest: int | None = None, pairs: int | None = None,
            pair_positions: int | None = None) -> tuple[ModelDesc, Setup]:
    """Resolve the spec (and the machine, for the GPU count) into an architecture and a setup.
    ``state`` (a finetune.run.state.RunState) overrides the backend, micro-batch, accumulation,
    checkpointing and loss chunk with the run's live values. ``head_fraction``: the share of a
    micro-batch's positions that are targets at most, from the data (``finetune.data.build``
    ``head_fraction``); None: every position, the bound without data. Packed, from the data
    too: ``pair_span``, ``row_targets`` (the most targets of a packed micro-batch) and
    ``longest`` (the longest sample), see ``_packed_setup``. A preference run's, from the data
    too: ``pairs`` (the data's pairs: a precomputed reference's log-probs) and ``pair_positions``
    (the most a pair takes with its prompt once; None: its two padded rows, the bound). Raises UserError for a
    combination the backend would refuse (finetune.resolver runs this once as a check)."""
    handle = model_handle(spec)
    arch, hf = handle.desc, handle.config
    backend = state.backend if state is not None else spec.backend.resolved
    m, o, t = spec.method, spec.optim, spec.train
    method, optim, precision = m.name, o.name, spec.precision.name
    if method not in ("lora", "dora", "qlora", "full"):
        raise UserError(f"method={method} is not valid; choose one of: lora, dora, qlora, full")
    notes: list[str] = []
    stored, dtype_source = handle.stored_dtype
    pre_quant = handle.quantization
    mm = memory_model(backend)
    mm.pre_quantized(spec, pre_quant)
    device, n_devices, dev_notes = mm.resolve_device(spec, spec.mode, method)
    notes += dev_notes
    world_size, strategy = mm.ranks(spec)  # the backend's refusals for a strategy come from here
    dt = _dtypes(backend, precision, method, stored, dtype_source, notes)
    weight_dtype, adapter_dtype, compute_dtype = dt.weights, dt.adapters, dt.compute
    autocast = dt.autocast is not None
    lc = m.lora
    keys = lora_keys(arch, lc.keys)
    if method != "full":
        mm.check_lora_keys(keys)  # what the backend's library cannot adapt, in one line
    layers = _adapted_layers(method, lc.num_layers, arch.layers, notes)
    T = int(seq_len) if seq_len else t.seq_len
    # transformers' attention choice; a backend with its own attention (mlx) names it in its memory model
    attn = attention(arch, spec.backend.attn_implementation) if mm.ATTENTION_LABEL is None else "sdpa"
    mm.check_model(hf, T)  # a family the backend's library cannot load faithfully: one line
    offload = state.activation_offload if state is not None else t.activation_offload
    if offload and capabilities(backend).no_activation_offload:
        raise UserError(f"train.activation_offload=true: {capabilities(backend).no_activation_offload}")
    if spec.backend.cpu_offload and capabilities(backend).no_cpu_offload:
        raise UserError(f"backend.cpu_offload=true: {capabilities(backend).no_cpu_offload}")
    setup = Setup(
        backend=backend, device=device, n_devices=n_devices, method=method, optim=optim, precision=precision,
        weight_dtype=weight_dtype, adapter_dtype=adapter_dtype, compute_dtype=compute_dtype, autocast=autocast,
        rank=lc.rank, dropout=lc.dropout, keys=keys, lora_layers=layers,
        quant_bits=m.quant.bits, quant_group=m.quant.group_size, quant_type=m.quant.type,
        double_quant=m.quant.double_quant,
        batch=state.micro_batch if state is not None else t.batch_size, seq_len=T,
        grad_accum=state.grad_accum if state is not None else t.grad_accum,
        ckpt=state.grad_checkpointing if state is not None else t.grad_checkpointing, attn=attn,
        offload=offload,
        momentum=o.momentum, clip=o.max_grad_norm is not None,
        budget_text=spec.memory.budget, notes=notes, dtype_source=dtype_source,
        pre_quant=pre_quant if capabilities(backend).pre_quantized else None, world_size=world_size,
        strategy=strategy,
        loss_chunk=state.loss_chunk if state is not None else t.loss_chunk,
        padding_mask=spec.model.trust_remote_code,
        alloc_conf=mm.alloc_conf(spec), empty_cache_every=spec.memory.empty_cache_every, fused=o.fused,
        cpu_offload=spec.backend.cpu_offload or bool(state is not None and state.cpu_offload),
    )
    if head_fraction is not None:
        setup.target_fraction = max(0.0, min(1.0, float(head_fraction)))
    _packed_setup(setup, spec, state, seq_len, pair_span, row_targets, longest)
    _pre_quantized_base(setup)
    _objective(setup, spec)
    setup.pairs_total, setup.pair_positions = int(pairs or 0), int(pair_positions or 0)
    setup.pair_row_each = bool(getattr(mm, "pair_row_each", lambda a, s: False)(arch, setup))
    setup.shard_loadable = mm.shard_loadable(arch, hf, setup)
    return arch, setup


def _objective(setup: Setup, spec: RunSpec) -> None:
    """A preference objective's setup (finetune/planner/preference.py prices it): ``batch``
    counts pairs (train.batch_size does, finetune/data/pairs.py), each two rows of the model's
    batch (KTO's unpaired samples, one); its reference as objective.reference chooses it."""
    obj = spec.objective
    if not obj.preference:
        return
    setup.objective = obj.name
    setup.pair_rows = 1 if obj.name == "kto" else 2
    setup.reference_choice = obj.reference if obj.needs_reference else ""



# ---- the parameter inventory -------------------------------------------------------------------

def inventory(arch: ModelDesc, s: Setup) -> list[Tensor]:
    """Every parameter the backend would create, with what trains and how it is stored.

    Follows the model description (finetune/model/describe.py: every weight of the
    checkpoint's blocks, experts and routers included), plus the adapters: PEFT
    LoraLayer.update_layer (lora_A [r, in], lora_B [out, r], no bias; DoRA:
    lora_magnitude_vector [out]) and mlx-lm tuner/lora.py LoRALinear (lora_a [in, r], lora_b
    [r, out]) / tuner/dora.py DoRALinear (m [out]); counts are identical, shapes transposed.
    Stacked expert parameters are adapted as each backend's library does it (the memory model's
    ``expert_adapters``).
    """
    full = s.method == "full"
    wd, ad = s.wd, s.ad
    h, V = arch.hidden, arch.vocab
    adapted = set(s.lora_layers) if s.adapters else set()
    out: list[Tensor] = []

    mm = memory_model(s.backend)

    def quant_of(role: str, in_f: int) -> str | None:
        return mm.quant_of(s, role, in_f)

    out.append(Tensor("model.embed_tokens.weight", (V, h), None, "embed", full, wd, quant_of("embed", h)))
    for i, block in enumerate(arch.blocks):
        p = f"model.layers.{i}."
        for path, shape, kind, _, _ in block.others:
            out.append(Tensor(p + path, shape, i, kind, full, wd))
        for lin in block.linears:
            base = p + lin.path
            expert = lin.experts > 1
            shape = (lin.experts, lin.out_f, lin.in_f) if expert else (lin.out_f, lin.in_f)
            role = "expert" if expert else "router" if lin.kind == "router" else "linear"
            # an nn.Linear is quantized as one whatever its kind (Qwen2-MoE's shared_expert_gate)
            out.append(Tensor(base + ("" if expert else ".weight"), shape, i, role, full, wd,
                              quant_of("linear" if lin.module and not expert else role, lin.in_f)))
            if lin.bias:
                out.append(Tensor(base + ".bias", (lin.out_f,), i, "bias", full, wd))
            if i not in adapted or lin.key not in s.keys:
                continue
            if expert:
                for suffix, ashape in mm.expert_adapters(lin, s.rank):
                    out.append(Tensor(base + suffix, ashape, i, "lora_A" if "lora_a" in suffix.lower() else "lora_B",
                                      True, ad))
                continue
            out.append(Tensor(base + ".lora_A", (s.rank, lin.in_f), i, "lora_A", True, ad))
            out.append(Tensor(base + ".lora_B", (lin.out_f, s.rank), i, "lora_B", True, ad))
            if s.method == "dora":
                # mlx DoRALinear.set_linear: m = norm(weight.astype(float32)) -> fp32, then
                # set_dtype for bf16-true; PEFT: same dtype as the other adapter weights.
                out.append(Tensor(base + ".magnitude", (lin.out_f,), i, "dora_m", True, ad))
    for path, shape, kind, _, _ in arch.top:
        out.append(Tensor(path, shape, None, kind, full, wd))
    if not arch.tie:
        out.append(Tensor("lm_head.weight", (V, h), None, "lm_head", full, wd, quant_of("lm_head", h)))
    if s.adapters and HEAD in s.keys:  # PEFT's LoRA on the output head (a tied head's module too)
        out.append(Tensor("lm_head.lora_A", (s.rank, h), None, "lora_A", True, ad))
        out.append(Tensor("lm_head.lora_B", (V, s.rank), None, "lora_B", True, ad))
        if s.method == "dora":
            out.append(Tensor("lm_head.magnitude", (V,), None, "dora_m", True, ad))
    return out
