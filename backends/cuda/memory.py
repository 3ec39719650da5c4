"""The cuda backend's memory model, torch-free: what torch, transformers, PEFT and
bitsandbytes hold for each tensor, optimizer state and activation. The planner
(finetune/planner) prices a parameter inventory with these functions; nothing here imports
torch, so `finetune mode=plan` stays light.

Versions modelled: torch 2.13, transformers 5.24, peft 0.21, bitsandbytes 0.50, accelerate 1.15.
Every figure is an int of bytes; constants cite the code they come from.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

from finetune.errors import UserError
from finetune.model.types import (
    Linear,
    ModelDesc,
)
from finetune.model.inventory import MIB, Setup, Tensor
from finetune.records import PlanData
from finetune.spec import RunSpec
from finetune.backends.cuda import host_offload, trace
from finetune.backends.cuda.activations import (  # noqa: F401  (the memory model's names)
    OFFLOAD_MIN_BYTES,
    layer_bytes,
    layer_tensors,
    offloaded,
    reference_pass,
)
from finetune.backends.cuda.alloc_config import parse_alloc_conf
from finetune.backends.cuda.capabilities import CAPABILITIES
from finetune.budget import DeviceMemory, cuda_devices, host_memory

# ---- constants ------------------------------------------------------------------------------------

# bitsandbytes 0.50 constants (bitsandbytes/functional.py quantize_4bit: default blocksize 64;
# compress_statistics -> quantize_blockwise(absmax, blocksize=256); optim/optimizer.py
# Optimizer2State.init_state: 8-bit state blocksize 256, min_8bit_size 4096;
# Optimizer8bit.get_state_buffer: paged only when numel >= 1e5).
BNB_4BIT_BLOCK = 64
BNB_NESTED_BLOCK = 256
BNB_4BIT_CODE_BYTES = 16 * 4  # QuantState.code: the 16-entry fp32 NF4/FP4 table, one per weight
BNB_NESTED_CODE_BYTES = 256 * 4  # state2.code: a copy of the 256-entry dynamic map (copy=True)
BNB_OPT_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_PAGED_MIN_NUMEL = 100_000
BNB_QMAPS_BYTES = 2 * 256 * 4  # name2qmap["dynamic"] and ["udynamic"], shared by every 8-bit state
CUDA_CONTEXT_BYTES = 500 * MIB  # estimate: CUDA context + cuBLAS/cuDNN handles, outside torch's allocator
# The device level, as NVML shows it (benchmarks/results/gpu_check_h200.txt: torch 2.11 + CUDA 13.0
# on an H200): the context measured when torch created it, 524 MiB; what the driver loads after
# that (CUDA's lazy module loading, CUDA_MODULE_LOADING=LAZY, loads each kernel's module on its
# first launch, and library handles grow), 229 MiB after ten steps of a full fine-tune (227 MiB
# for a LoRA run, 252 MiB for the paged one: the smallest two agree).
CUDA_CONTEXT_MEASURED_BYTES = 524 * MIB
CUDA_LAZY_MODULES_BYTES = 229 * MIB
# NCCL (docs: NCCL_BUFFSIZE, default 4 MiB per channel and peer, for its Simple protocol, beside
# LL128's ~4.5 MiB and LL's 256 KiB): a ring rank talks to two peers over up to 16 channels on
# NVLink machines: 2 x 16 x ~8.75 MiB. An estimate, said in the plan; gloo keeps its buffers on
# the host.
NCCL_BUFFERS_BYTES = 2 * 16 * (4 * MIB + 4608 * 1024 + 256 * 1024)
# The host (RSS) of a run's process before its weights: the interpreter with torch, transformers,
# PEFT, bitsandbytes and finetune imported, measured on this project's CPU box (torch 2.13 CPU
# build: 453 MiB); on a GPU the CUDA runtime's host side adds to it (the H200 run's RSS was
# 1.54 GiB at its end, its weights on the GPU and its checkpoint files closed).
HOST_BASE_CPU_BYTES = 453 * MIB
HOST_BASE_CUDA_BYTES = 1577 * MIB
# What the libraries take on the host at a run's first steps beyond the weights and state (their
# first use: kernels' and autograd's buffers, gloo's), on the CPU: the RSS growth from just
# before the load to after the last of 3-5 steps, the C heap trimmed, of two gloo ranks of
# FSDP whose shards and state are under 1 MiB (tests/dist_scripts/torch_rank_memory.py, this
# box, Dec 6 2026): tiny lora 22, tiny qlora 23, tiny Llama qlora 24, tiny Mixtral qlora 26-27
# MiB per rank; the median. Priced where it was measured, FSDP with cpu_offload on the CPU
# (the other CPU plans, the golden ones among them, are as they were): section 4 of
# benchmarks/results/fsdp_sharded_load_cpu.txt.
HOST_FIRST_STEPS_CPU_BYTES = 24 * MIB
CUDA_ALLOC_ROUND = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: every block is a multiple of 512 B


def bnb4_bytes(numel: int, double_quant: bool, blocksize: int = BNB_4BIT_BLOCK) -> tuple[int, int]:
    """(packed weight bytes, quantization-constant bytes) of one bitsandbytes 4-bit weight.

    bitsandbytes/functional.py quantize_4bit: two 4-bit codes per uint8 (quant_storage=uint8);
    one fp32 absmax per ``blocksize`` elements; with compress_statistics (double quant) the
    absmax are themselves quantize_blockwise'd to uint8 in blocks of 256 (state2: fp32 absmax
    per 256 blocks + a copy of the 256-entry fp32 code) and centred by a 0-d fp32 offset. Each
    QuantState also holds the 16-entry fp32 NF4/FP4 code.
    """
    packed = (numel + 1) // 2
    blocks = -(-numel // blocksize)
    if double_quant:
        consts = blocks + (-(-blocks // BNB_NESTED_BLOCK)) * 4 + BNB_NESTED_CODE_BYTES + 4
    else:
        consts = blocks * 4
    return packed, consts + BNB_4BIT_CODE_BYTES



# ---- resolving the device ------------------------------------------------------------------------

def resolve_device(spec: RunSpec, mode: str, method: str) -> tuple[str, int, list[str]]:
    """(device, GPUs the model is split over, notes) for this config, and the refusals the
    runtime would give. In ``mode=plan``, ``backend=cuda`` means a GPU whether or not this
    machine has one (``backend.device=cpu`` plans the CPU run); ``backend.num_devices`` plans a
    ``device_map=auto`` split over N GPUs this machine need not have."""
    b, q = spec.backend, spec.method.quant
    want_device = b.device
    count, _ = cuda_devices()
    if mode == "plan" and b.name == "cuda" and want_device == "auto":
        device = "cuda"
    else:
        device = run_device(want_device)
    split = b.device_map == "auto" and device == "cuda"
    n_wanted = spec.world.num_devices
    n_devices = (int(n_wanted) if n_wanted else max(count, 1)) if split else 1
    notes = []
    if split and count == 0 and not n_wanted:
        notes.append("backend.device_map=auto: no GPU visible here, planned for 1 device "
                     "(set backend.num_devices=N to plan a split over N GPUs)")
    bits, qtype = q.bits, q.type
    if method == "qlora" and (bits != 4 or qtype not in ("nf4", "fp4")):
        raise UserError("method=qlora on backend=cuda quantizes to 4 bits as nf4 or fp4; "
                        "set method.quant_bits=4 method.quant_type=nf4")
    return device, n_devices, notes


def check_lora_keys(keys: tuple[str, ...]) -> None:
    """PEFT adapts any of the description's keys, the output head included."""


