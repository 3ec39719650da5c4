"""What one decoder layer keeps for backward on the cuda backend, tensor by tensor as its
forward creates them (torch-free): ``layer_bytes`` tallies it by kind for the planner,
``layer_tensors`` lists it in order for the allocator replay (backends/cuda/trace.py). Part of
the cuda memory model (backends/cuda/memory.py, which re-exports both)."""

from __future__ import annotations

import dataclasses

from finetune.model.types import (
    STAGE_ATTN_IN,
    STAGE_ATTN_OUT,
    STAGE_MLP_IN,
    STAGE_MLP_OUT,
    STAGE_NORM2,
    Block,
    Linear,
    ModelDesc,
)
from finetune.model.inventory import Setup

# train.activation_offload (backends/cuda/offload.py): a saved storage under this many bytes stays
# on the device (torchtune's OffloadActivations min_offload_size: a copy costs more than it saves)
OFFLOAD_MIN_BYTES = 1024


@dataclasses.dataclass
class _Kept:
    """What one decoder layer keeps for backward, tallied by kind (bytes) as its forward runs."""

    arch: ModelDesc
    s: Setup
    block: Block
    lowest: bool  # the lowest layer that needs gradients: a stage before ``start`` keeps nothing
    start: int  # the stage where gradients start in this layer (0 in any layer above the lowest)
    parts: dict[str, int] = dataclasses.field(default_factory=lambda: {
        "norms": 0, "linear_inputs": 0, "weight_casts": 0, "adapters": 0, "attention": 0, "mlp": 0})
    # the same bytes one tensor at a time, in the order the forward creates them: (kind, bytes)
    tensors: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    def add(self, kind: str, *sizes: int) -> None:
        """Keep tensors of ``sizes`` bytes (one each; a 0 is no tensor) under ``kind``."""
        for b in sizes:
            if b:
                self.parts[kind] += b
                self.tensors.append((kind, b))

    @property
    def n(self) -> int:
        """Positions of one micro-batch."""
        return self.s.batch * self.s.seq_len

    @property
    def k(self) -> int:
        """Experts each token runs in this block (1: dense)."""
        return max(self.arch.top_k, 1) if self.block.moe else 1

    @property
    def st(self) -> int:
        """Bytes per element of the residual stream (fp32 under autocast, else the weights' dtype)."""
        return 4 if self.s.autocast else self.s.wd

    @property
    def full(self) -> bool:
        return self.s.method == "full"

    def keep(self, stage: float) -> bool:
        return stage >= self.start


def _norm_kept(kept: _Kept, stage: float, width: int) -> None:
    """RMSNorm (modeling_qwen2.py Qwen2RMSNorm.forward): hidden.to(float32) and rsqrt(variance);
    with a trainable weight also hidden.to(input_dtype). A norm at the very stage gradients
    start keeps nothing unless its own weight trains."""
    n = kept.n
    if kept.keep(stage) and (stage > kept.start or kept.full or not kept.lowest):
        kept.add("norms", n * width * 4, n * 4)
        if kept.full:
            kept.add("norms", n * width * kept.st)


def _full_linear_kept(kept: _Kept, lin: Linear, tokens: int, src_bytes: int) -> bool:
    """A trained Linear's saved input (full fine-tuning); True where it is the shared source
    tensor itself. Under autocast the bf16/fp16 cast of the input (autocast casts activations
    per call, no cache) and the cast weight."""
    ac = kept.s.autocast
    shared = False
    if ac and src_bytes != 2:
        kept.add("linear_inputs", tokens * lin.in_f * 2)  # autocast's cast of the input, per call
    elif lin.experts > 1:
        kept.add("linear_inputs", tokens * lin.in_f * src_bytes)  # each expert's gathered tokens
    else:
        shared = True
    if ac:
        kept.add("weight_casts", lin.numel * 2)
    return shared


def _adapter_kept(kept: _Kept, lin: Linear, tokens: int, src_bytes: int) -> bool:
    """An adapted Linear's PEFT tensors (lora.Linear.forward: x cast to the adapter dtype
    (_cast_input_dtype), lora_A keeps it, lora_B keeps lora_A's output [n, r]; DoRA
    (lora/dora.py DoraLinearLayer.forward) also keeps base_result and lora_B's output, both
    [n, out], for the magnitude's grad); True where lora_A keeps the shared source tensor itself."""
    s, ac, ad = kept.s, kept.s.autocast, kept.s.ad
    shared = False
    if s.dropout > 0:
        kept.add("adapters", tokens * lin.in_f, tokens * lin.in_f * ad)  # dropout mask + its output (lora_A's input)
    elif ac and ad != 2:
        kept.add("adapters", tokens * lin.in_f * 2)  # autocast cast of x (fp32) for lora_A
    elif src_bytes != ad or lin.experts > 1:
        kept.add("adapters", tokens * lin.in_f * ad)  # _cast_input_dtype copy kept by lora_A
    else:
        shared = True
    kept.add("adapters", tokens * s.rank * (2 if ac else ad))  # lora_A output kept by lora_B
    if ac:
        kept.add("weight_casts", s.rank * lin.in_f * 2 * lin.experts, s.rank * lin.out_f * 2 * lin.experts)
    if s.method == "dora":
        kept.add("adapters", tokens * lin.out_f * s.a, tokens * lin.out_f * (2 if ac else ad))
    return shared


