"""Pricing: one setup's inventory turned into bytes per category, per device and per phase.

Generic: what a backend's framework holds (weight storage, optimizer state, activations, device
overhead) comes from its memory model (``finetune/backends/<name>/memory.py``).
"""

from __future__ import annotations

from typing import Any, cast

from finetune.backends import capabilities, memory_model
from finetune.model.types import ModelDesc
from finetune.planner import preference
from finetune.planner.setup import GRAD_ACTIVATION_OVERLAP, inventory, resolve
from finetune.model.inventory import Setup, Tensor
from finetune.records import PLAN_KEYS, RANK_KEYS, PlanBytes, PlanCore, PlanDevice, PlanTotals
from finetune.spec import RunSpec


def activations(arch: ModelDesc, s: Setup) -> tuple[int, int, dict[str, int]]:
    """(activation bytes, logits+loss bytes, detail); their sum is the step's peak above
    weights, optimizer state and gradients.

    Activations are what autograd / mlx's vjp keep for backward plus the backward workspace
    where it is not already covered by the logits region (detail: saved_layers, head,
    backward_workspace).

    Only layers that need gradients keep anything: with adapters on the top N layers the
    forward below them runs without a graph. Gradient checkpointing keeps each such layer's
    input and recomputes one layer at a time during backward.
    """
    s = preference.rows_setup(s)  # a preference step: 2 rows a pair (the same setup for SFT)
    L = arch.layers
    first = 0 if s.method == "full" else min(s.lora_layers)
    backward_layers = L - first
    detail: dict[str, int] = {"layers_with_grad": backward_layers}
    p = memory_model(s.backend).activation_pieces(arch, s, backward_layers)
    layer, lparts, low, head, transient, logits = (p["layer"], p["layer_parts"], p["lowest"], p["head"],
                                                   p["transient"], p["logits"])
    # every layer with gradients, each priced for its own block (MoE and dense layers can mix)
    ckpt_input, ckpt_recompute = p["ckpt_input"], p["ckpt_recompute"]
    if backward_layers == 0:
        saved, recompute = 0, 0
    elif s.ckpt:
        saved, recompute = backward_layers * ckpt_input, ckpt_recompute  # inputs; one layer recomputed in backward
    else:
        saved, recompute = p["saved"], 0
    workspace = transient + recompute
    # Where the framework frees the loss's backward before the layers' (torch), only the larger
    # of the two adds to the kept activations; where it evaluates both as one graph (mlx), the
    # workspace coexists with the logits (the memory model's WORKSPACE_WITH_LOGITS).
    extra = workspace if memory_model(s.backend).WORKSPACE_WITH_LOGITS else max(0, workspace - logits)
    # activation offload: what the body saved is in host memory but for what backward has
    # brought back at once (the memory model's offload/offload_back; 0 where it does not apply)
    off, back, off_head = p.get("offload", 0), p.get("offload_back", 0), p.get("offload_head", 0)
    if off:
        detail.update({"offloaded": off, "offload_back": back})
        saved, head = saved - (off - off_head) + back, head - off_head
    detail.update({"per_layer": layer, "lowest_layer": low, "saved_layers": saved, "head": head,
                   "backward_workspace": workspace, **{f"per_layer_{k}": v for k, v in lparts.items()}})
    ref = preference.step_reference(arch, s)
    if ref is not None:
        # the reference's no-grad forward runs at the end of the policy's, beside its kept
        # log-probs (cuda: the head region is the larger of that moment and the loss's
        # backward), or in one graph with the loss's backward (mlx: what it adds to that)
        with_ref = max(logits + ref.get("with_logits", 0), ref["forward_end"])
        detail.update(reference_pass=ref["transient"], reference_pass_added=with_ref - logits)
        logits = with_ref
    return saved + head + extra, logits, detail



# ---- device split ---------------------------------------------------------------------------------

