"""A training run's allocations as torch's caching allocator sees them, torch-free: the load, then
three steps, one tensor at a time, replayed through the allocator model
(``backends/cuda/allocator.py``) to plan *reserved* memory, the figure a GPU runs out in.

The sequence follows what the cuda runtime does (backends/cuda/runtime.py) with the sizes the
memory model prices (backends/cuda/memory.py): the weights as they load (a 4-bit weight through
its bf16 transient), the adapters, then per step and micro-batch the forward (each layer's saved
tensors in the order the forward creates them, ``layer_tensors``; the residual stream and the
MLP's largest temporary as transients; the head and the loss), the backward (the loss's
gradients, then each layer's workspace, its parameters' gradients and the release of what it
saved), the gradient sum of several ranks, the optimizer's state (created lazily at the first
step, as torch and bitsandbytes do), its workspace, and ``zero_grad(set_to_none=True)``.

Replayed, step 2's leap over step 1 comes out of it: the first step's optimizer state takes the
best-fitting cached blocks its activations left, so the second step's activations need new
segments while allocated stays where it was. Figures are reported as the replay's gap between
reserved and allocated, added to the memory model's allocated (calibrated per family against
torch's saved tensors): the allocator model says how much cache and fragmentation a step carries,
the memory model what is live.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from finetune.model.types import ModelDesc
from finetune.model.inventory import Setup, Tensor
from finetune.backends.cuda.allocator import AllocConf, CachingAllocator

# torch/csrc/cuda/CublasHandlePool.cpp (getChosenWorkspaceSize): the cuBLAS workspace torch
# allocates through the caching allocator on a handle's first GEMM, one per (handle, stream):
# ":4096:8" (32 MiB) on Hopper and newer (sm90+), ":4096:2:16:8" (8 MiB + 128 KiB) before;
# cuBLASLt's workspace (getCUDABlasLtWorkspace) is a second one of that size. The H200 run's
# census found 65 MiB allocated beyond every tensor of the model at the end of a step: the two,
# 64 MiB. The plan does not know the GPU's architecture: it takes Hopper's, the larger.
CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 8
CUBLAS_WORKSPACES = 2


@dataclass
class Trace:
    """Events for the allocator model: ("alloc", key, bytes), ("free", key, 0), ("mark", phase, 0)."""

    events: list[tuple[str, Any, int]] = field(default_factory=list)
    _next: int = 0

    def alloc(self, nbytes: int) -> int | None:
        if nbytes <= 0:
            return None
        self._next += 1
        self.events.append(("alloc", self._next, int(nbytes)))
        return self._next

    def free(self, *keys: int | None) -> None:
        for k in keys:
            if k is not None:
                self.events.append(("free", k, 0))

    def mark(self, phase: str) -> None:
        self.events.append(("mark", phase, 0))


@dataclass
class PhaseFigures:
    """What the replay measured in one phase: the allocator's peaks and where it ended."""

    peak_allocated: int = 0
    peak_reserved: int = 0
    end_allocated: int = 0
    end_reserved: int = 0


def replay(trace: Trace, conf: AllocConf, device_total: int | None = None) -> dict[str, PhaseFigures]:
    """Run ``trace`` through the caching allocator model; figures per phase (by its marks: the
    phase a mark names runs from it to the next mark)."""
    a = CachingAllocator(conf)
    live: dict[Any, int] = {}
    out: dict[str, PhaseFigures] = {}
    cur: PhaseFigures | None = None
    for op, key, nbytes in trace.events:
        if op == "alloc":
            live[key] = a.malloc(nbytes)
        elif op == "free":
            a.free(live.pop(key))
        elif op == "empty_cache":
            a.empty_cache()
        else:  # mark: close the phase before, open this one
            if cur is not None:
                cur.end_allocated, cur.end_reserved = a.allocated, a.reserved
            a.reset_peaks()
            cur = out.setdefault(str(key), PhaseFigures())
            continue
        if cur is not None:
            cur.peak_allocated = max(cur.peak_allocated, a.allocated)
            cur.peak_reserved = max(cur.peak_reserved, a.reserved)
    if cur is not None:
        cur.end_allocated, cur.end_reserved = a.allocated, a.reserved
    return out