def shard_loadable(arch: ModelDesc, hf: dict[str, Any], s: Setup) -> bool:
    """fsdp's sharded load (backends/cuda/sharded_load.py) can apply (host_offload.sharded_load
    says where it does: under FSDP)."""
    return host_offload.sharded_load_refusal(
        arch.experts, hf, s.padding_mask, s.packed) is None


def check_model(hf: dict[str, Any], seq_len: int) -> None:
    """Nothing to refuse before loading: transformers builds any model_type it knows (the
    runtime names one it does not, with the fix, when it loads)."""


def pre_quantized(spec: RunSpec, quant: dict[str, Any] | None) -> None:
    """An MLX pre-quantized checkpoint: transformers cannot load it."""
    if quant:
        raise UserError(f"model.path={spec.model.path} is MLX-quantized ({quant['bits']}-bit, "
                        "config.json 'quantization'), which transformers cannot load; use backend=mlx, "
                        "or the unquantized checkpoint with method=qlora")


def packed_attention(s: Setup, arch: ModelDesc) -> str:
    """The attention path that keeps packed samples apart, in words (the runtime's own; the
    attention implementation ``s.attn`` already says what the model runs)."""
    return packed_path(s.attn)


def packed_path(attn: str, per_sample: bool = True) -> str:
    """The path a packed row takes under attention implementation ``attn``, in words: the plan's
    (``packed_attention``) and the runtime's, which says ``per_sample=False`` where the model's
    attention refused backends/cuda/varlen.py and kept transformers' block mask."""
    if attn.startswith("flash"):
        return f"{attn} varlen (cu_seqlens from position_ids)"
    if attn == "sdpa" and per_sample:  # backends/cuda/varlen.py: no mask is built
        return "sdpa per sample (positions from position_ids; no block mask)"
    return f"{attn} with transformers' [1, 1, T, T] block-diagonal causal mask built from position_ids"


def run_device(device: str = "auto") -> str:
    """``backend.device`` -> "cuda" or "cpu": auto is a GPU where NVML sees one."""
    if device == "auto":
        return "cuda" if cuda_devices()[0] > 0 else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def device_memory(device: str) -> Any:
    """Memory of one device of the run: a GPU's total from NVML, or the host's RAM."""
    if device.startswith("cuda"):
        count, total = cuda_devices()
        return DeviceMemory(total, max(count, 1), "nvml" if total else "unknown", False)
    return host_memory()


# ---- weights ---------------------------------------------------------------------------------------

def quant_of(s: Setup, role: str, in_f: int) -> str | None:
    """How ``method=qlora`` stores a weight of this role: transformers
    integrations/bitsandbytes.py replace_with_bnb_linear quantizes only nn.Linear, minus
    get_keys_to_not_convert (lm_head / tied output embeddings)."""
    return "bnb4" if s.method == "qlora" and role == "linear" else None