def _split_layers(sizes: list[tuple[str, int]], n_devices: int) -> dict[str, int]:
    """Assign modules (in forward order) to GPUs the way transformers' device_map="auto"
    does through accelerate 1.15 (accelerate/utils/modeling.py): get_balanced_memory caps each
    GPU but the last at total // N + 1.25 x max(largest decoder layer, mean module); then
    infer_auto_device_map fills GPUs in order, GPU 0 (a "main device") keeping room for the
    largest layer, the last GPU taking what is left."""
    if n_devices <= 1:
        return {name: 0 for name, _ in sizes}
    total = sum(b for _, b in sizes)
    largest = max((b for n, b in sizes if n.startswith("layer.")), default=0)
    per_gpu = total // n_devices + int(1.25 * max(largest, total / max(len(sizes), 1)))
    caps = [per_gpu - largest] + [per_gpu] * (n_devices - 2) + [None]
    out, dev, used = {}, 0, 0
    for name, b in sizes:
        while (cap := caps[dev]) is not None and used + b > cap and dev < n_devices - 1:
            dev, used = dev + 1, 0
        out[name] = dev
        used += b
    return out


# ---- the plan -------------------------------------------------------------------------------------

def _module_of(t: Tensor) -> str:
    if t.layer is not None:
        return f"layer.{t.layer}"
    return "embed" if t.role == "embed" else "head"

def _count(tensors: list[Tensor]) -> tuple[int, int]:
    return sum(t.numel for t in tensors), sum(t.numel for t in tensors if t.trainable)

def trainable_params(spec: RunSpec) -> int:
    """Parameters the optimizer updates, as the backends count them after building adapters:
    LoRA r * (in + out) per adapted Linear (+ out for DoRA's magnitude), or every parameter for
    method=full (tied embeddings once)."""
    arch, s = resolve(spec)
    return _count(inventory(arch, s))[1]

def params_total(spec: RunSpec) -> int:
    """Every parameter by logical element (a 4-bit weight counts its real shape), adapters
    included, tied embeddings once: backends' ModelInfo.params_total."""
    arch, s = resolve(spec)
    return _count(inventory(arch, s))[0]

_MODULE_KEYS = ("weights", "quant", "trainable_weights", "grads", "optimizer_state", "optimizer_state_paged", "round")


def _bytes_by_module(held: list[Tensor], s: Setup, mm: Any, on_gpu: bool) -> dict[str, dict[str, int]]:
    """Bytes of one rank's tensors grouped by module (``_MODULE_KEYS`` each), so a split
    model's share can be priced per device: weights (quantization constants included),
    trainable weights, their gradients and optimizer state, and the allocator's rounding."""
    by_module: dict[str, dict[str, int]] = {}
    for t in held:
        mod = by_module.setdefault(_module_of(t), dict.fromkeys(
            _MODULE_KEYS, 0))
        w, q = mm.weight_bytes(t, s)
        mod["weights"] += w + q
        mod["quant"] += q
        mod["round"] += mm.rounding_bytes(w, s)
        if t.trainable:
            mod["trainable_weights"] += w
            mod["grads"] += w  # a gradient has its parameter's shape and dtype
            st, paged = mm.optimizer_state_bytes(s.optim, t.local_shape, t.dtype_bytes, on_gpu, s.momentum,
                                                 host_step=s.device == "cpu")
            mod["optimizer_state"] += st
            mod["optimizer_state_paged"] += paged
            mod["round"] += 2 * mm.rounding_bytes(w, s)
    return by_module


def _across_devices(devices: list[PlanDevice]) -> PlanTotals:
    """The whole model's figures: the one device's, or the devices' sums with the phase of the
    device that peaks highest."""
    if len(devices) == 1:
        return devices[0]
    tot = cast(PlanBytes, {k: sum(dv["bytes"][k] for dv in devices) for k in PLAN_KEYS})
    worst = max(devices, key=lambda dv: dv["peak_bytes"])
    return {"bytes": tot,
            "steady_state_allocated_bytes": sum(dv["steady_state_allocated_bytes"] for dv in devices),
            "peak_allocated_bytes": sum(dv["peak_allocated_bytes"] for dv in devices),
            "peak_bytes": sum(dv["peak_bytes"] for dv in devices), "peak_phase": worst["peak_phase"]}