# ---- the sequence ---------------------------------------------------------------------------------

def _module_of(t: Tensor) -> str:
    if t.layer is not None:
        return f"layer.{t.layer}"
    return "embed" if t.role == "embed" else "head"


def build(arch: ModelDesc, s: Setup, held: list[Tensor], mm: Any, assign: dict[str, int], device: int,
          buffers: dict[str, dict[str, Any]], steps: int = 3, empty_cache_every: int = 0,
          zero_grad_first: bool = False, outputs_kept: bool = False) -> Trace:
    """The load and ``steps`` training steps of one rank, as device ``device`` of a
    ``device_map=auto`` split sees them (``assign``: module -> device; one device: all 0).

    Args:
        arch, s: the model description and the resolved setup.
        held: the tensors one rank holds (FSDP's shards), ``mm.rank_tensors``.
        mm: the cuda memory model (backends/cuda/memory.py).
        assign: the planner's module -> device split.
        device: the device to trace.
        buffers: the ranks' collective buffers (``mm.collective_buffers``), each in its phase.
        steps: steps after the load (phase marks "step1", "step2", ... ; "load" before).
        empty_cache_every: ``memory.empty_cache_every``: torch.cuda.empty_cache() after every N-th
            step (0: never), as the run does.
        zero_grad_first, outputs_kept: another loop than ours, for planning runs others measured
            (PEFT's method_comparison/MetaMathQA/run.py, a plain PyTorch loop): ``zero_grad_first``
            calls ``optimizer.zero_grad()`` at the start of each step, before the forward, so the
            gradients live on through the optimizer step and ``empty_cache`` into the next step;
            ``outputs_kept`` holds the model's output (``outputs = model(**batch)``: the logits of
            every position in the compute dtype and the KV cache, whose DynamicCache keeps every
            layer's key and value states) from its forward until the next step's forward returns.
            Our loop does neither (zero_grad after the step, the head's output freed with the loss).
    """
    tr = Trace()
    on = {m for m, d in assign.items() if d == device}
    mine = [t for t in held if _module_of(t) in on]
    tr.mark("load")
    weights = _load(tr, s, mine, mm)
    del weights  # held for the whole run
    trainable = [t for t in mine if t.trainable]
    state_keys: list[int | None] = []
    first = 0 if s.method == "full" else min(s.lora_layers)
    layers_here = [i for i in range(arch.layers) if f"layer.{i}" in on]
    last_device = assign.get("head", 0) == device
    first_device = assign.get("embed", 0) == device
    widths = list(s.step_widths)
    cublas: list[int | None] | None = None
    grads: dict[str, int | None] = {}
    outputs: list[int | None] = []  # the previous step's model output, where the loop keeps it
    for step in range(1, steps + 1):
        tr.mark(f"step{step}:forward")
        if cublas is None:  # the first GEMM's handle workspaces, kept
            cublas = [tr.alloc(CUBLAS_WORKSPACE_BYTES) for _ in range(CUBLAS_WORKSPACES)]
        if zero_grad_first:  # optimizer.zero_grad(set_to_none=True) before the forward
            tr.free(*grads.values())
        grads = {}
        # a third micro-batch repeats the second's pattern exactly: two show the step's reserve
        # the data's own widths for its first steps where known, the planned width after them
        sk = dataclasses.replace(s, seq_len=widths[step - 1]) if step <= len(widths) else s
        n = sk.batch * sk.seq_len
        pieces = mm.activation_pieces(arch, sk, max(arch.layers - first, 1))
        for micro in range(min(s.grad_accum, 2)):
            outputs = _micro_batch(tr, arch, sk, mm, trainable, grads, pieces, layers_here, first, n,
                                   first_device, last_device, buffers, accumulate=micro > 0,
                                   outputs=outputs if outputs_kept else None)
        for b in buffers.values():
            if b["phase"] == "grad_sync":
                tr.free(tr.alloc(b["bytes"]))
        tr.mark(f"step{step}:optimizer")
        if s.cpu_offload:  # backend.cpu_offload: gradients, state and the step on the host
            tr.free(*grads.values())
            grads = {}
            continue
        if step == 1:  # lazy optimizer state (torch _init_group, bitsandbytes init_state)
            for t in trainable:
                state_keys += [tr.alloc(b) for b in _state_tensors(s, t, mm)]
            shared = mm.optimizer_shared_bytes(s, trainable) if device == 0 else 0
            state_keys.append(tr.alloc(shared))
        work = mm.optimizer_transient(s, trainable)
        if work:
            if work == sum(t.local_numel * t.dtype_bytes for t in trainable):  # foreach: a list
                keys = [tr.alloc(t.local_numel * t.dtype_bytes) for t in trainable]
                tr.free(*keys)
            else:
                tr.free(tr.alloc(work))
        if not zero_grad_first:
            tr.free(*grads.values())  # zero_grad(set_to_none=True)
            grads = {}
        if empty_cache_every and step % empty_cache_every == 0:
            tr.events.append(("empty_cache", 0, 0))
    return tr


