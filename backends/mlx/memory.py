"""The mlx backend's memory model, mlx-free: what mlx and mlx-lm hold for each tensor,
optimizer state and activation (unified memory: no separate device context). The planner
(finetune/planner) prices a parameter inventory with these functions; nothing here imports
mlx, so `finetune mode=plan` stays light.

Versions modelled: mlx 0.32, mlx-lm 0.32. Every figure is an int of bytes; the activation
constants are calibrated (benchmarks/plan_vs_measured.py) and say so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from finetune.errors import UserError
from finetune.model.types import STAGE_ATTN_IN, STAGE_ATTN_OUT, STAGE_MLP_IN, STAGE_MLP_OUT, Block, Linear, ModelDesc
from finetune.model.inventory import Setup, Tensor
from finetune.records import PlanData
from finetune.spec import RunSpec
from finetune.backends.mlx import metal
from finetune.backends.mlx.capabilities import CAPABILITIES
from finetune.backends.mlx.hfconfig import refusal
from finetune.budget import DeviceMemory, apple_silicon, apple_working_set, host_memory

# ---- constants ------------------------------------------------------------------------------------

# mlx calibration (mlx 0.32 on CPU with backends/mlx.py, fp32 and bf16, hidden 128-512, 1-4
# layers, vocab 512-8192, batch 1-4, 32-256 tokens): bytes of the step's transient workspace
# beyond the arrays kept for backward, in units of n*h, n*f and B*H*T*T elements of the
# activation dtype; and of logits+loss per n*V. Fitted within ~10% of mx.get_peak_memory.
MLX_TRANSIENT_NH = 3.0
MLX_TRANSIENT_NF = 6.0
MLX_TRANSIENT_NF_QUANT = 2.0  # extra with quantized (QuantizedLinear) base layers
MLX_TRANSIENT_TT = 1.5
# With gradient checkpointing (mlx_lm.tuner.trainer.grad_checkpoint -> mx.checkpoint around each
# block), mlx keeps only each block's input and recomputes the block in its vjp. The peak stays
# in the logits region (measured: the same 16 B per n*V slope with and without checkpointing,
# 0.5-4k vocab), and there, beyond the saved inputs and the transient above, mlx holds only part
# of one recomputed block (0.35-0.75 of _mlx_layer's bytes), not all of it: forward and backward
# are one lazily evaluated graph, so the top block's recompute overlaps the logits' backward
# rather than following it as in torch. Calibrated on mlx 0.32
# CPU fp32 (hidden 64/256, 2/4 layers, vocab 512-2048, batch 1-16, 64-256 tokens, LoRA on all or
# the top layer; mx.get_peak_memory of forward+backward), in the same units as MLX_TRANSIENT_*:
# within ~7% of the measured step peak above the weights.
MLX_CKPT_RECOMPUTE_NH = 0.8
MLX_CKPT_RECOMPUTE_NF = 2.4
MLX_CKPT_RECOMPUTE_TT = 0.8
# When the only layer with gradients is the lowest adapted one (method.lora.num_layers=1 and
# adapters only), its backward needs no gradient for the layer's input, and mlx's vjp prunes
# that path: the [B, H, T, T]-sized workspace is smaller by this factor. Calibrated without
# checkpointing from benchmarks/plan_vs_measured.py (tiny, T=256, batch 4 and 16: measured
# peaks were 0.57 * B * H * T^2 * dtype below the full-workspace prediction).
MLX_LOWEST_ONLY_TT_SAVING = 0.57
# Families beyond the Qwen2/Llama block the constants above were fitted on, each term fitted the
# same way on tests/families.py's tiny checkpoints (mlx 0.32 CPU fp32, batch 4-8, 64-128 tokens,
# LoRA default keys and all-linear) against mx.get_peak_memory, in the same units:
MLX_SOFTCAP_TT = 1.0  # Gemma-2: tanh(scores / cap) * cap keeps one more [B, H, T, T] array per layer
MLX_SOFTCAP_LOGITS_NV = 4  # Gemma-2's final tanh(logits / cap) * cap: one more fp32 [n, V] array
MLX_FUSED_QKV_TT = 0.5  # Phi-3: the attention over slices of one fused qkv output (mx.split views)
MLX_FUSED_QKV_NH = 3.0
MLX_PLAIN_MLP_NF = 1.0  # a two-matrix MLP (StarCoder2): the gelu keeps its input
MLX_PLAIN_TRANSIENT_NF = 3.0  # ... and its backward workspace has one input matrix, not two
MLX_TARGET_HEAD_SAVING_NV = 1
# A packed row whose attention runs one sample at a time (backends/mlx/loss.py _per_sample):
# its step peaks at the larger of two moments, not at their sum: the loss's backward (the
# logits' cotangents with the n*h and n*f workspace above), or the attention's backward,
# whose workspace is the samples' [H, L, L] terms, more for the longest sample, beside part of
# the n*h and n*f workspace. Fitted on mlx 0.32 CPU fp32 (the tiny Qwen2, hidden 64, 2
# layers, 4 heads; rows of 1-32 samples of 64-2048 tokens, 64-4096 wide, equal and GSM8K-like
# mixed lengths, 9-90% targets; mx.get_peak_memory of forward, backward and the optimizer
# step) in the units of MLX_TRANSIENT_*: B*H*pairs of the row, B*H*L^2 of its longest sample,
# and the n*h + n*f workspace. Plan/measured 0.90-1.10 over that grid (the sum it replaced:
# 0.84-1.33), 0.95-1.07 on a tiny of hidden 128, 4 layers, 8 heads, 1.00-1.05 on GSM8K's steps.
# Not refitted with gradient checkpointing (the summed form is kept there).
MLX_PACKED_TT_ROW = 1.1
MLX_PACKED_TT_LONGEST = 1.7
MLX_PACKED_N = 0.8
MLX_LOGITS_PER_NV = 16  # fp32 logits kept + logsumexp/softmax/scatter cotangents (measured slope: 4 x 4 B)
MLX_LOGITS_PER_NV_HALF = 4  # extra with bf16 weights: the bf16 logits and their cotangent


def mlx_quant_bytes(out_f: int, in_f: int, bits: int, group: int, scale_bytes: int) -> tuple[int, int]:
    """(packed weight bytes, scales+biases bytes) of one mlx affine-quantized matrix.

    mlx.core.quantize (mode "affine"): ``bits`` per element packed into uint32 words along the
    last axis, plus a scale and a bias per ``group`` elements in the weight's dtype
    (mlx/nn/layers/quantized.py QuantizedLinear/QuantizedEmbedding keep weight, scales, biases).
    """
    packed = out_f * (in_f * bits // 32) * 4
    return packed, 2 * out_f * (in_f // group) * scale_bytes



# ---- resolving the device ------------------------------------------------------------------------

def resolve_device(spec: RunSpec, mode: str, method: str) -> tuple[str, int, list[str]]:
    """(device, devices, notes): the Apple GPU on Apple Silicon, the CPU elsewhere (mlx[cpu])."""
    return run_device(), 1, []


def check_lora_keys(keys: tuple[str, ...]) -> None:
    """mlx-lm adapts layers inside the decoder blocks only (tuner/utils.py linear_to_lora_layers
    walks model.layers): not the output head."""
    if "lm_head" in keys:
        raise UserError("method.lora.keys: lm_head cannot be adapted on backend=mlx (mlx-lm adapts layers inside "
                        "the decoder blocks only); drop lm_head, or use backend=cuda")


def shard_loadable(arch: Any, hf: dict[str, Any], s: Setup) -> bool:
    """No sharded model on mlx: every rank loads the whole model."""
    return False


def check_model(hf: dict[str, Any], seq_len: int) -> None:
    """Refuse, in one line, a checkpoint mlx-lm would load as a different model
    (backends/mlx/hfconfig.py refusal: the same check the runtime makes before loading)."""
    why = refusal(hf, seq_len)
    if why:
        raise UserError(why)


def pre_quantized(spec: RunSpec, quant: dict[str, Any] | None) -> None:
    """A pre-quantized checkpoint trains as mlx-lm trains it: nothing to refuse."""


# a packed row's attention paths, in words (backends/mlx/loss.py check_packed says which one runs)
PACKED_PER_SAMPLE = "mx.fast.scaled_dot_product_attention per sample (causal; no block mask); RoPE per token"
PACKED_BLOCK_MASK = "the model's attention with a block-diagonal causal bool mask; RoPE per token"


def packed_attention(s: Any, arch: ModelDesc) -> str:
    """The attention path that keeps packed samples apart, in words: the runtime's own sentence
    for the path it takes (backends/mlx/loss.py ``check_packed``), per sample unless the model
    computes its own scores (soft-capped ones), as the activations are priced (``_pairs``)."""
    return PACKED_BLOCK_MASK if arch.attn_softcap else PACKED_PER_SAMPLE


def run_device(device: str = "auto") -> str:
    """"mlx:gpu" on Apple Silicon (Metal), "mlx:cpu" elsewhere (mlx[cpu])."""
    return "mlx:gpu" if apple_silicon() else "mlx:cpu"


def device_memory(device: str) -> Any:
    """Unified memory: Metal's recommended working set on an Apple GPU (this Mac's
    ``mx.device_info()``, read by a child process; else the sysctl estimate), else the host's RAM."""
    if device == "mlx:gpu":
        info = metal.device_info_here()
        if info is not None:
            return DeviceMemory(metal.read_working_set(info), 1, f"mx.device_info() {metal.WORKING_SET_KEY}", False)
        total, source, est = apple_working_set()
        return DeviceMemory(total, 1, source, est)
    return host_memory()