def _core(arch: ModelDesc, s: Setup) -> PlanCore:
    """Price one setup: categories, steady state, peak, per device."""
    tensors = inventory(arch, s)
    total, trainable = _count(tensors)
    mm = memory_model(s.backend)
    on_gpu = s.device == capabilities(s.backend).gpu_device
    # What one rank holds (whole replicas, or FSDP's shards) and what its collectives add.
    held = mm.rank_tensors(tensors, s)
    buffers = mm.collective_buffers(tensors, s)
    by_module = _bytes_by_module(held, s, mm, on_gpu)
    trainable_t = [t for t in held if t.trainable]
    qmaps = mm.optimizer_shared_bytes(s, trainable_t)
    _, logits, act_detail = activations(arch, s)
    opt_tr = mm.optimizer_transient(s, trainable_t)

    # Modules on devices (device_map=auto over N GPUs; one device otherwise).
    order = ["embed"] + [f"layer.{i}" for i in range(arch.layers)] + ["head"]
    assign = _split_layers([(m, by_module.get(m, {}).get("weights", 0)) for m in order], s.n_devices)
    n_dev = s.n_devices
    first = 0 if s.method == "full" else min(s.lora_layers)
    layer_share = act_detail["saved_layers"]
    per_dev_layers = [0] * n_dev
    for i in range(first, arch.layers):
        per_dev_layers[assign[f"layer.{i}"]] += 1
    devices: list[PlanDevice] = []
    bw_layers = max(arch.layers - first, 1)
    for d in range(n_dev):
        mods = [m for m in order if assign[m] == d]
        agg = {k: sum(by_module.get(m, {}).get(k, 0) for m in mods) for k in
               _MODULE_KEYS}
        if d == 0:
            agg["optimizer_state"] += qmaps
        last = d == assign["head"]
        # Activations: the layers on this device; the head and logits live with lm_head; each
        # device runs its own layers' backward workspace.
        dev_logits = logits if last else 0
        workspace = act_detail["backward_workspace"]
        dev_act = (layer_share * per_dev_layers[d]) // bw_layers + (
            workspace if mm.WORKSPACE_WITH_LOGITS else max(0, workspace - dev_logits))
        if last:
            dev_act += act_detail["head"]
        devices.append(_price(s, agg, dev_act, dev_logits, opt_tr if agg["grads"] else 0, d, mods, buffers))
    # the phases replay a step at its rows (2 a pair under a preference objective)
    for dev, extra in zip(devices, mm.device_phases(arch, preference.rows_setup(s), held, assign, buffers,
                                                    cast(list[dict[str, Any]], devices))):
        dev.update(extra)  # type: ignore[typeddict-item]
    preference.add_table(s, cast(list[Any], devices))  # a precomputed reference's log-probs, where held
    worst = max(devices, key=lambda dv: max(p["device_bytes"] for p in dv["phases"].values()))
    level = max(p["device_bytes"] for p in worst["phases"].values())
    summary = _across_devices(devices)
    return {
        "params_total": total, "params_trainable": trainable,
        "bytes": summary["bytes"],
        "steady_state_allocated_bytes": summary["steady_state_allocated_bytes"],
        "peak_allocated_bytes": summary["peak_allocated_bytes"],
        "peak_bytes": summary["peak_bytes"],
        "peak_phase": summary["peak_phase"],
        "max_device_peak_bytes": max(dv["peak_bytes"] for dv in devices),
        "per_device": devices,
        "activations_detail": act_detail,
        "quant_constants_bytes": sum(m["quant"] for m in by_module.values()),
        "optimizer_step_workspace_bytes": opt_tr,
        # the ranks' collective buffers: {name: {bytes, phase they add to}}, in per_device too
        "collective_buffers": buffers,
        "per_rank": _per_rank(s, devices[0]) if s.world_size > 1 else None,
        # the phases of the device whose device level peaks highest (every device's in per_device)
        "phases": worst["phases"],
        "max_device_level_bytes": level,
        # what ``fits`` is judged on: the device level where the backend plans one above its
        # allocator (a GPU: reserved, context, kernels, paged state), else the peak with overhead
        # (less what the device gives back under pressure: paged optimizer state)
        "fits_bytes": (level - worst["evictable_bytes"]) if worst["device_level_planned"]
        else max(dv["peak_bytes"] for dv in devices),
        "max_host_bytes": max(p["host_bytes"] for p in worst["phases"].values()),
        "step2_reserved_leap_bytes": worst["step2_reserved_leap_bytes"],
        "alloc_conf": s.alloc_conf,
    }