def _load(tr: Trace, s: Setup, mine: list[Tensor], mm: Any) -> list[int | None]:
    """The weights as from_pretrained places them, then PEFT's adapters. A 4-bit weight passes
    through its bf16/fp16 copy on the device (transformers' bitsandbytes quantizer: the weight is
    loaded in the compute dtype, then Params4bit quantizes it, one weight at a time)."""
    keys: list[int | None] = []
    base = [t for t in mine if t.role not in ("lora_A", "lora_B", "dora_m")]
    adapters = [t for t in mine if t.role in ("lora_A", "lora_B", "dora_m")]
    # transformers (modeling_utils.py caching_allocator_warmup) first allocates and frees one
    # tensor of the bytes the model's parameters will take on the device (4-bit ones at half a
    # byte an element), so the load carves every weight out of that one cached segment
    warm = sum(mm.weight_bytes(t, s)[0] for t in base)
    sharded = s.strategy == "fsdp" and s.world_size > 1
    if mm.host_offload.sharded_load(s):
        # each rank reads only its rows (backends/cuda/sharded_load.py): a 4-bit weight comes to
        # the device whole in the weights' dtype and is quantized there, one at a time, keeping
        # its constants and its rows; every other weight sends only its rows. Under cpu_offload
        # the rows stay on the host (the adapters' shards go there too, at fully_shard)
        for t in base:
            w, q = mm.weight_bytes(t, s)
            if t.quant == "bnb4":
                packed, q = mm.bnb4_bytes(t.numel, s.double_quant)
                full_w, packed_whole = tr.alloc(t.numel * s.wd), tr.alloc(packed)
                keys.append(tr.alloc(q))
                tr.free(full_w)  # Params4bit._quantize's input, gone with it
                if not s.cpu_offload:
                    keys.append(tr.alloc(w))
                tr.free(packed_whole)
            elif not s.cpu_offload:
                keys.append(tr.alloc(w))
        if not s.cpu_offload:
            keys += [tr.alloc(mm.weight_bytes(t, s)[0]) for t in adapters]
        return keys
    if mm.host_offload.loads_on_host(s):
        # qlora or backend.cpu_offload under fsdp: the runtime loads (and quantizes) the whole
        # model on the host; fully_shard moves a unit at a time to the device and keeps its rows
        # there, or sends them back to the host under cpu_offload (backends/cuda/host_offload.py):
        # the device keeps the 4-bit weights' quantization constants and the shards it is not
        # offloading, and briefly the largest unit whole
        units: dict[int | None, int] = {}
        for t in base:
            w, q = mm.bnb4_bytes(t.numel, s.double_quant) if t.quant == "bnb4" else (t.numel * t.dtype_bytes, 0)
            units[t.layer] = units.get(t.layer, 0) + w
            if q:
                keys.append(tr.alloc(q))
        if not s.cpu_offload:  # the shards stay on the device, the adapters' too
            keys += [tr.alloc(mm.weight_bytes(t, s)[0]) for t in base + adapters]
        tr.free(tr.alloc(max(units.values(), default=0)))  # one unit whole while fully_shard splits it
        return keys
    if sharded:
        # the runtime loads the whole model on every rank (from_pretrained), then FSDP2's
        # fully_shard keeps each rank's rows and frees the rest (backends/cuda/runtime.py
        # _distribute): the load peaks at the whole model, not the shard
        whole, consts = [], []
        for t in base:  # a 4-bit weight quantized as it loads (one compute-dtype copy at a time)
            if t.quant == "bnb4":
                tmp = tr.alloc(t.numel * s.a)
                packed, q = mm.bnb4_bytes(t.numel, s.double_quant)
                whole.append(tr.alloc(packed))
                consts.append(tr.alloc(q))  # its QuantState: not a parameter, kept whole
                tr.free(tmp)
            else:
                whole.append(tr.alloc(t.numel * t.dtype_bytes))
        tr.free(tr.alloc(warm))
        shards = [tr.alloc(mm.weight_bytes(t, s)[0]) for t in base]
        tr.free(*whole)
        keys += shards + consts
        base = []
    else:
        tr.free(tr.alloc(warm))
    for t in base + adapters:
        w, q = mm.weight_bytes(t, s)
        if t.quant == "bnb4":
            tmp = tr.alloc(t.numel * s.a)
            keys += [tr.alloc(w), tr.alloc(q)]
            tr.free(tmp)
        else:
            keys.append(tr.alloc(w))
    return keys