def _inputs_kept(kept: _Kept, lins: tuple[Linear, ...], width: int, src_bytes: int, src_already_kept: bool) -> None:
    """Saved inputs of Linears reading one source tensor of dtype ``src_bytes``: a Linear keeps
    its input if its weight trains; under autocast a frozen one keeps its cast weight for the
    input's grad; bitsandbytes MatMul4Bit keeps only the packed weight."""
    lins = tuple(lin for lin in lins if lin.kind != "router")
    if not lins or not kept.keep(lins[0].stage):
        return
    s = kept.s
    grad_in = lins[0].stage > kept.start or not kept.lowest or kept.full  # does the source itself need a grad?
    shared = False
    for lin in lins:
        tokens = kept.n * (kept.k if lin.experts > 1 else 1)
        if kept.full:
            shared = _full_linear_kept(kept, lin, tokens, src_bytes) or shared
            continue
        if lin.key in s.keys:
            shared = _adapter_kept(kept, lin, tokens, src_bytes) or shared
        if s.autocast and s.method != "qlora" and grad_in:
            kept.add("weight_casts", lin.numel * 2)  # cast weight kept for the input's grad
    if shared and not src_already_kept:
        kept.add("linear_inputs", kept.n * width * src_bytes)


def _masked(kept: _Kept) -> bool:
    """Whether transformers hands this layer's sdpa a mask (masking_utils.sdpa_mask): a padding
    mask, or a sliding-window layer whose rows reach the window (``_ignore_causal_mask_sdpa``
    skips the mask only while kv_length < the window)."""
    arch, s = kept.arch, kept.s
    window = kept.block.sliding and arch.sliding_window
    return s.padding_mask or bool(window and s.seq_len >= window)


def _attention_kept(kept: _Kept) -> None:
    """The attention's own tensors: sdpa (flash/efficient) keeps q, k, v, out and the fp32
    logsumexp [B, H, T]; eager (eager_attention_forward) keeps q, repeat_kv'd k and v, the fp32
    softmax, its cast, and the contiguous output; Gemma-2's soft-capping (scores / cap, tanh,
    * cap) keeps the tanh output too.

    Where the layer's sdpa gets a mask (``_masked``), transformers repeats k and v to every
    query head (integrations/sdpa_attention.py ``use_gqa_in_sdpa``: GQA only without a mask),
    and sdpa keeps the mask converted to the compute dtype, [B, 1, T, T], per layer. A fused
    qkv projection (Phi-3) hands attention v as a view of its output, which keeps the whole
    [n, q + 2 kv] output alive where v is kept as it is (not repeated)."""
    arch, s = kept.arch, kept.s
    n, a = kept.n, s.a
    qd, kv = arch.q_out, arch.kv_out
    groups = arch.heads // arch.kv_heads
    repeated = s.attn == "eager" or _masked(kept)
    v_kept = n * (qd if repeated and groups > 1 else kv) * a
    if arch.fused_qkv and not (repeated and groups > 1):
        v_kept = n * (qd + 2 * kv) * a  # the fused output v is a view of
    if s.attn == "eager":
        kv_kept = n * (qd if groups > 1 else kv) * a
        scores = s.batch * arch.heads * s.seq_len ** 2
        probs_t = [scores * 4] + ([scores * a] if a != 4 else [])  # fp32 softmax + its cast
        if arch.attn_softcap:
            probs_t.append(scores * a)  # tanh's output, kept for its backward
        kept.add("attention", n * qd * a, kv_kept, v_kept, *probs_t)
    else:
        k_kept = n * (qd if repeated and groups > 1 else kv) * a
        mask = s.batch * s.seq_len ** 2 * a if _masked(kept) else 0
        kept.add("attention", n * qd * a, n * qd * a, k_kept, v_kept, s.batch * arch.heads * s.seq_len * 4, mask)