def _per_rank(s: Setup, dev: PlanDevice) -> dict[str, Any]:
    """The plan per data-parallel rank and summed over ranks. Every rank runs the same model
    on the same micro-batch size with the same sharding, so the ranks' rows are the same figures
    (not measured differences)."""
    row: dict[str, Any] = {k: dev["bytes"][k] for k in RANK_KEYS}
    row["buffers"] = dict(dev["buffers"])
    row["peak_bytes"] = dev["peak_bytes"]
    n = s.world_size
    overall = {k: v * n for k, v in row.items() if k != "buffers"}
    overall["buffers"] = {k: v * n for k, v in row["buffers"].items()}
    # the load, step 1 and the steady state in the four metrics, each rank's and their sums
    phases = {ph: dict(m) for ph, m in dev["phases"].items()}
    overall["phases"] = {ph: {k: v * n for k, v in m.items()} for ph, m in phases.items()}
    return {"strategy": s.strategy, "world_size": n, "ranks_identical": True,
            "ranks": [{"rank": r, **row, "buffers": dict(row["buffers"]),
                       "phases": {ph: dict(m) for ph, m in phases.items()}} for r in range(n)],
            "overall": overall}



def _price(s: Setup, agg: dict[str, int], act: int, logits: int, opt_tr: int, index: int,
           modules: list[str], buffers: dict[str, dict[str, Any]] | None = None) -> PlanDevice:
    """Peak and steady state on one device from its categories; ``buffers`` are the ranks'
    collective buffers (the memory model's ``collective_buffers``), each added to its phase."""
    W, S, G = agg["weights"], agg["optimizer_state"], agg["grads"]
    mm = memory_model(s.backend)
    overhead = mm.device_overhead(s)
    rounding = agg["round"]  # the memory model's allocator rounding (0 where none)
    buffers = buffers or {}

    def extra(phase: str) -> int:
        return sum(b["bytes"] for b in buffers.values() if b["phase"] == phase)

    fb = act + logits
    grads_fb = mm.grads_during_forward_backward(s, fb, G, GRAD_ACTIVATION_OVERLAP)
    step = G + opt_tr
    phases = {"forward_backward": grads_fb + extra("forward_backward"), "optimizer_step": step + extra("optimizer_step")}
    if extra("grad_sync"):  # the gradient sum between backward and the step: grads + its buffer
        phases["grad_sync"] = G + extra("grad_sync")
    phase = max(phases, key=phases.__getitem__)
    peak_alloc = W + S + phases[phase] + rounding
    # step 1: the optimizer creates its state at the step (lazily), so forward and backward run
    # without it
    step1_alloc = W + max(phases["forward_backward"], S + phases["optimizer_step"]) + rounding
    return {
        "index": index,
        "modules": f"{modules[0]}..{modules[-1]}" if modules else "",
        "bytes": {
            "weights": W,
            "trainable_weights": agg["trainable_weights"],
            "grads": G,
            "optimizer_state": S,
            "optimizer_state_paged": agg["optimizer_state_paged"],
            "activations": act,
            "logits": logits,
            "overhead": overhead + rounding,
        },
        "overhead_detail": {"cuda_context_estimate": overhead, "allocator_rounding_512B": rounding},
        "buffers": {k: b["bytes"] for k, b in buffers.items()},
        "steady_state_allocated_bytes": W + S,
        "peak_allocated_bytes": peak_alloc,
        "step1_allocated_bytes": step1_alloc,
        "peak_bytes": peak_alloc + overhead,
        "peak_phase": phase,
        # the memory model's device_phases fills these (_core)
        "phases": {}, "non_allocator": {}, "step2_reserved_leap_bytes": 0, "alloc_conf": None,
        "device_level_planned": False, "evictable_bytes": 0,
    }