def expert_adapters(lin: Linear, rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """The adapter tensors PEFT 0.21 builds on a stacked expert parameter [E, out, in]
    (``target_parameters``; tuners/lora/layer.py ParamWrapper): lora_A [E x r, in] and
    lora_B [out, E x r] (checked on transformers 5.24's Mixtral, Qwen3-MoE and gpt-oss)."""
    return [(".lora_A", (lin.experts * rank, lin.in_f)), (".lora_B", (lin.out_f, lin.experts * rank))]


def bnb4_storage(t: Tensor, s: Setup) -> tuple[int, int]:
    """(rows, bytes a row) of a 4-bit weight as FSDP2 shards it: the runtime stores the packed
    bytes viewed as the dtype FSDP gathers in (``bnb_4bit_quant_storage``: the autocast dtype,
    else the weights'; bitsandbytes Params4bit._quantize ``w_4bit.view(quant_storage)``), a
    [packed / itemsize, 1] tensor whose rows FSDP splits like any other's."""
    item = s.a if s.autocast else s.wd
    return -(-((t.numel + 1) // 2) // item), item


def weight_bytes(t: Tensor, s: Setup) -> tuple[int, int]:
    """(bytes of the tensor itself on one rank, bytes of its quantization constants). Under
    fsdp a 4-bit weight's rows are sharded; its QuantState (absmax, codes) is not a parameter,
    so every rank keeps all of it (Linear4bit.quant_state)."""
    if t.quant == "bnb4":
        packed, consts = bnb4_bytes(t.numel, s.double_quant)
        if t.shards > 1:
            rows, item = bnb4_storage(t, s)
            packed = -(-rows // t.shards) * item
        return packed, consts
    return t.local_numel * t.dtype_bytes, 0


def rounding_bytes(nbytes: int, s: Setup) -> int:
    """What the caching allocator adds to a persistent tensor: blocks are multiples of 512 B
    on a GPU; nothing is rounded on the CPU."""
    return (-nbytes) % CUDA_ALLOC_ROUND if s.device == "cuda" else 0


# ---- optimizer state -------------------------------------------------------------------------------

def optimizer_state_bytes(optim: str, shape: tuple[int, ...], dtype_bytes: int, on_gpu: bool,
                          momentum: float = 0.0, host_step: bool = False) -> tuple[int, int]:
    """(allocator-held bytes, paged bytes) of one trainable tensor's optimizer state.

    Args:
        optim: one of CAPABILITIES.optimizers.
        shape: the parameter's shape.
        dtype_bytes: the parameter's element size.
        on_gpu: bitsandbytes pages state only on CUDA (on CPU get_state_buffer falls back).
        momentum: sgd momentum.
        host_step: torch keeps Adam's per-tensor ``step`` on the host; when the parameters are
            on the CPU too, that 4-byte scalar sits beside them (count it).
    """
    n = math.prod(shape)
    if optim in ("adamw", "adam"):
        # torch/optim/adam.py Adam._init_group: exp_avg, exp_avg_sq = zeros_like(p) (param dtype);
        # `step` is a host scalar unless capturable/fused.
        return 2 * n * dtype_bytes + (4 if host_step else 0), 0
    if optim == "sgd":
        # torch/optim/sgd.py: momentum_buffer = clone(grad) only when momentum != 0.
        return (n * dtype_bytes, 0) if momentum else (0, 0)
    if optim == "adafactor":
        # transformers/optimization.py Adafactor.step: grad.float() for 16-bit params, state
        # .to(grad) -> fp32; factored: exp_avg_sq_row [rows] + exp_avg_sq_col [cols]; beta1=None:
        # no exp_avg; state["RMS"] = self._rms(p) is a 0-d fp32 tensor on the parameter's device.
        factored = len(shape) >= 2
        elems = (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if factored else n
        return elems * 4 + 4, 0
    if optim in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw"):
        paged = optim.startswith("paged") and on_gpu and n >= BNB_PAGED_MIN_NUMEL
        eight = optim != "paged_adamw" and n >= BNB_MIN_8BIT_SIZE
        if eight:
            # Optimizer2State.init_state: state1/state2 uint8 (get_state_buffer: paged if big)
            # + absmax1/absmax2 fp32 per 256-element block (never paged).
            states = 2 * n
            absmax = 2 * (-(-n // BNB_OPT_BLOCK)) * 4
            return (absmax, states) if paged else (absmax + states, 0)
        # numel < min_8bit_size (or 32-bit paged AdamW): fp32 state1/state2 whatever the param dtype.
        states = 2 * n * 4
        return (0, states) if paged else (states, 0)

    raise UserError(f"optim={optim} is not valid; choose one of: {', '.join(CAPABILITIES.optimizers)}")


def adam_fused(s: Setup) -> bool:
    """Whether the runtime steps Adam/AdamW with torch's fused kernel (backends/cuda/optimizers.py
    ``_fused``): ``optim.fused``, on plain tensors on the CPU or a GPU; FSDP's DTensor shards keep
    torch's default (foreach)."""
    return s.fused and not (s.strategy == "fsdp" and s.world_size > 1)


def optimizer_shared_bytes(s: Setup, trainable: list[Tensor]) -> int:
    """State shared by every tensor, held once on the first device: bitsandbytes' 8-bit maps."""
    if s.optim in ("adamw_8bit", "paged_adamw_8bit") and any(t.local_numel >= BNB_MIN_8BIT_SIZE for t in trainable):
        return BNB_QMAPS_BYTES
    return 0


def optimizer_transient(s: Setup, trainable: list[Tensor]) -> int:
    """Workspace the optimizer step allocates on top of weights, grads and state."""
    if not trainable:
        return 0
    # per rank: under FSDP the optimizer steps each parameter's local shard (a DTensor's
    # _local_tensor), so every size here is the local one
    largest = max(t.local_numel * t.dtype_bytes for t in trainable)
    if s.optim in ("adamw", "adam") and adam_fused(s):
        return 0  # torch/optim/adam.py _fused_adam: one kernel per tensor group, no workspace
    if s.optim in ("adamw", "adam") and s.device == "cuda":
        # torch/optim/adam.py _multi_tensor_adam (foreach, torch's CUDA default, kept for FSDP's
        # DTensor shards): exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs) allocates one
        # more state-sized list.
        return sum(t.local_numel * t.dtype_bytes for t in trainable)
    if s.optim == "adafactor":
        # transformers Adafactor.step: fp32 `update` (grad**2 + eps, then the approximation)
        # and p.float() copies for 16-bit params, one parameter at a time.
        return 3 * max(t.local_numel for t in trainable) * 4
    # per-tensor kernels (torch single-tensor path on CPU; bitsandbytes fused 8-bit/32-bit)
    return largest if s.optim in ("adamw", "adam", "sgd") else 0


# ---- activations -----------------------------------------------------------------------------------

# A preference step (backends/cuda/preference.py ``_row_logps``) runs the head on the
# completion's target positions only (the SFT target head's gathered rows, then log_softmax and
# the targets gathered), never chunked: priced as SFT's target head at 2P rows with
# train.loss_chunk off (finetune/planner/preference.py rows_setup).
PAIR_HEAD_WHOLE = False
# precompute_reference keeps its table as a numpy array: host memory, never the device's
REFERENCE_TABLE_WHERE = "host"


def pair_row_each(arch: ModelDesc, s: Setup) -> bool:
    """Whether the pair step may run each pair's prompt once, one row a pair, for this model
    (backends/cuda/shared_prompt.py ``_refusal``: sdpa or eager attention, no sliding-window
    layer, no attention soft-capping); the planner then prices those rows
    (finetune/planner/preference.py rows_setup)."""
    return s.attn in ("sdpa", "eager") and not arch.sliding_window and not arch.attn_softcap

# torch: the loss's backward (logits region) runs first and is freed before the layers'
# backward (and any recomputation) starts, so only the larger of the two adds to the kept
# activations (checked with torch.profiler memory events on CPU).
WORKSPACE_WITH_LOGITS = False


def activation_pieces(arch: ModelDesc, s: Setup, backward_layers: int) -> dict[str, Any]:
    """The terms the planner assembles into a step's activations (see
    finetune.planner.price.activations): per layer, lowest layer, head, the layers' backward
    workspace, logits+loss, and what gradient checkpointing keeps and recomputes."""
    first = 0 if s.method == "full" else min(s.lora_layers)
    per = {b: layer_bytes(arch, s, False, b) for b in dict.fromkeys(arch.blocks)}
    layer, lparts = max(per.values(), key=lambda x: x[0])
    low, _ = layer_bytes(arch, s, s.method != "full", arch.blocks[first])
    saved = low + sum(per[arch.blocks[i]][0] for i in range(first + 1, arch.layers))
    h, f, V = arch.hidden, arch.intermediate, arch.vocab
    n = s.batch * s.seq_len
    a, st = s.a, (4 if s.autocast else s.wd)
    full = s.method == "full"
    lin = [x for b in per for x in b.linears if x.experts == 1]
    head = n * h * 4 + n * 4 + (n * h * st if full else 0)  # final RMSNorm
    if full:  # lm_head (or the tied embedding) trains: its input, cast under autocast
        head += n * h * 2 + V * h * 2 if s.autocast else n * h * st
        head += n * 8  # nn.Embedding backward keeps the int64 indices
    elif s.autocast:
        head += V * h * 2  # cast lm_head weight kept for the hidden state's grad
    if "lm_head" in s.keys and not full:
        head += n * s.rank * (2 if s.autocast else s.ad)  # PEFT's lora_A output on the head, kept by lora_B
    if s.attn == "sdpa" and s.padding_mask:
        # bool [B, 1, T, T] padding mask, shared by layers; without a padding mask (what the
        # runtime passes for right-padded causal rows) transformers hands sdpa is_causal=True
        head += s.batch * s.seq_len * s.seq_len
    # Layer backward workspace: grads of the MLP intermediates and of the fp32 residual
    # stream; eager attention also materialises the [B, H, T, T] grads.
    transient = 3 * n * f * a + 2 * n * h * 4
    if s.attn == "eager":
        transient += 2 * s.batch * arch.heads * s.seq_len ** 2 * 4
    if s.method == "qlora":
        # bitsandbytes MatMul4Bit: F.dequantize_4bit(B) -> the full weight in compute dtype,
        # per matmul (forward and backward), one at a time.
        transient += max(x.in_f * x.out_f for x in lin) * a
    if s.method == "dora":
        # PEFT DoraLinearLayer: get_lora_weight runs lora_A on an [in, in] identity and
        # get_weight_norm builds weight + scaling * lora_weight [out, in], per module.
        transient += max(x.in_f * x.in_f * s.ad + x.in_f * x.out_f * 4 for x in lin if x.key in s.keys)
    # Logits and loss (backends/cuda/runtime.py _loss_sum: logits[:, :-1].float(), F.cross_entropy):
    # log_softmax keeps its fp32 output; backward adds nll_loss's dense grad and
    # log_softmax's grad: 3 x 4 B per (token, vocab) at the start of backward (the forward
    # end is no higher: model logits + fp32 copy + log_softmax output).
    # the head runs on target rows only (backends/cuda/loss.py target_head): their logits
    nt = s.head_rows(n)
    # Gemma-2's final soft-capping (logits / cap, tanh, * cap; backends/cuda/loss.py applies it
    # to the head's rows too) in the model's dtype: the tanh output is kept for backward,
    # beside the capped logits the loss reads
    cap = 2 * V * a if arch.final_softcap else 0
    logits = 12 * nt * V + cap * nt
    if s.loss_chunk and s.loss_chunk < nt:
        # train.loss_chunk (backends/cuda/loss.py): one chunk's fp32 logits, softmax and their
        # gradient at a time (3 x 4 B per chunk token and vocab entry), the target hidden
        # states' gradient taken in forward and kept for backward (fp32 [nt, h]), and the head
        # weight's fp32 gradient accumulator where the head trains
        logits = (12 * V + cap) * s.loss_chunk + 4 * nt * h + (4 * V * h if full else 0)
    # train.activation_offload: what leaves the device each micro-batch, and the most that is
    # back at once in backward (activations.offloaded)
    off, back, _, off_head = offloaded(arch, s, first) if s.offload else (0, 0, [], [])
    return {"layer": layer, "layer_parts": lparts, "lowest": low, "saved": saved, "head": head,
            "offload": off, "offload_back": back, "offload_head": sum(off_head),
            "transient": transient,
            "logits": logits,
            "ckpt_input": n * h * st,  # non-reentrant checkpoint keeps each layer's input
            "ckpt_recompute": layer}  # the loss's backward is freed first: one whole layer recomputed


def grads_during_forward_backward(s: Setup, fb: int, grads: int, overlap: float) -> int:
    """Bytes of activations and gradients together at the forward/backward peak."""
    if s.grad_accum > 1:
        return fb + grads  # torch accumulates into p.grad in place: earlier grads stay alive
    # gradients grow while activations are freed, layer by layer
    return max(fb, grads) + int(overlap * min(fb, grads))


# ---- several processes (torchrun, accelerate launch, SLURM) ----------------------------------------

# The runtime's DDP gradient sum (backends/cuda/distributed.py sum_gradients imports it):
# gradients of one dtype are packed in order into flat buckets (torch.cat) of at most this many
# bytes (a gradient larger than that is all-reduced in place, no copy); each bucket is
# all-reduced and copied back before the next is built, so one is alive at a time (torch's own
# DistributedDataParallel caps its buckets at the same 25 MiB, bucket_cap_mb).
DDP_BUCKET_BYTES = 25 << 20
# Optimizers that step FSDP2's DTensor parameters in our runtime: torch's own (their foreach
# kernels dispatch on DTensor). bitsandbytes' 8-bit and paged optimizers hand raw pointers of
# plain tensors to their CUDA kernels, and transformers' Adafactor factors p.grad as a plain
# tensor: neither accepts a DTensor.
FSDP_OPTIMIZERS = ("adamw", "adam", "sgd")


def ranks(spec: RunSpec) -> tuple[int, str]:
    """(data-parallel ranks, strategy) the plan is for: ``backend.num_devices`` ranks with
    ``backend.strategy`` unless ``backend.device_map=auto`` (one process split over the GPUs,
    planned by ``resolve_device``); 1 rank otherwise. Refuses fsdp with device_map=auto."""
    strategy = spec.backend.strategy
    split = spec.backend.device_map == "auto"
    if strategy == "fsdp" and split:
        raise UserError("backend.strategy=fsdp shards the model over ranks and backend.device_map=auto splits one "
                        "process over GPUs; drop backend.device_map=auto (or use backend.strategy=ddp)")
    n = spec.world.num_devices
    # the world's size is known once a launcher's ranks connect: the ranks are checked on the setup
    host_offload.check(spec.backend.cpu_offload, strategy, 2)
    return (n if n and not split else 1), strategy


def _refuse_fsdp(s: Setup) -> None:
    """The runtime's refusals under fsdp (backends/cuda/runtime.py _distribute), on the setup so
    the planner's levers skip them too. One process shards nothing: nothing to refuse."""
    if s.strategy != "fsdp" or s.world_size <= 1:
        return
    if s.optim not in FSDP_OPTIMIZERS:
        raise UserError(f"optim={s.optim} is not supported under backend.strategy=fsdp (bitsandbytes' 8-bit/paged "
                        "optimizers and adafactor do not take FSDP's DTensor parameters); use optim=adamw, adam or "
                        "sgd, or backend.strategy=ddp")


def rank_tensors(tensors: list[Tensor], s: Setup) -> list[Tensor]:
    """The parameters as one rank holds them.

    ddp: every rank a whole replica. fsdp (FSDP2 ``fully_shard``, full shard): every parameter
    sharded on dim 0 over the ranks, frozen ones too (torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py FSDPParam._init_sharded_param: torch.chunk(param, world_size, dim=0); each
    rank's storage is ``new_zeros(chunks[0].size())``, i.e. ceil(dim0 / N) rows, padded to rank
    0's). Its gradient (foreach_reduce's reduce-scatter output, viewed per parameter) and the
    optimizer's state (zeros_like the local shard) are as large.
    """
    _refuse_fsdp(s)
    host_offload.check(s.cpu_offload, s.strategy, s.world_size)
    if s.strategy != "fsdp" or s.world_size <= 1:
        return tensors
    return [dataclasses.replace(t, shards=s.world_size) for t in tensors]


def _padded_numel(t: Tensor, world: int) -> int:
    """Elements of ``t`` with dim 0 padded to a multiple of ``world``
    (_fsdp_common.py _get_dim0_padded_size: what all-gather outputs and reduce-scatter
    inputs hold per parameter)."""
    return -(-t.shape[0] // world) * world * math.prod(t.shape[1:])


def collective_buffers(tensors: list[Tensor], s: Setup) -> dict[str, dict[str, Any]]:
    """Named bytes one rank holds for the ranks' collectives, beyond its own weights, grads
    and state, each with the phase it adds to: "forward_backward" (on top of activations),
    "grad_sync" (its own moment after backward: weights + state + grads + it) or
    "optimizer_step" (on top of the step's workspace). ``tensors``: the whole inventory.
    """
    if s.world_size <= 1:
        return {}
    trainable = [t for t in tensors if t.trainable]
    if s.strategy == "ddp":
        # sum_gradients, after backward and before the step: gradients packed in order into
        # buckets of at most DDP_BUCKET_BYTES, one alive at a time; a larger gradient is summed
        # in place and needs none
        by_dtype: dict[int, list[int]] = {}
        for t in trainable:
            by_dtype.setdefault(t.dtype_bytes, []).append(t.numel * t.dtype_bytes)
        bucket = 0
        for grads in by_dtype.values():
            size = 0
            for g in grads:
                if g > DDP_BUCKET_BYTES:
                    continue
                if size and size + g > DDP_BUCKET_BYTES:
                    size = 0
                size += g
                bucket = max(bucket, size)
        return {"ddp_bucket": {"bytes": bucket, "phase": "grad_sync"}} if bucket else {}
    # fsdp: one unit per decoder layer plus the root (embeddings, final norm, lm_head).
    N = s.world_size
    units: dict[int | None, list[Tensor]] = {}
    for t in tensors:
        units.setdefault(t.layer, []).append(t)

    # The runtime's MixedPrecisionPolicy (backends/cuda/distributed.py shard_model): param_dtype
    # = the autocast dtype, reduce_dtype = fp32 under autocast; without autocast both None, so
    # each parameter is gathered, differentiated and reduced in its own dtype
    # (_fsdp_param.py init_dtype_attrs). So fp32 LoRA adapters reduce in fp32, a full
    # fine-tune in its weights' dtype.
    def unsharded_bytes(t: Tensor) -> int:
        return s.a if s.autocast else t.dtype_bytes

    def reduce_bytes(t: Tensor) -> int:
        return 4 if s.autocast else t.dtype_bytes

    def gathered(ts: list[Tensor]) -> int:
        return sum(_padded_numel(t, N) * unsharded_bytes(t) if t.quant != "bnb4"
                   else -(-bnb4_storage(t, s)[0] // N) * N * bnb4_storage(t, s)[1] for t in ts)

    root = gathered(units.get(None, []))
    layer = max((gathered(ts) for k, ts in units.items() if k is not None), default=0)
    unit_grads = max((sum(t.numel * unsharded_bytes(t) for t in ts if t.trainable) for ts in units.values()),
                     default=0)
    unit_reduce = max((sum(_padded_numel(t, N) * reduce_bytes(t) for t in ts if t.trainable)
                       for ts in units.values()), default=0)
    return {
        # _fsdp_param_group.py: the root keeps its unsharded parameters from its pre_forward
        # to its post_backward (_fsdp_state.py lazy_init: reshard_after_forward=False for the
        # root); a layer unit's are alive while it computes, and the next unit's are already
        # gathered (forward: AllGatherState kept until the next copy-out, the implicit
        # prefetch; backward: _backward_prefetch): root + 2 x the largest layer unit.
        "all_gather": {"bytes": root + 2 * layer, "phase": "forward_backward"},
        # autograd writes a unit's unsharded gradients (the gathered dtype) into
        # unsharded_param.grad; post_backward -> foreach_reduce copies them into the
        # reduce-scatter input, then frees them.
        "unsharded_grads": {"bytes": unit_grads, "phase": "forward_backward"},
        # _fsdp_collectives.py foreach_reduce: reduce_scatter_input, the unit's padded
        # gradients in the reduce dtype; reduce_scatter_max_input_buffers=1 keeps one in flight.
        # Its output is the rank's sharded gradient, counted in grads (the runtime reduces
        # every micro-batch and FSDP2 adds it into the sharded .grad: no unsharded accumulation).
        "reduce_scatter": {"bytes": unit_reduce, "phase": "forward_backward"},
        # backend.cpu_offload: a unit's shards and sharded gradients, copied to and from the host
        **host_offload.copy_buffer(tensors, s, sys.modules[__name__]),
        **(_gloo_temporaries(root, layer, unit_reduce) if s.device != "cuda" else {}),
    }


def _gloo_temporaries(root: int, layer: int, unit_reduce: int) -> dict[str, dict[str, Any]]:
    """On the CPU the ranks' process group is gloo's, whose collectives copy where NCCL's work in
    place (seen live on the 110M Qwen2, benchmarks/results/fsdp_sharded_load_cpu.txt section 3):
    all_gather_into_tensor (ProcessGroupGloo::_allgather_base) gathers into a flat temporary of
    the whole output and copies out of it, one unit's beside the all_gather buffer (a layer's;
    at the root's own gather, before any layer's is alive, the root's), and
    reduce_scatter_tensor clones its whole input before an all-reduce."""
    return {"gloo_all_gather_flat": {"bytes": max(layer, root - 2 * layer), "phase": "forward_backward"},
            "gloo_reduce_scatter_copy": {"bytes": unit_reduce, "phase": "forward_backward"}}


# ---- the phases: allocated, reserved, the device level and the host ---------------------------------

# finetune's default PYTORCH_CUDA_ALLOC_CONF where neither backend.alloc_conf nor the environment
# sets one. Planned on the seeds and presets (same model, data and shapes, the allocator model
# replayed both ways): expandable segments never reserved more, and less where a step's shapes
# differ from what the cache holds: full fine-tunes -7% (Llama-2-7B with 8-bit AdamW: 41.4 ->
# 38.6 GiB; Llama-3.2-3B: 29.3 -> 28.5 GiB), LoRA runs -0.1 to -0.3%. PyTorch documents it
# for exactly this (docs/source/notes/cuda.rst, "optimizing memory usage"), and it is torch's
# own choice for fragmentation-prone jobs in torchtune's recipes and Axolotl's launcher.
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def resolved_alloc_conf(configured: str | None) -> str:
    """``backend.alloc_conf``, else the environment's PYTORCH_CUDA_ALLOC_CONF, else
    ``DEFAULT_ALLOC_CONF``; an empty string is torch's own default allocator."""
    if configured is not None:
        return configured
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", DEFAULT_ALLOC_CONF)


def alloc_conf(spec: RunSpec) -> str | None:
    """PYTORCH_CUDA_ALLOC_CONF the run uses (``resolved_alloc_conf``; the runtime sets it before
    CUDA starts). Refuses, in one line, one torch would not parse."""
    text = resolved_alloc_conf(spec.backend.alloc_conf)
    try:
        parse_alloc_conf(text)
    except ValueError as e:
        raise UserError(f"backend.alloc_conf={text!r}: {e}") from None
    return text or None


def non_allocator(s: Setup, paged_bytes: int) -> dict[str, int]:
    """What NVML counts on one device beyond torch's reserved memory, by name (bytes)."""
    if s.device != "cuda":
        return {}
    out = {"cuda_context": CUDA_CONTEXT_MEASURED_BYTES, "lazy_modules": CUDA_LAZY_MODULES_BYTES,
           # bitsandbytes' paged state (cudaMallocManaged) is resident on the device while it
           # fits: NVML counts it, the allocator does not
           "paged_optimizer_state": paged_bytes}
    if s.world_size > 1:
        out["nccl_buffers"] = NCCL_BUFFERS_BYTES
    return out


def device_phases(arch: ModelDesc, s: Setup, held: list[Tensor], assign: dict[str, int],
                  buffers: dict[str, dict[str, Any]], devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per device: the load, step 1 and the steady state, each as allocated, reserved, the
    device level (what NVML shows) and the host (the process's RSS), in bytes.

    On a GPU, allocated and reserved come from a replay of the run's allocations, one tensor at a
    time as the memory model prices them, through a model of torch's caching allocator
    (backends/cuda/trace.py): the sequence gives what the category sums cannot (gradients growing
    while activations are freed, the cuBLAS workspaces, the cache and its fragmentation). On the CPU torch's allocator hands freed memory back to malloc:
    reserved is allocated, and the device is the host.
    """
    mm = sys.modules[__name__]  # this memory model, as the trace reads it
    host_base = HOST_BASE_CUDA_BYTES if s.device == "cuda" else HOST_BASE_CPU_BYTES
    file_bytes = sum(t.numel * s.wd if t.role not in ("lora_A", "lora_B", "dora_m") else 0 for t in held)
    # fsdp's sharded load: one checkpoint tensor read at a time, its mapping closed after it
    # (backends/cuda/sharded_load.py), so the file's pages never add up to the checkpoint
    shard_peak = host_offload.sharded_load_peak(held, s, mm) if host_offload.sharded_load(s) else None
    if shard_peak is not None:
        file_bytes = shard_peak["file"]
    # train.activation_offload: one micro-batch's saved activations in host memory (pinned on a
    # GPU) from the first forward on; on the CPU the "device" is the host, so they stay in its RSS
    off = offloaded(arch, s, 0 if s.method == "full" else min(s.lora_layers))[0] if s.offload else 0
    out = []
    for d, dev in enumerate(devices):
        b = dev["bytes"]
        load_alloc = b["weights"] + (_qlora_load_transient(arch, s) if s.method == "qlora" else 0)
        if shard_peak is not None:  # the shards, and one tensor's staging beside them
            load_alloc = b["weights"] + shard_peak["host"]
        elif s.strategy == "fsdp" and s.world_size > 1:  # the whole model on every rank, then its shards copied out
            load_alloc += host_offload.whole_model_bytes(held, s, mm)
        step1_alloc, steady_alloc = dev["step1_allocated_bytes"], dev["peak_allocated_bytes"]
        phases: dict[str, dict[str, Any]] = {}
        if s.device == "cuda":
            conf = parse_alloc_conf(s.alloc_conf)
            # every step at the planned shape: the load, a first step and the steady state
            plain = dataclasses.replace(s, step_widths=())
            figs = trace.replay(trace.build(arch, plain, held, mm, assign, d, buffers, steps=3,
                                            empty_cache_every=s.empty_cache_every), conf)
            leap, steady = _leap(figs), _peaks(figs, "step3")
            if s.step_widths:
                # the data's first steps at their own shapes, then the planned one: the leap of
                # step 2 over step 1 as the run will see it, and what varied shapes leave cached
                last = len(s.step_widths) + 2
                mixed = trace.replay(trace.build(arch, s, held, mm, assign, d, buffers, steps=last,
                                                 empty_cache_every=s.empty_cache_every), conf)
                leap = _leap(mixed)
                steady = max(steady, _peaks(mixed, f"step{last}"))
            rows = {"load": (figs["load"].peak_allocated, figs["load"].peak_reserved),
                    "step1": _peaks(figs, "step1"), "steady": steady}
            extra = non_allocator(s, b["optimizer_state_paged"])
            for name, (alloc, resv) in rows.items():
                # at the load, the context alone: kernels load on first use, bitsandbytes pages
                # its state at the first step, NCCL connects at the first collective
                level = resv + (extra["cuda_context"] if name == "load" else sum(extra.values()))
                host = host_base + (file_bytes + (shard_peak or {}).get("host", 0) if name == "load" else off)
                phases[name] = {"allocated_bytes": alloc, "reserved_bytes": resv, "device_bytes": level,
                                "host_bytes": host,
                                # of the host, the checkpoint's pages (file-backed: the kernel drops
                                # them under pressure rather than running out)
                                "host_file_bytes": file_bytes if name == "load" else 0}
            moved = host_offload.host_bytes(held, s, mm)  # backend.cpu_offload: the shards, grads and state
            host_offload.move_phases(s, moved, host_offload.whole_model_bytes(held, s, mm), phases)
            out.append({"phases": phases, "non_allocator": extra, "step2_reserved_leap_bytes": leap,
                        "alloc_conf": s.alloc_conf, "device_level_planned": True,
                        # paged state NVML counts while it fits, and pages out to the host when
                        # the device runs short: not what makes a run fail
                        "evictable_bytes": extra.get("paged_optimizer_state", 0)})
            if s.cpu_offload:
                out[-1].update(host_offload.device_peaks(dev, moved))
        else:
            first_use = HOST_FIRST_STEPS_CPU_BYTES if s.cpu_offload else 0
            for name, alloc in (("load", load_alloc), ("step1", step1_alloc), ("steady", steady_alloc)):
                host = host_base + alloc + (file_bytes if name == "load" else off + first_use)
                phases[name] = {"allocated_bytes": alloc, "reserved_bytes": alloc, "device_bytes": host,
                                "host_bytes": host}
            moved = host_offload.host_bytes(held, s, mm)  # on the CPU already in the host's figures
            out.append({"phases": phases, "non_allocator": {}, "step2_reserved_leap_bytes": 0, "alloc_conf": None,
                        "device_level_planned": False, "evictable_bytes": 0})
            if s.cpu_offload:
                # the device's figures (what memory.budget is judged on) without what FSDP puts on
                # the host, as activation offload's are: on the CPU the "device" stands in for one
                # (its phases, the host's RSS, keep everything)
                out[-1].update(host_offload.device_peaks(dev, moved))
    return out


def _peaks(figs: dict[str, Any], step: str) -> tuple[int, int]:
    """(allocated, reserved) at their peaks in ``step`` of a replay (every phase of it)."""
    ph = [f for k, f in figs.items() if k.startswith(step + ":")]
    return max(f.peak_allocated for f in ph), max(f.peak_reserved for f in ph)


def _leap(figs: dict[str, Any]) -> int:
    """Step 2's reserved over step 1's at the end of the same phase, the largest (as the run's
    accounting measures it, finetune/accounting/rules.py rule_step_growth)."""
    return max(figs[f"step2:{p}"].end_reserved - figs[f"step1:{p}"].end_reserved
               for p in ("forward", "backward", "optimizer"))


def _qlora_load_transient(arch: ModelDesc, s: Setup) -> int:
    """transformers' bitsandbytes quantizer loads each Linear's weight in the compute dtype and
    quantizes it on the device, one at a time: the largest such weight, briefly, beside the rest."""
    return max((lin.numel * s.a for b in arch.blocks for lin in b.linears if lin.experts == 1), default=0)


# ---- overheads and notes ---------------------------------------------------------------------------

def device_overhead(s: Setup) -> int:
    """Bytes outside the allocator on each device: the CUDA context (an estimate)."""
    return CUDA_CONTEXT_BYTES if s.device == "cuda" else 0


def notes(s: Setup) -> list[str]:
    out = []
    if s.device == "cuda":
        out.append("overhead: CUDA context ~500 MiB is an estimate (varies by GPU, driver and "
                   "libraries); allocator rounding counts 512 B blocks of persistent tensors; the allocator's cache is "
                   "in the phases' reserved, not in peak")
    if s.optim.startswith("paged") and s.device == "cuda":
        out.append("optimizer_state_paged lives in CUDA unified memory (pages to host under "
                   "pressure): not in peak_bytes")
    if s.device == "cpu":
        out.append("cpu: the process's own resident libraries are not counted")
    if s.world_size > 1 and s.strategy == "ddp":
        out.append(f"ddp over {s.world_size} ranks: every rank holds whole weights, gradients and optimizer state "
                   "and its own micro-batch's activations; gradients are summed one flat bucket at a time (at most "
                   f"{DDP_BUCKET_BYTES >> 20} MiB, or one larger gradient alone); ranks are identical")
    if s.world_size > 1 and s.strategy == "fsdp":
        out.append(f"fsdp over {s.world_size} ranks: every parameter (frozen ones too), its gradient and optimizer "
                   "state are sharded on dim 0 (ceil(rows / N) per rank, padded to rank 0's); ranks are identical "
                   "(rank 0's figures; the last ranks' optimizer state can be smaller by the padding rows); "
                   "parameters gathered in the autocast dtype, else their own; the all-gather and reduce-scatter "
                   "buffers peak mid-backward and are added to the forward/backward peak whole (an upper bound)")
    if s.world_size > 1 and s.device == "cuda":
        out.append("several ranks: NCCL's buffers are an estimate on the device level (2 peers x 16 channels x its "
                   "three protocols' buffers), not measured")
    if host_offload.sharded_load(s):
        out.append("fsdp: each rank loads only its shard (the model built on the meta device, sharded, then each "
                   "checkpoint tensor read once and this rank's rows kept; a 4-bit weight quantized whole first; "
                   "an MoE's stacked experts filled from this rank's experts' own tensors): the load holds the "
                   "rank's shards and one tensor's staging, never the whole model")
    elif host_offload.loads_on_host(s):
        out.append("fsdp: every rank loads (and quantizes) the whole model in host memory before fully_shard takes "
                   "it a unit at a time through the device and keeps its rows: the load phase holds the whole model "
                   "in each rank's host memory, one unit whole on the device (the sharded load does not apply: "
                   "an MoE family it does not build, a multimodal checkpoint, remote code or packed rows)")
    elif s.world_size > 1 and s.strategy == "fsdp":
        out.append("fsdp: every rank loads the whole model before fully_shard keeps its rows, so the load phase "
                   "holds the whole model on each device (the sharded load does not apply: an MoE family it does not "
                   "build, a multimodal checkpoint, remote code or packed rows)")
    if s.device == "cuda":
        out.append("phases: allocated and reserved from a replay of the run's allocations through a model of torch's "
                   "caching allocator (backends/cuda/allocator.py); the device level adds the CUDA context and the "
                   "kernels loaded on first use as measured on an H200 (524 + 229 MiB); the host is the process's "
                   "libraries (measured) and, at the load, the checkpoint's pages")
    return out


def quant_label(s: Setup) -> str | None:
    """How the plan names the base's quantization."""
    return f"{s.quant_type}/bitsandbytes" if s.method == "qlora" else None


def qlora_lever(arch: ModelDesc, s: Setup) -> dict[str, Any] | None:
    """The Setup changes of trying ``method=qlora`` instead (None: not a lever here): LoRA on a
    4-bit base; from full fine-tuning, adapters on every layer in the precision's adapter dtype."""
    if s.method in ("lora", "dora"):
        return {"lora_layers": s.lora_layers, "adapter_dtype": s.adapter_dtype}
    if s.method == "full":
        return {"lora_layers": tuple(range(arch.layers)),
                "adapter_dtype": "bfloat16" if s.precision == "bf16-true" else "float32"}
    return None


def device_checks(spec: RunSpec, s: Setup, peak_bytes: int, budget_bytes: int | None,
                  levers_under: Any) -> tuple[PlanData, bool]:
    """Nothing beyond the budget: a CUDA device's limit is its memory, which the budget is."""
    return {}, False


def device_report(plan: Any) -> tuple[str, list[str]]:
    return "", []


ATTENTION_LABEL = None  # the plan shows backend.attn_implementation