def _attention_output_kept(kept: _Kept) -> None:
    """The output projection's saved input: eager's contiguous copy of the attention output;
    sdpa's output, already kept wherever attention itself needs grads."""
    out_proj = kept.block.group(STAGE_ATTN_OUT)
    qd, a = kept.arch.q_out, kept.s.a
    if kept.s.attn == "eager":
        if kept.full or any(lin.key in kept.s.keys for lin in out_proj):
            kept.add("linear_inputs", kept.n * qd * a)  # attn_output.transpose(1, 2).contiguous()
        _inputs_kept(kept, out_proj, qd, a, True)
    else:
        _inputs_kept(kept, out_proj, qd, a, kept.keep(STAGE_ATTN_IN))


def _mlp_kept(kept: _Kept) -> None:
    """The MLP's activations: silu keeps gate, the product keeps silu(gate) and up; a plain
    MLP's gelu keeps its input. MoE (integrations/moe.py, any experts implementation): each
    token runs top-k experts, so the MLP terms count n x k tokens at an expert's width; the fp32
    router softmax [n, E], the routing weights and indices, and each expert output kept for its
    routing weight's grad. Approximated: the dispatch's own index copies are not counted. A shared
    expert (modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock) is a dense gated MLP on every token, and
    sigmoid(shared_expert_gate(x)) * its output keeps both factors."""
    arch, block = kept.arch, kept.block
    n, k, a, w, h = kept.n, kept.k, kept.s.a, block.mlp_width, arch.hidden
    if block.moe:
        E = arch.experts
        act = 6 if arch.mlp_act == "clamped_swiglu" else 3  # gpt-oss: gate_up, both clamps, sigmoid, products
        kept.add("mlp", *[n * k * w * a] * act, n * k * h * a, n * E * 4, n * k * 8, n * k * 8, n * k * 4)
        if block.shared_width:
            kept.add("mlp", *[n * block.shared_width * a] * 3, n * h * a, n * a, n * a)
    elif arch.gated_mlp:
        kept.add("mlp", n * w * a, n * w * a, n * w * a)
    else:
        kept.add("mlp", n * w * a)  # the activation keeps its input


def layer_bytes(arch: ModelDesc, s: Setup, lowest: bool, block: Block | None = None) -> tuple[int, dict[str, int]]:
    """Bytes autograd keeps for backward in one decoder layer (transformers 5, PEFT, torch),
    for the block the model description gives (``block``; the first layer's by default), by
    kind: norms, Linear inputs, autocast's weight casts, adapters, attention, MLP.

    Derived from the saved tensors of each op (torch autograd saves only what the backward of
    inputs that require grad needs; checked against torch.autograd.graph.saved_tensors_hooks);
    each piece's docstring names the ops it counts. Every norm of the block is counted where it
    runs (Gemma's and OLMo2's post-norms, q/k norms over their projections).
    """
    kept = _layer_kept(arch, s, lowest, block)
    return sum(kept.parts.values()), kept.parts


def layer_tensors(arch: ModelDesc, s: Setup, lowest: bool, block: Block | None = None) -> list[tuple[str, int]]:
    """``layer_bytes`` one tensor at a time, in forward order: (kind, bytes)."""
    return _layer_kept(arch, s, lowest, block).tensors


def _layer_kept(arch: ModelDesc, s: Setup, lowest: bool, block: Block | None = None) -> _Kept:
    block = block or arch.blocks[0]
    kept = _Kept(arch, s, block, lowest, s.first_stage(arch) if lowest else 0)
    h = arch.hidden
    norms = block.norms()
    for stage, width in norms:
        if stage < STAGE_ATTN_IN:
            _norm_kept(kept, stage, width)
    _inputs_kept(kept, block.group(STAGE_ATTN_IN), h, kept.st, False)
    for stage, width in norms:
        if STAGE_ATTN_IN < stage < STAGE_ATTN_OUT:  # q/k norms
            _norm_kept(kept, stage, width)
    if kept.keep(STAGE_ATTN_IN):
        _attention_kept(kept)
    if kept.keep(STAGE_ATTN_OUT):
        _attention_output_kept(kept)
    for stage, width in norms:
        if STAGE_ATTN_OUT < stage <= STAGE_NORM2:
            _norm_kept(kept, stage, width)
    _inputs_kept(kept, block.group(STAGE_MLP_IN), h, kept.st, False)
    if kept.keep(STAGE_MLP_IN):
        _mlp_kept(kept)
    outs = block.group(STAGE_MLP_OUT)  # routed experts' down projections, and a dense (or shared) one
    _inputs_kept(kept, tuple(lin for lin in outs if lin.experts > 1), block.mlp_width, s.a, False)
    _inputs_kept(kept, tuple(lin for lin in outs if lin.experts == 1), block.shared_width or block.mlp_width, s.a,
                 False)
    for stage, width in norms:
        if stage > STAGE_MLP_OUT:
            _norm_kept(kept, stage, width)
    return kept


