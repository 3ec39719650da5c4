"""What the cuda runtime's setup loads a model with: the device (and the CUDA context it costs),
the checks before ``from_pretrained`` (an architecture transformers builds, a checkpoint it can
load), bitsandbytes' 4-bit config, PEFT's adapters on the blocks the model description names,
and the attention packed rows take. Each refuses, in one line, what it cannot do.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from finetune.backends.cuda import varlen
from finetune.backends.cuda.memory import packed_path, resolved_alloc_conf

from finetune.accounting.probes import NvmlProbe
from finetune.errors import UserError
from finetune.model.describe import EXPERTS, check_targets, lora_keys
from finetune.spec import MethodSpec, RunSpec

log = logging.getLogger("finetune")


# ---- the device ---------------------------------------------------------------------------

def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":  # under a launcher, each rank its own GPU (LOCAL_RANK)
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"backend.device={name} but no CUDA device is visible; "
                        "use backend.device=auto or cpu")
    return dev


def measure_cuda_contexts(indices: list[int]) -> dict[int, int | None]:
    """Bytes the CUDA context took on each device when this process created it: NVML's used
    memory on the device just before and just after ``torch.cuda.mem_get_info`` (which creates
    the primary context and allocates nothing through torch's allocator).

    None for a device where NVML cannot say, or where torch had already initialized CUDA (a
    context may exist already, so the difference would not be the context). A lower bound:
    kernels loaded later (CUDA lazy module loading) and library handles add to the context
    after this; another process allocating on the device at the same moment would be counted.
    """
    out: dict[int, int | None] = dict.fromkeys(indices)
    if torch.cuda.is_initialized():
        return out

    nvml = NvmlProbe()
    for i in indices:
        before = nvml.read(i, processes=False)["device_used"]
        if before is None:
            continue
        torch.cuda.mem_get_info(i)
        after = nvml.read(i, processes=False)["device_used"]
        if after is not None and after >= before:
            out[i] = after - before - torch.cuda.memory_reserved(i)
    return out


def set_alloc_conf(configured: str | None) -> None:
    """PYTORCH_CUDA_ALLOC_CONF as the plan priced it (backends/cuda/memory.py
    resolved_alloc_conf: backend.alloc_conf, else the environment's, else finetune's default),
    set before the allocator's first CUDA allocation reads it (connect runs before anything
    allocates); where CUDA is already initialized in this process, through torch's own setter
    (later allocations follow it)."""
    conf = resolved_alloc_conf(configured)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(conf)


# ---- before from_pretrained -----------------------------------------------------------------

def _check_architecture(model_dir: Path, trust_remote_code: bool) -> None:
    """UserError, naming the fix, for a config.json whose model_type transformers cannot build."""
    import json

    from transformers import CONFIG_MAPPING

    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return  # model_source has already named an unreadable config.json
    if model_type in CONFIG_MAPPING or trust_remote_code:
        return
    raise UserError(f"{model_dir}: architecture model_type={model_type!r} is not one transformers can load; "
                    "upgrade transformers, use a supported model, or set model.trust_remote_code=true if the "
                    "repository ships its own code and you trust it")


def check_loadable(spec: RunSpec, model_dir: Path, quantization: dict[str, Any] | None) -> None:
    """UserError, naming the fix, for a model this backend cannot train as asked: packing
    under the repository's own modeling code, an MLX-quantized checkpoint (``quantization``:
    the run's model handle's, located at the downloaded directory), an architecture
    transformers cannot build (read from that directory)."""
    if spec.train.packing and spec.model.trust_remote_code:
        raise UserError("train.packing with model.trust_remote_code=true: the model's own code may not keep "
                        "attention within a packed sample (transformers' position_ids path); set "
                        "train.packing=false")
    if quantization:
        raise UserError(f"{model_dir} is MLX-quantized (config.json 'quantization'), which transformers "
                        "cannot load; use backend=mlx, or the unquantized checkpoint with method=qlora")
    _check_architecture(model_dir, spec.model.trust_remote_code)


def bnb_config(m: MethodSpec, compute_dtype: torch.dtype, storage: torch.dtype | None = None) -> Any:
    """bitsandbytes' 4-bit config. ``storage``: the float dtype the packed 4-bit bytes are viewed
    as (``bnb_4bit_quant_storage``), so FSDP2 can shard them as it shards any float parameter
    (PEFT's and TRL's FSDP-QLoRA recipe); None keeps bitsandbytes' uint8."""
    from transformers import BitsAndBytesConfig

    q = m.quant
    if q.bits != 4 or q.type not in ("nf4", "fp4"):
        raise UserError(f"method=qlora on backend=cuda quantizes to 4 bits as nf4 or fp4, "
                        f"not {q.bits}-bit {q.type}; "
                        "set method.quant_bits=4 method.quant_type=nf4")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise UserError("method=qlora needs bitsandbytes: pip install '.[cuda]'") from e
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.type,
                              bnb_4bit_use_double_quant=q.double_quant,
                              bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_quant_storage=storage or torch.uint8)


# ---- after it: adapters, packed rows, what the model holds --------------------------------