# ---- weights ---------------------------------------------------------------------------------------

def quant_of(s: Setup, role: str, in_f: int) -> str | None:
    """How a weight is stored under ``method=qlora`` or in a pre-quantized checkpoint:
    nn.quantize with class_predicate hasattr(m, "to_quantized") and width % group == 0
    (backends/mlx/runtime.py, as mlx_lm.utils.quantize_model): Linear *and* Embedding, lm_head too."""
    if not (s.method == "qlora" or s.pre_quant is not None):
        return None
    if role in ("linear", "router", "expert", "embed", "lm_head") and in_f % s.quant_group == 0:
        return "mlx"
    return None


def expert_adapters(lin: Linear, rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """The adapter tensors mlx-lm 0.32 builds on a model's experts: tuner/lora.py
    LoRASwitchLinear, lora_a [E, r, in] and lora_b [E, out, r] per SwitchLinear; mlx-lm holds the
    experts' gate and up projections as two SwitchLinears (switch_mlp.gate_proj, up_proj) where
    transformers stacks them in one gate_up_proj."""
    E = lin.experts
    if lin.path.endswith("gate_up_proj"):
        half = lin.out_f // 2
        a: list[tuple[str, tuple[int, ...]]] = [(f".{p}.lora_a", (E, rank, lin.in_f)) for p in ("gate_proj", "up_proj")]
        return a + [(f".{p}.lora_b", (E, half, rank)) for p in ("gate_proj", "up_proj")]
    return [(".lora_a", (E, rank, lin.in_f)), (".lora_b", (E, lin.out_f, rank))]


def weight_bytes(t: Tensor, s: Setup) -> tuple[int, int]:
    """(bytes of the tensor itself, bytes of its quantization constants)."""
    if t.quant == "mlx":  # a stacked expert weight [E, out, in]: E matrices (QuantizedSwitchLinear)
        rows = math.prod(t.shape[:-1])
        return mlx_quant_bytes(rows, t.shape[-1], s.quant_bits, s.quant_group, s.wd)
    return t.numel * t.dtype_bytes, 0


def rounding_bytes(nbytes: int, s: Setup) -> int:
    """MLX's allocator adds nothing the planner counts to a persistent array."""
    return 0


# ---- optimizer state -------------------------------------------------------------------------------

def optimizer_state_bytes(optim: str, shape: tuple[int, ...], dtype_bytes: int, on_gpu: bool,
                          momentum: float = 0.0, host_step: bool = False) -> tuple[int, int]:
    """(allocator-held bytes, paged bytes = 0) of one trainable array's optimizer state
    (mlx/optimizers/optimizers.py ``init_single``), in the parameter's dtype."""
    n = math.prod(shape)
    if optim in ("adamw", "adam"):
        return 2 * n * dtype_bytes, 0  # Adam.init_single: m, v = zeros_like(parameter)
    if optim == "sgd":
        return n * dtype_bytes, 0  # SGD.init_single: state["v"] = zeros_like(parameter), even at momentum 0
    if optim == "adafactor":
        # Adafactor.init_single: exp_avg_sq_row shape[:-1], _col shape[:-2] + shape[-1:];
        # 1-D: exp_avg_sq = zeros_like; beta_1=None.
        factored = len(shape) >= 2
        elems = (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if factored else n
        return elems * dtype_bytes, 0

    raise UserError(f"optim={optim} is not valid on backend=mlx; choose one of: {', '.join(CAPABILITIES.optimizers)}")


def optimizer_shared_bytes(s: Setup, trainable: list[Tensor]) -> int:
    return 0


def optimizer_transient(s: Setup, trainable: list[Tensor]) -> int:
    """backends/mlx/runtime.py optimizer_step: optim.clip_grad_norm builds a clipped copy of the
    gradient tree, then Optimizer.update's lazy graph (new m, v, p per parameter) is evaluated
    at once. Calibrated on mlx 0.32 CPU, full fine-tuning of 2-8 layer models
    (mx.get_peak_memory during optimizer_step minus weights + state + grads): about one more
    trainable-sized tree (0.6 for SGD) plus 4x the largest tensor, within -9%..0%."""
    if not trainable:
        return 0
    largest = max(t.numel * t.dtype_bytes for t in trainable)
    total = sum(t.numel * t.dtype_bytes for t in trainable)
    return int((0.6 if s.optim == "sgd" else 1.0) * total) + 4 * largest


# ---- activations -----------------------------------------------------------------------------------

# mlx evaluates forward and backward as one graph: the calibrated workspace coexists with the
# logits' cotangents (fitted that way).
WORKSPACE_WITH_LOGITS = True


def activation_pieces(arch: ModelDesc, s: Setup, backward_layers: int) -> dict[str, Any]:
    """The terms the planner assembles into a step's activations (see
    finetune.planner.price.activations)."""
    first = 0 if s.method == "full" else min(s.lora_layers)
    per = {b: layer_bytes(arch, s, False, b) for b in dict.fromkeys(arch.blocks)}
    layer, lparts = max(per.values(), key=lambda x: x[0])
    low, _ = layer_bytes(arch, s, s.method != "full", arch.blocks[first])
    saved = low + sum(per[arch.blocks[i]][0] for i in range(first + 1, arch.layers))
    # the layers' backward workspace runs one MLP (one expert's width under MoE) at a time
    h, f, V = arch.hidden, max(b.mlp_width for b in arch.blocks), arch.vocab
    T = s.seq_len - 1
    n = s.batch * T
    a = s.wd
    head = n * h * 4 + n * 4  # final rms_norm: fp32 input and rsqrt
    nf = MLX_TRANSIENT_NF if arch.gated_mlp else MLX_PLAIN_TRANSIENT_NF
    tt = MLX_TRANSIENT_TT
    if backward_layers == 1 and s.method != "full" and not s.ckpt:
        tt -= MLX_LOWEST_ONLY_TT_SAVING
    pairs = _pairs(arch, s, T)
    n_work = (MLX_TRANSIENT_NH * n * h + nf * n * f
              + (MLX_TRANSIENT_NF_QUANT * n * f if s.method == "qlora" or s.pre_quant else 0))
    transient = int((n_work + tt * s.batch * arch.heads * pairs) * a)
    # the head runs on target rows only (backends/mlx/loss.py target_head): their logits
    nt = s.head_rows(n)
    per_nv = MLX_LOGITS_PER_NV + (MLX_LOGITS_PER_NV_HALF if a == 2 else 0)
    if s.target_head and not arch.final_softcap and not s.ckpt:
        # the head on gathered target rows (backends/mlx/loss.py target_head) peaks lower than
        # the whole-logits path it replaced: measured on the tiny model (mx.get_peak_memory, same
        # batches, before and after) 0.8 B (4 x 64 tokens) to 1.4-2.1 B (4 x 96) per position and
        # vocabulary entry; the smallest is taken. With mx.checkpoint the peak sits where the
        # recomputed block overlaps the logits, unchanged; so it does with Gemma-2's soft-cap
        # applied to the gathered rows (measured: 7.76 MB against 7.69 MB for the whole logits,
        # 4 x 64 tokens, every row a target)
        per_nv -= MLX_TARGET_HEAD_SAVING_NV
    if s.objective != "sft":  # the pair step's head: no cross-entropy, so no one-hot cotangent
        per_nv = MLX_PAIR_LOGITS_PER_NV + (MLX_LOGITS_PER_NV_HALF if a == 2 else 0)
        if s.target_head and not arch.final_softcap and not s.ckpt:
            per_nv -= MLX_TARGET_HEAD_SAVING_NV
    logits = nt * V * per_nv
    if s.loss_chunk and s.loss_chunk < nt:
        # train.loss_chunk (backends/mlx/loss.py): one chunk's logits and cotangents at a time,
        # plus the hidden states' gradient kept from forward (fp32 [n, h]) and, where the head
        # trains, its fp32 gradient
        logits = (s.loss_chunk * V * (MLX_LOGITS_PER_NV + (MLX_LOGITS_PER_NV_HALF if a == 2 else 0))
                  + 4 * nt * h + (4 * V * h if s.method == "full" else 0))
    if arch.final_softcap:
        # Gemma-2's final soft-capping (models/gemma2.py: tanh(out / cap) * cap), on the rows
        # the head runs on (backends/mlx/loss.py applies it to the head's rows and chunks too)
        logits += MLX_SOFTCAP_LOGITS_NV * (s.loss_chunk if s.loss_chunk and s.loss_chunk < nt else nt) * V
    if _per_sample(arch, s) and not s.ckpt:
        # the larger of the loss's backward and the attention's (see MLX_PACKED_*): the
        # planner adds the logits to this workspace, so the attention's moment counts here
        # beyond them
        longest = min(T, s.longest_sample or T)
        attention = int((MLX_PACKED_TT_ROW * s.batch * arch.heads * pairs
                         + MLX_PACKED_TT_LONGEST * s.batch * arch.heads * longest * longest
                         + MLX_PACKED_N * n_work) * a)
        transient = max(int(n_work * a), attention - logits)
    # the part of one recomputed block live at the peak (see MLX_CKPT_RECOMPUTE_*)
    ckpt_recompute = int((MLX_CKPT_RECOMPUTE_NH * n * h + MLX_CKPT_RECOMPUTE_NF * n * f
                          + MLX_CKPT_RECOMPUTE_TT * s.batch * arch.heads * pairs) * a)
    return {"layer": layer, "layer_parts": lparts, "lowest": low, "saved": saved, "head": head,
            "transient": transient,
            "logits": logits, "ckpt_input": n * h * a,  # mlx.core.checkpoint keeps the layer's input
            "ckpt_recompute": ckpt_recompute}


# A preference step (finetune/planner/preference.py): a micro-batch of P pairs as one row, each
# pair's prompt once (backends/mlx/shared_prompt.py: the chosen, then the rejected after the
# prompt; attention segment by segment, priced as a packed row where the data's pair_positions
# are known, else as 2P padded rows, the bound), the head on target positions only (log-softmax
# of those rows, the targets gathered); a precomputed reference's table kept as a numpy array (host).
PAIR_HEAD_WHOLE = False
PAIR_PROMPT_ONCE = True
UNPAIRED_HEAD_WHOLE = True  # KTO's rows (preference.py row_logps): every position's whole logits
REFERENCE_TABLE_WHERE = "host"
# The reference under LoRA is evaluated before the policy's graph (backends/mlx/preference.py
# _reference: adapters off, mx.stop_gradient, mx.eval), so none of its logits is alive at the
# step's backward peak: only its [rows] log-probs are. (A prototype that computed it inside the
# differentiated loss, in one graph with the policy's vjp, peaked higher by 0.88-1.20 x 4 B per
# position and vocabulary entry; that is the constant to put here if the step ever does so.)
MLX_REFERENCE_WITH_LOGITS_NV = 0
# The pair step's head (backends/mlx/shared_prompt.py _logps, as preference.py row_logps: fp32
# logits, the targets' logits gathered minus logsumexp, summed per row) holds less over [rows x positions, V] than the SFT
# whole-logits path's MLX_LOGITS_PER_NV: no cross-entropy's [n, V] one-hot cotangent beside the
# softmax. Measured (mx.get_peak_memory, 4 DPO LoRA steps, 35-37 tokens, V 512) against a plan
# at 16: llama 4 pairs 5.8, llama 8 pairs 3.5, qwen3 8 pairs 4.2 B per position and vocabulary
# entry over; the smallest whole-byte figure under all three is taken off. On target rows only
# (shared_prompt.py) SFT's MLX_TARGET_HEAD_SAVING_NV comes off too: tests/test_preference_plan.py
# then measures llama and qwen3 (4 pairs, 37 tokens) within 10% of the plan.
MLX_PAIR_LOGITS_PER_NV = MLX_LOGITS_PER_NV - 4


def reference_pass(arch: ModelDesc, s: Setup) -> dict[str, int]:
    """The reference's log-probs under LoRA/DoRA/QLoRA: the same rows through the model with the
    LoRA layers' contribution off, under ``mx.stop_gradient`` (nothing of it kept for the vjp):
    one layer's temporaries at a time (the calibrated workspace's constants), then the logits
    over every position, their fp32 upcast (none in fp32) and the log-softmax the targets are
    gathered from (``head``). ``s`` is the rows setup. In the step it adds
    ``MLX_REFERENCE_WITH_LOGITS_NV`` per position and vocabulary entry to the logits region
    (``with_logits``); ``transient`` is a no-grad pass alone (a table's precompute)."""
    T = s.seq_len - 1
    n, h, V, a = s.batch * T, arch.hidden, arch.vocab, s.wd
    f = max(b.mlp_width for b in arch.blocks)
    nf = MLX_TRANSIENT_NF if arch.gated_mlp else MLX_PLAIN_TRANSIENT_NF
    layer = int((MLX_TRANSIENT_NH * n * h + nf * n * f) * a)
    nt = s.head_rows(n)  # the pair step's head runs on target positions only (shared_prompt.py)
    head = n * h * a + nt * V * a + (nt * V * 4 if a != 4 else 0) + nt * V * 4
    return {"layer": layer, "head": head, "transient": max(layer, head), "forward_end": 0,
            "with_logits": MLX_REFERENCE_WITH_LOGITS_NV * n * V}


def grads_during_forward_backward(s: Setup, fb: int, grads: int, overlap: float) -> int:
    """Bytes of activations and gradients together at the forward/backward peak."""
    if s.grad_accum > 1:
        # backends/mlx/runtime.py forward_backward: tree_map(mx.add, self._grads, grads) is
        # evaluated with this micro-batch's graph: the running sum, the new grads and the new sum.
        return max(fb + 2 * grads, 3 * grads)
    return max(fb, grads) + int(overlap * min(fb, grads))


# ---- several processes (mlx.launch) ---------------------------------------------------------------

def ranks(spec: RunSpec) -> tuple[int, str]:
    """(ranks, strategy): ``backend.num_devices`` processes under mlx.launch (1 when null), data
    parallel (capabilities: ddp only; backend.device_map is a cuda key and means nothing here)."""
    n = spec.world.num_devices
    return (n if n else 1), spec.backend.strategy


def rank_tensors(tensors: list[Tensor], s: Setup) -> list[Tensor]:
    """Every rank holds the whole model (replicated)."""
    return tensors


def collective_buffers(tensors: list[Tensor], s: Setup) -> dict[str, dict[str, Any]]:
    """Bytes one rank holds for the gradient sum, with the phase it adds to (see the cuda
    model's ``collective_buffers``).

    mx.distributed.all_sum returns a new array; the primitive (mlx/backend/cpu/distributed.cpp
    AllReduce::eval_cpu: the ring backend's communication stream is a CPU stream on a Mac too,
    Metal has no eval_gpu for it) reuses its input's buffer only when that input is donatable,
    i.e. nothing else references it. backends/mlx/runtime.py optimizer_step still references
    the accumulated gradients (``self._grads``, cleared after mx.eval) while the step's graph is
    evaluated, so its ``sum_over_ranks`` makes one more gradient tree, alive with the
    optimizer's update graph in the same mx.eval: an array alone gets all_sum's new output, a
    run of small ones a concatenation (~32 MiB, as mlx.nn.average_gradients), which all_sum
    then donates to its output.
    """
    if s.world_size <= 1:
        return {}
    tree = sum(t.numel * t.dtype_bytes for t in tensors if t.trainable)
    return {"all_sum_output": {"bytes": tree, "phase": "optimizer_step"}} if tree else {}


# ---- overheads and notes ---------------------------------------------------------------------------

def alloc_conf(spec: RunSpec) -> str | None:
    """MLX has no PYTORCH_CUDA_ALLOC_CONF: nothing to plan or refuse."""
    return None


# mlx + mlx-lm + finetune imported (mlx[cpu] 0.32 on Linux, measured here: the interpreter's RSS
# before a model loads); Metal's own libraries on a Mac are not measured here.
HOST_BASE_MLX_BYTES = 300 * 2**20


def device_phases(arch: ModelDesc, s: Setup, held: list[Tensor], assign: dict[str, int],
                  buffers: dict[str, dict[str, Any]], devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per device: the load, step 1 and the steady state. MLX keeps freed buffers in its cache
    (``memory.cache_limit=auto``: what step 1 freed), so from step 2 on its footprint is the step's
    peak: reserved is the peak, and the device (Metal's wired memory on a Mac, RAM on Linux) holds
    it. Unified memory: the process's footprint is the same buffers plus its libraries."""
    out = []
    for dev in devices:
        b = dev["bytes"]
        rows = {"load": b["weights"], "step1": dev["step1_allocated_bytes"], "steady": dev["peak_allocated_bytes"]}
        phases = {k: {"allocated_bytes": v, "reserved_bytes": v, "device_bytes": v, "host_bytes": v + HOST_BASE_MLX_BYTES}
                  for k, v in rows.items()}
        out.append({"phases": phases, "non_allocator": {}, "step2_reserved_leap_bytes": 0, "alloc_conf": None,
                    "device_level_planned": False, "evictable_bytes": 0})
    return out


def device_overhead(s: Setup) -> int:
    return 0  # unified memory: no device context outside the allocator


def notes(s: Setup) -> list[str]:
    out = ["mlx: activations calibrated on mlx 0.32 CPU (fallback attention keeps the "
           "[B, H, T, T] softmax); unified memory: no separate context"]
    if s.device == "cpu":
        out.append("cpu: the process's own resident libraries are not counted")
    if s.world_size > 1:
        out.append(f"mlx.launch over {s.world_size} ranks (data parallel): every rank holds the whole model, "
                   "gradients and optimizer state and its own micro-batch's activations; summing the gradients "
                   "(mx.distributed.all_sum) holds one more gradient tree during the step; ranks are identical")
    return out


def quant_label(s: Setup) -> str | None:
    """How the plan names the base's quantization."""
    if s.method == "qlora" or s.pre_quant:
        return f"int{s.quant_bits}/affine/group{s.quant_group}" + (" (pre-quantized)" if s.pre_quant else "")
    return None


def qlora_lever(arch: ModelDesc, s: Setup) -> dict[str, Any] | None:
    """The Setup changes of trying ``method=qlora`` instead (None: not a lever here)."""
    if s.method in ("lora", "dora"):
        return {"lora_layers": s.lora_layers}
    if s.method == "full":
        return {"lora_layers": tuple(range(arch.layers))}
    return None


def device_checks(spec: RunSpec, s: Setup, peak_bytes: int, budget_bytes: int | None,
                  levers_under: Callable[[int], list[dict[str, Any]]] | None) -> tuple[PlanData, bool]:
    """plan.json's ``metal``: the peak against Metal's working set on the Mac the plan is for
    (backends/mlx/metal.py), and whether it passes that Mac's RAM."""
    m = spec.memory
    verdict, runs_out = metal.metal_check(m.device_info, m.budget, m.adapt, peak_bytes, budget_bytes, levers_under)
    return {"metal": verdict}, runs_out


def device_report(plan: Any) -> tuple[str, list[str]]:
    """The table's words for plan.json's ``metal`` (none where the plan has no such object)."""
    return metal.report_lines(plan["metal"]) if plan.get("metal") else ("", [])


ATTENTION_LABEL = "mx.fast.scaled_dot_product_attention"


def _per_sample(arch: ModelDesc, s: Setup) -> bool:
    """A packed row whose attention runs one sample at a time (backends/mlx/loss.py
    ``_per_sample``); soft-capped attention (models/gemma2.py) computes its own scores over the
    row's block mask."""
    return bool(s.packed and s.pair_span and not arch.attn_softcap)


def _pairs(arch: ModelDesc, s: Setup, T: int) -> int:
    """(query, key) pairs of one row's attention scores: T x T, or packed per sample its
    samples' squares summed, at most T x the longest."""
    return T * min(T, s.pair_span) if _per_sample(arch, s) else T * T


def layer_bytes(arch: ModelDesc, s: Setup, lowest: bool, block: Block | None = None) -> tuple[int, dict[str, int]]:
    """Bytes mlx keeps for backward in one mlx-lm decoder layer (the block the model
    description gives; the first layer's by default).

    Measured on mlx 0.32 (CPU) by evaluating the loss of nn.value_and_grad first and reading
    mx.get_active_memory before evaluating the gradients; each term is an array the vjp graph
    references:
    - mx.fast.rms_norm (CPU fallback): the input upcast to fp32 and the rsqrt, per norm
      (every norm of the block where it runs, q/k norms over their projections);
    - attention: mx.fast.scaled_dot_product_attention's fallback (mlx/fast.cpp: used on CPU and
      whenever the fused VJP is unavailable) keeps scale*q, k, v, the softmax [B, H, T, T] and
      the [T, T] bool causal mask; mx.fast.rope's fallback keeps cos/sin tables [T, d] per call;
      Gemma-2's soft-capped scores (models/gemma2.py: tanh(scores / cap) * cap, then softmax)
      keep two more [B, H, T, T] arrays;
    - MLP: nn.silu = x * sigmoid(x) keeps gate and sigmoid(gate); the product keeps silu and up;
      a plain MLP's gelu keeps its input and an intermediate; MoE (models/switch_layers.py
      SwitchGLU): the same per token and expert, n x k rows, plus the router's scores;
    - inputs of trained or adapted Linears; LoRALinear keeps x @ lora_a [n, r]; DoRALinear keeps
      the un-normalised output [n, out] for m's grad; full fine-tuning keeps the norm outputs.
    """
    block = block or arch.blocks[0]
    T = s.seq_len - 1  # backends/mlx.py _loss: model(ids[:, :-1])
    n = s.batch * T
    h, qd, kv = arch.hidden, arch.q_out, arch.kv_out
    a = s.wd
    full = s.method == "full"
    start = s.first_stage(arch) if lowest else 0
    k = max(arch.top_k, 1) if block.moe else 1
    parts = {"norms": 0, "linear_inputs": 0, "adapters": 0, "attention": 0, "mlp": 0}
    for stage, width in block.norms():
        if STAGE_ATTN_IN < stage < STAGE_ATTN_OUT:
            continue  # q/k norms: measured to keep nothing beyond what attention already references
        if stage > start or (stage == start and (full or not lowest)):
            parts["norms"] += n * width * 4 + n * 4
    tt = _pairs(arch, s, T)
    if start <= STAGE_ATTN_IN:
        parts["attention"] += (n * (qd + 2 * kv) * a + s.batch * arch.heads * tt * a + tt
                               + 2 * T * arch.head_dim * a)
        if arch.attn_softcap:
            parts["attention"] += int(MLX_SOFTCAP_TT * s.batch * arch.heads * tt * a)
        if arch.fused_qkv:
            parts["attention"] += int(MLX_FUSED_QKV_TT * s.batch * arch.heads * tt * a + MLX_FUSED_QKV_NH * n * h * a)
    w = block.mlp_width
    if start <= STAGE_MLP_IN:
        if block.moe:
            parts["mlp"] += 4 * n * k * w * a + n * k * h * a + n * arch.experts * 4
            if block.shared_width:  # qwen2_moe: a gated MLP on every token; sigmoid(gate) * its output
                parts["mlp"] += 4 * n * block.shared_width * a + n * h * a + 2 * n * a
        elif arch.gated_mlp:
            parts["mlp"] += 4 * n * w * a
        else:
            parts["mlp"] += int(MLX_PLAIN_MLP_NF * n * w * a)
    sources: dict[tuple[int, bool], int] = {}  # each source tensor a trained linear reads: its input
    for lin in block.linears:
        if lin.kind != "router" and (full or lin.key in s.keys):
            expert = lin.experts > 1
            sources[(lin.stage, expert)] = n * (k if expert else 1) * lin.in_f * a
    parts["linear_inputs"] += sum(sources.values())
    if full:
        parts["norms"] += 2 * n * h * a
    else:
        for lin in block.linears:
            if lin.key not in s.keys:
                continue
            tokens = n * (k if lin.experts > 1 else 1)
            split = 2 if lin.experts > 1 and lin.path.endswith("gate_up_proj") else 1
            parts["adapters"] += split * tokens * s.rank * a
            if s.dropout > 0:
                parts["adapters"] += tokens * lin.in_f * (1 + a)
            if s.method == "dora":
                parts["adapters"] += tokens * lin.out_f * a
    return sum(parts.values()), parts