def offloaded(arch: ModelDesc, s: Setup, first: int) -> tuple[int, int, list[int], list[int]]:
    """What ``train.activation_offload`` moves to the host per micro-batch, as the runtime's
    hooks do (backends/cuda/offload.py): every storage of at least ``OFFLOAD_MIN_BYTES`` that the
    model's body saves before its output head, once each. Returns (bytes moved one way, the most
    back on the device at once in backward, each layer's bytes from ``first`` up, the final
    norm's and the body's shared tensors' bytes).

    Without checkpointing a layer's saved tensors (``layer_tensors``); with it, each layer's
    input, which non-reentrant checkpoint saves (torch/utils/checkpoint.py _NoopSaveInputs)
    where the hooks see it; the recomputation's tensors never leave. Backward brings one layer's
    back at a time, the final norm's first."""
    n, h, st = s.batch * s.seq_len, arch.hidden, (4 if s.autocast else s.wd)

    def moved(sizes: list[int]) -> int:
        return sum(b for b in sizes if b >= OFFLOAD_MIN_BYTES)

    layers = []
    for i in range(first, arch.layers):
        if s.ckpt:
            layers.append(moved([n * h * st]))
        else:
            layers.append(moved([b for _, b in layer_tensors(arch, s, i == first, arch.blocks[i])]))
    head = [n * h * 4, n * 4]  # the final RMSNorm's fp32 input and rsqrt
    if s.method == "full":
        head += [n * h * st, n * 8]  # its cast back to the weights' dtype; the embedding's int64 indices
    if s.attn == "sdpa" and s.padding_mask:
        head.append(s.batch * s.seq_len * s.seq_len)  # the bool [B, 1, T, T] mask every layer's sdpa keeps
    heads = [b for b in head if b >= OFFLOAD_MIN_BYTES]
    total = sum(layers) + sum(heads)
    return total, max([*layers, sum(heads), 0]), layers, heads


def reference_pass(arch: ModelDesc, s: Setup) -> dict[str, int]:
    """The reference's log-probs of one micro-batch under LoRA/DoRA/QLoRA
    (backends/cuda/preference.py ``_reference``): the same rows through the base with the
    adapters off under ``torch.no_grad()``, after the policy's forward (its saved activations
    and its fp32 log-softmax output alive) and before its backward. No graph: each layer's
    temporaries are freed as the next layer runs (the residual stream in and out, the MLP's
    intermediates, as the backward workspace counts them), then the head (``_row_logps``):
    the logits in the compute dtype over every position, their fp32 contiguous copy (``.float()``
    of the ``[:, :-1]`` view; where the logits are fp32 already, log_softmax's own
    ``contiguous()`` of that view makes it: measured under torch.profiler on the CPU, a 4 B per
    position and vocabulary entry that the reference adds beside the policy's log-probs) and
    log_softmax's output, from which the [rows] sums are gathered. ``s`` is the rows setup (finetune/planner/preference.py). Also the transient of
    each no-grad pass that precomputes a reference table before step 1.

    Returns bytes: ``layer`` (one layer's temporaries), ``head``, ``transient`` (the larger),
    ``forward_end`` (the head region at the reference's peak: the policy's kept fp32 log-probs
    and the reference's transient; the step's logits region is the larger of this and the
    backward's), ``with_logits`` (what it adds to the backward's: nothing, it is freed first)."""
    n, h, V, a = s.batch * s.seq_len, arch.hidden, arch.vocab, s.a
    st = 4 if s.autocast else s.wd
    w = max(b.mlp_width * (max(arch.top_k, 1) if b.moe else 1) for b in arch.blocks)
    layer = 2 * n * h * st + 3 * n * w * a
    # the head on the targets only (s.target_head: the gathered rows are contiguous, so fp32
    # logits are log-softmaxed as they are) or on every position (the view's fp32 copy)
    nt = s.head_rows(n)
    copy = nt * V * 4 if (a != 4 or not s.target_head) else 0
    logits = nt * V * a + copy + nt * V * 4
    head = n * h * st + (nt * h * st if s.target_head else 0) + logits  # final hidden states (+ gathered), logits
    cap = 2 * V * a * nt if arch.final_softcap else 0  # Gemma-2's soft-cap: the capped logits and tanh's output
    transient = max(layer, head + cap)
    return {"layer": layer, "head": head + cap, "transient": transient, "forward_end": 4 * nt * V + transient,
            "with_logits": 0}