def add_adapters(hf: torch.nn.Module, m: MethodSpec, prec: str, desc: Any) -> torch.nn.Module:
    """PEFT adapters on exactly the block weights the model description resolves from
    ``method.lora.keys`` (what the planner counted): modules by name, and the stacked expert
    parameters of an MoE model through ``target_parameters`` when ``experts`` is asked for."""
    import transformers
    from peft import LoraConfig, get_peft_model

    lc = m.lora
    n_layers = hf.config.num_hidden_layers
    # num_layers N > 0: adapters only on the top N decoder layers (as mlx-lm's --num-layers).
    keys = lora_keys(desc, lc.keys)
    n = lc.num_layers
    top = list(range(n_layers - n, n_layers)) if 0 < n < n_layers else None
    experts = sorted({lin.path.split("mlp.", 1)[-1] for b in desc.blocks for lin in b.linears
                      if lin.key == EXPERTS}) if EXPERTS in keys else []
    if experts and m.name == "dora":
        raise UserError("method=dora: PEFT 0.21 has no DoRA for stacked expert parameters; "
                        "drop experts from method.lora.keys or use method=lora")
    modules = [k for k in keys if k != EXPERTS]
    check_targets(desc, tuple(modules), linear_names(hf), f"transformers {transformers.__version__}")
    config = LoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                        target_modules=modules or None, target_parameters=experts or None,
                        layers_to_transform=top, bias="none", use_dora=m.name == "dora", task_type="CAUSAL_LM")
    # bf16-true keeps the adapters in bf16 too; otherwise PEFT holds them in fp32.
    return get_peft_model(hf, config, autocast_adapter_dtype=prec != "bf16-true")


def linear_names(model: torch.nn.Module) -> set[str]:
    """The leaf names of a transformers model's linear layers (``nn.Linear`` and its bitsandbytes
    subclasses, GPT-2's ``Conv1D``) but its head: what PEFT's ``target_modules`` can name in its blocks."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    return {name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
            if name and isinstance(mod, (torch.nn.Linear, Conv1D)) and mod is not head}


def _check_packing(hf: Any, device: torch.device, packed_impl: str | None = None) -> None:
    """train.packing, once before training: two short samples side by side in one row, positions
    restarting at the second, must give each sample's own logits, or the model's attention in
    transformers does not keep a packed row's samples apart (its packed-sequence path is per
    family: in transformers 5.24 gpt-oss's leaks). 12 and 10 tokens: past the 8-token sliding
    windows of the test families, so the window's mask is composed with the samples' too. Uses
    its own generator: the run's random state (adapter init, dropout) is untouched. ``packed_impl``:
    the attention implementation the packed row runs through (left set), checked against each
    sample alone through the model's own."""
    g = torch.Generator().manual_seed(0)
    vocab = int(hf.get_input_embeddings().weight.shape[0])
    a, b = (torch.randint(1, vocab, (1, n), generator=g) for n in (12, 10))
    was = hf.training
    hf.eval()
    try:
        with torch.no_grad():
            alone = torch.cat([hf(input_ids=x.to(device), use_cache=False).logits.float() for x in (a, b)], dim=1)
            if packed_impl:  # each sample alone through the model's own attention, the row through packed_impl
                hf.set_attn_implementation(packed_impl)
            pos = torch.cat([torch.arange(12), torch.arange(10)])[None].to(device)
            packed = hf(input_ids=torch.cat([a, b], dim=1).to(device), position_ids=pos,
                        use_cache=False).logits.float()  # a cache turns transformers' packed masking off
    finally:
        hf.train(was)
    scale = max(1.0, float(alone.abs().max()))
    tol = 1e-4 if next(hf.parameters()).dtype == torch.float32 else 3e-2
    diff = float((packed - alone).abs().max())
    if not diff <= tol * scale:
        raise UserError(f"train.packing: {hf.config.model_type}'s attention in transformers does not keep a packed "
                        f"row's samples apart (two samples packed differ from each alone by {diff:.3g} in the "
                        "logits); set train.packing=false")


def packed_attention(hf: Any, device: torch.device) -> str:
    """train.packing: where the model runs sdpa, its packed rows go through ``varlen`` (each
    sample through sdpa alone: no [T, T] block mask, whose masked sdpa computes every pair of
    the row); checked against each sample alone, and back to transformers' block mask where the
    model's attention does not take it (no ``position_ids`` reach it, soft-capping). Returns the
    path in words; UserError where neither keeps the samples apart."""
    impl = getattr(hf.config, "_attn_implementation", None)
    if impl == "sdpa":
        try:
            _check_packing(hf, device, packed_impl=varlen.register())
            return packed_path(impl)
        except (UserError, varlen.NoPositions, ValueError, TypeError) as e:
            log.debug("packed sdpa per sample refused (%s): transformers' block mask instead", e)
            hf.set_attn_implementation("sdpa")
    _check_packing(hf, device)
    return packed_path(str(impl), per_sample=False)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def logical_numel(p: torch.Tensor) -> int:
    """Elements a parameter stands for: a bitsandbytes Params4bit stores two 4-bit values per
    uint8, so its own numel() is half the weight's; the quant_state keeps the real shape."""
    qs = getattr(p, "quant_state", None)
    if type(p).__name__ == "Params4bit" and qs is not None:
        return int(torch.Size(qs.shape).numel())
    return p.numel()