def _state_tensors(s: Setup, t: Tensor, mm: Any) -> list[int]:
    """One trainable tensor's optimizer state as separate allocations (the allocator-held part)."""
    held, _paged = mm.optimizer_state_bytes(s.optim, t.local_shape, t.dtype_bytes, s.device == "cuda", s.momentum,
                                            host_step=s.device == "cpu")
    if s.optim in ("adamw", "adam"):
        return [held // 2, held - held // 2]  # exp_avg, exp_avg_sq
    if s.optim in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw") and held:
        return [held // 2, held - held // 2]  # state1/state2 (or their absmax where paged)
    return [held]


def _micro_batch(tr: Trace, arch: ModelDesc, s: Setup, mm: Any, trainable: list[Tensor],
                 grads: dict[str, int | None], pieces: dict[str, Any], layers: list[int], first: int, n: int,
                 first_device: bool, last_device: bool, buffers: dict[str, dict[str, Any]],
                 accumulate: bool, outputs: list[int | None] | None = None) -> list[int | None]:
    """One micro-batch's forward and backward on this device. ``outputs``: None where the loop
    drops the model's output with the loss; else the output the loop still holds (freed once
    this forward returns its own), and the return is this micro-batch's (``build``'s
    ``outputs_kept``)."""
    kept_out: list[int | None] = []
    h, st = arch.hidden, (4 if s.autocast else s.wd)
    by_layer: dict[int | None, list[Tensor]] = {}
    for t in trainable:
        by_layer.setdefault(t.layer, []).append(t)
    bufs = [tr.alloc(b["bytes"]) for b in buffers.values() if b["phase"] == "forward_backward"]
    done: set[str] = set()  # parameters whose gradient this micro-batch produced
    # forward
    hidden = tr.alloc(n * h * st)  # the embeddings' output (or the previous device's hidden states)
    saved: dict[int, list[tuple[str, int | None]]] = {}
    # train.activation_offload: what the hooks copy to the host leaves the device as it is saved
    # and comes back at its layer's backward (index in ``saved[i]``, bytes)
    away: dict[int, list[tuple[int, int]]] = {}
    thr = mm.OFFLOAD_MIN_BYTES
    for i in layers:
        block = arch.blocks[i]
        w = block.mlp_width * (max(arch.top_k, 1) if block.moe else 1)
        if i < first:  # no graph below the lowest adapted layer: temporaries only
            tr.free(tr.alloc(n * w * s.a))
        elif s.ckpt:
            saved[i] = [("input", tr.alloc(n * h * st))]  # the checkpointed layer's input
            tr.free(*[tr.alloc(b) for _, b in mm.layer_tensors(arch, s, i == first, block)])
            sizes = [n * h * st]
        else:
            saved[i] = _layer_forward(tr, arch, s, mm, block, i == first, n,
                                      kept_out if outputs is not None else None)
            tr.free(tr.alloc(n * w * s.a))  # the MLP's product before down_proj
            sizes = [b for _, b in mm.layer_tensors(arch, s, i == first, block)]
        if s.offload and i in saved:
            away[i] = [(j, b) for j, b in enumerate(sizes) if b >= thr]
            for j, _ in away[i]:
                tr.free(saved[i][j][1])
                saved[i][j] = (saved[i][j][0], None)
        nxt = tr.alloc(n * h * st)  # the residual stream after the layer
        tr.free(hidden)
        hidden = nxt
    head_keys: list[int | None] = []
    logits_keys: list[int | None] = []
    V = arch.vocab
    nt = s.head_rows(n)
    if last_device:
        norm = [n * h * 4, n * 4]  # the final norm's, which the offload moves
        head_keys = [tr.alloc(b) for b in norm] + [tr.alloc(pieces["head"] - n * h * 4 - n * 4)]
        if s.offload:
            for j, b in enumerate(norm):
                if b >= thr:
                    tr.free(head_keys[j])
                    head_keys[j] = None
        if s.loss_chunk and s.loss_chunk < nt:
            logits_keys = [tr.alloc(4 * nt * h)]  # the target hidden states' gradient, kept for backward
        else:
            la = tr.alloc(nt * V * s.a)  # the head's output in the compute dtype
            lf = tr.alloc(nt * V * 4)  # .float()
            logits_keys = [tr.alloc(nt * V * 4)]  # log_softmax's output, kept
            if arch.final_softcap:
                logits_keys.append(tr.alloc(2 * V * s.a * nt))  # the capped logits and tanh's output
            if outputs is not None:  # outputs.logits, held by the loop
                kept_out.append(la)
                la = None
            tr.free(lf, la)
    tr.free(hidden)
    if outputs is not None:  # the loop's ``outputs`` now names this forward's: the previous one is freed
        tr.free(*outputs)
    if s.reference == "adapters_off":  # a preference step's reference: the rows again, no graph
        _reference_forward(tr, arch, s, mm, layers, first_device, last_device)
    if not accumulate:
        tr.mark(_phase(tr, "backward"))
    # backward
    if last_device:
        if s.loss_chunk and s.loss_chunk < nt:
            c = s.loss_chunk
            chunk = [tr.alloc(c * V * 4) for _ in range(3)]  # one chunk's logits, softmax, gradient
            tr.free(*chunk)
        else:
            g1 = tr.alloc(nt * V * 4)  # nll_loss's dense gradient
            g2 = tr.alloc(nt * V * 4)  # log_softmax's gradient
            tr.free(g1, *logits_keys)
            logits_keys = []
            g3 = tr.alloc(nt * V * s.a)  # back through .float()
            tr.free(g2)
            _grads(tr, [t for t in by_layer.get(None, []) if t.role != "embed"], grads, done, accumulate, s.cpu_offload)
            tr.free(g3)
        if s.offload:  # the final norm's saved tensors come back for its backward
            head_keys += [tr.alloc(b) for b in norm if b >= thr]
        tr.free(*logits_keys, *head_keys)
    grad_h = tr.alloc(n * h * st)
    for i in reversed(layers):
        if i not in saved:
            continue
        block = arch.blocks[i]
        w = block.mlp_width * (max(arch.top_k, 1) if block.moe else 1)
        kept = saved.pop(i)
        for j, b in away.get(i, []):  # the offloaded ones back on the device for the layer's backward
            kept[j] = (kept[j][0], tr.alloc(b))
        if s.ckpt:  # recompute the layer (its input stays kept until the layer is done)
            kept = kept + [(k, tr.alloc(b)) for k, b in mm.layer_tensors(arch, s, i == first, block)]
        # autograd runs the MLP's backward first, then attention's, freeing each op's saved
        # tensors as it goes: the MLP half's workspace, gradients and release, then attention's
        cut = max((j + 1 for j, (kind, _) in enumerate(kept) if kind == "attention"), default=0)
        params = by_layer.get(i, [])
        ws = [tr.alloc(n * w * s.a) for _ in range(3)]  # grads of the MLP's intermediates
        # each op's saved tensors are released once its backward has run, so the MLP half's
        # are freed as its parameters' gradients appear, from the last op back (down_proj's
        # input after its gradient, then the activation's, then the norm's)
        after = [t for t in params if _after_attention(t)][::-1]
        mine = [k for _, k in kept[cut:]][::-1]
        for j, t in enumerate(after):
            _grads(tr, [t], grads, done, accumulate, s.cpu_offload)
            upto = len(mine) * (j + 1) // len(after)
            tr.free(*mine[:upto])
            mine = mine[upto:]
        mid = tr.alloc(n * h * st)  # the gradient at the MLP's input
        tr.free(*ws, *mine)
        ws = [tr.alloc(n * h * 4) for _ in range(2)]  # the fp32 residual stream's gradients
        _grads(tr, [t for t in params if not _after_attention(t)], grads, done, accumulate, s.cpu_offload)
        nxt = tr.alloc(n * h * st)
        tr.free(*ws, *(k for _, k in kept[:cut]), mid, grad_h)
        grad_h = nxt
    _grads(tr, by_layer.get(None, []), grads, done, accumulate, s.cpu_offload)  # the embeddings' (and a chunked head's)
    tr.free(grad_h, *bufs)
    return kept_out


def _reference_forward(tr: Trace, arch: ModelDesc, s: Setup, mm: Any, layers: list[int], first_device: bool,
                       last_device: bool) -> None:
    """The reference's no-grad forward of a preference step (backends/cuda/preference.py
    ``_reference``, the memory model's ``reference_pass``): each layer's temporaries freed as
    the next runs, then the head's logits, their fp32 copy and log-softmax, all freed once the
    [rows] log-probs are gathered. The policy's saved tensors and log-probs stay alive."""
    ref = mm.reference_pass(arch, s)
    n, st = s.batch * s.seq_len, (4 if s.autocast else s.wd)
    hidden = tr.alloc(n * arch.hidden * st) if (first_device or layers) else None
    for _ in layers:
        tr.free(tr.alloc(ref["layer"] - 2 * n * arch.hidden * st))  # the layer's temporaries
        nxt = tr.alloc(n * arch.hidden * st)
        tr.free(hidden)
        hidden = nxt
    if last_device:
        V = arch.vocab
        la = tr.alloc(n * V * s.a)  # the logits, every position
        cap = tr.alloc(2 * V * s.a * n if arch.final_softcap else 0)
        lf = tr.alloc(n * V * 4)  # .float() of the [:, :-1] view (fp32 already: log_softmax's contiguous copy)
        lp = tr.alloc(n * V * 4)  # log_softmax's output, gathered
        tr.free(la, cap, lf, lp)
    tr.free(hidden)


def _after_attention(t: Tensor) -> bool:
    """Whether a layer's parameter belongs to the part after attention (its MLP or experts, the
    norms around them), whose gradients backward produces first."""
    return any(k in t.name for k in ("mlp", "moe", "expert", "feed_forward", "ffn", "post_attention_layernorm",
                                      "pre_feedforward", "post_feedforward"))


def _layer_forward(tr: Trace, arch: ModelDesc, s: Setup, mm: Any, block: Any, lowest: bool,
                   n: int, cache: list[int | None] | None = None) -> list[tuple[str, int | None]]:
    """One layer's saved tensors in forward order, with the temporaries its forward frees as it
    goes where they are as large (transformers' modeling code, e.g. modeling_qwen2.py):
    RMSNorm's ``hidden.pow(2)`` (fp32 [n, h]) before each norm's kept tensors, and RoPE's
    ``q * cos``, ``rotate_half(q)`` and its product with ``sin`` (three [n, q_out] and three
    [n, kv_out] in the compute dtype, beside the projections' outputs) before attention.

    ``cache``: where the forward fills a KV cache (transformers' DynamicCache, ``use_cache``
    true), the layer's key (after RoPE) and value states [n, kv_out] stay referenced by it and
    are appended there: they are new tensors where attention repeats them for its own use
    (``repeat_kv``: eager, or sdpa with a mask), else the very tensors attention keeps."""
    keys: list[tuple[str, int | None]] = []
    seen: set[str] = set()
    for kind, b in mm.layer_tensors(arch, s, lowest, block):
        if kind not in seen:
            seen.add(kind)
            if kind == "norms":
                tr.free(tr.alloc(n * arch.hidden * 4))
            elif kind == "attention":
                for width in (arch.q_out, arch.kv_out):
                    proj = tr.alloc(n * width * s.a)
                    tmp = [tr.alloc(n * width * s.a) for _ in range(3)]
                    tr.free(*tmp, proj)
                if cache is not None and _kv_repeated(arch, s, block):
                    cache += [tr.alloc(n * arch.kv_out * s.a) for _ in range(2)]
        keys.append((kind, tr.alloc(b)))
    if cache is not None and not _kv_repeated(arch, s, block):
        # attention's own k and v (its 3rd and 4th tensors): the cache keeps them past backward
        att = [j for j, (kind, _) in enumerate(keys) if kind == "attention"]
        for j in att[2:4]:
            cache.append(keys[j][1])
            keys[j] = (keys[j][0], None)
    return keys


def _kv_repeated(arch: ModelDesc, s: Setup, block: Any) -> bool:
    """Whether attention repeats k and v to every query head for itself (activations.py
    ``_attention_kept``: eager, or sdpa given a mask), so a KV cache's states are other tensors."""
    window = block.sliding and arch.sliding_window
    masked = s.padding_mask or bool(window and s.seq_len >= window)
    return arch.heads != arch.kv_heads and (s.attn == "eager" or masked)


def _phase(tr: Trace, phase: str) -> str:
    """The mark of ``phase`` in the step the trace is in."""
    step = next(str(k).split(":")[0] for op, k, _ in reversed(tr.events) if op == "mark")
    return f"{step}:{phase}"


def _grads(tr: Trace, ts: list[Tensor], grads: dict[str, int | None], done: set[str], accumulate: bool,
           offload: bool = False) -> None:
    """Parameters' gradients as their layer's backward produces them: the first micro-batch's
    become ``.grad`` (AccumulateGrad keeps the computed tensor); a later one's is added in place
    (the computed gradient is a temporary). ``offload`` (backend.cpu_offload): each is copied to
    the host as it is reduced, so on the device it is a temporary."""
    for t in ts:
        if t.name in done:
            continue
        done.add(t.name)
        b = t.local_numel * t.dtype_bytes
        if offload:
            tr.free(tr.alloc(b))
            continue
        if t.name in grads:
            if accumulate:
                tr.free(tr.alloc(b))
            continue
        grads[t.name] = tr.alloc(b)
