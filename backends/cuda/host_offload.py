"""``backend.cpu_offload`` as the cuda memory model prices it (torch-free): FSDP2's
``CPUOffloadPolicy`` keeps every rank's parameter shards, their gradients and the optimizer's
state in host memory, and the optimizer steps there.

What moves where (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _fsdp_collectives.py):
- at ``fully_shard`` each sharded parameter is copied to the CPU (pinned where a GPU copies);
- before a unit's all-gather its shards are copied to the device (``sharded_param.to(device)``),
  gathered, used and freed: the device holds the unit's gathered parameters (the all-gather
  buffer the plan already has) plus, briefly, its local shards;
- after the reduce-scatter the unit's sharded gradients are copied to the host, where they
  accumulate (``sharded_param.grad`` is a CPU tensor): briefly the device holds them too;
- the optimizer's state is created beside its (CPU) parameters.

What stays on the device: bitsandbytes' QuantState (absmax, codes: not parameters, so FSDP does
not move them), activations, logits, the collectives' buffers. The census counts a tensor
wherever it lies, so the plan's categories (weights, grads, optimizer_state) stay what the rank
holds; the phases move the offloaded part from the device's figures to the host's. ``mm`` is
the cuda memory model (backends/cuda/memory.py), which calls these.
"""

from __future__ import annotations

from typing import Any

from finetune.errors import UserError
from finetune.model.inventory import Setup, Tensor
from finetune.model.source import is_multimodal


# bitsandbytes' CPU 4-bit quantize (bitsandbytes/backends/default/ops.py): its temporaries an element
BNB_CPU_QUANTIZE_BYTES_PER_ELEMENT = 10


def check(cpu_offload: bool, strategy: str, world_size: int) -> None:
    """The refusal: cpu_offload offloads FSDP's shards, so it needs fsdp (over ranks, or over this
    one process: FSDP2 at world size 1 keeps the whole model as its one shard, on the host)."""
    if cpu_offload and strategy != "fsdp":
        raise UserError("backend.cpu_offload=true offloads FSDP2's shards to host memory; add backend.strategy=fsdp "
                        "(one process, or launched with torchrun --nproc-per-node N)")


def fsdp_on(s: Setup) -> bool:
    """Whether the runtime runs FSDP2: fsdp over ranks, or over one process for cpu_offload."""
    return s.strategy == "fsdp" and (s.world_size > 1 or s.cpu_offload)


def sharded_load(s: Setup) -> bool:
    """Whether each rank loads only its shard (backends/cuda/sharded_load.py): under FSDP, where
    the model and run allow it (``Setup.shard_loadable``, sharded_load_refusal's rule)."""
    return fsdp_on(s) and s.shard_loadable


def host_bytes(held: list[Tensor], s: Setup, mm: Any) -> dict[str, int]:
    """One rank's offloaded bytes by category: its parameter shards (4-bit ones as stored; their
    quantization constants stay on the device), their gradients and the optimizer state, and
    the allocator rounding those would have cost on a GPU (nothing on the host)."""
    out = {"weights": 0, "grads": 0, "optimizer_state": 0, "round": 0}
    if not s.cpu_offload:
        return out
    for t in held:
        w, _ = mm.weight_bytes(t, s)
        out["weights"] += w
        out["round"] += mm.rounding_bytes(w, s)
        if t.trainable:
            out["grads"] += w
            st, paged = mm.optimizer_state_bytes(s.optim, t.local_shape, t.dtype_bytes, False, s.momentum,
                                                 host_step=True)
            out["optimizer_state"] += st + paged
            out["round"] += 2 * mm.rounding_bytes(w, s)
    return out


def copy_buffer(tensors: list[Tensor], s: Setup, mm: Any) -> dict[str, dict[str, Any]]:
    """The device's transient copies of one unit under cpu_offload: its local shards on their
    way to the all-gather and its sharded gradients on their way to the host, the largest unit's
    (the next unit's gather is prefetched: two units' shards at once)."""
    if not s.cpu_offload or s.device != "cuda":  # on the CPU the copies are the shards themselves (.to(cpu))
        return {}
    units: dict[int | None, int] = {}
    for t in tensors:
        local = Tensor(t.name, t.shape, t.layer, t.role, t.trainable, t.dtype_bytes, t.quant, s.world_size)
        w, _ = mm.weight_bytes(local, s)
        units[t.layer] = units.get(t.layer, 0) + w + (w if t.trainable else 0)
    top = sorted(units.values(), reverse=True)[:2]
    return {"cpu_offload_copies": {"bytes": sum(top), "phase": "forward_backward"}}


def loads_on_host(s: Setup) -> bool:
    """Whether the runtime loads the model in host memory before FSDP shards it: with
    cpu_offload (the shards stay there), and for qlora (bitsandbytes quantizes it there; then
    fully_shard takes one unit at a time to the device, never the whole 4-bit model)."""
    return fsdp_on(s) and (s.cpu_offload or s.method == "qlora") and not sharded_load(s)


def move_phases(s: Setup, off: dict[str, int], whole: int, phases: dict[str, dict[str, Any]]) -> None:
    """A GPU's phases with the offloaded bytes in the host's figure (the device's replay,
    backends/cuda/trace.py, already leaves them out): at the load the whole model where the
    runtime loads it there (``whole``: every weight as loaded, 4-bit ones packed with their
    constants), or the shards where each rank loads only its own; from step 1 on the shards and
    their gradients, in the steady state the optimizer state too."""
    on_host = loads_on_host(s)
    if on_host:
        phases["load"]["host_bytes"] += whole
    if not s.cpu_offload:
        return
    # the sharded load puts each rank's shards on the host as it reads them
    held = {"load": off["weights"] if sharded_load(s) else 0, "step1": off["weights"] + off["grads"],
            "steady": off["weights"] + off["grads"] + off["optimizer_state"]}
    for name, ph in phases.items():
        ph["host_bytes"] += held.get(name, 0)
        ph["host_offload_bytes"] = held.get(name, 0) or (whole if name == "load" and on_host else 0)


def whole_model_bytes(held: list[Tensor], s: Setup, mm: Any) -> int:
    """The model as the runtime loads it on the host before fully_shard: every base weight whole
    (4-bit ones packed, with their constants)."""
    total = 0
    for t in held:
        if t.role in ("lora_A", "lora_B", "dora_m"):
            total += t.numel * t.dtype_bytes
        elif t.quant == "bnb4":
            total += sum(mm.bnb4_bytes(t.numel, s.double_quant))
        else:
            total += t.numel * t.dtype_bytes
    return total


def device_peaks(dev: dict[str, Any], off: dict[str, int]) -> dict[str, Any]:
    """A GPU's allocated peaks (the categories' sums) less what lives on the host, plus the figure
    the host takes: the per-device entries the plan prints and fits on."""
    moved = off["weights"] + off["grads"] + off["optimizer_state"] + off["round"]
    return {"peak_bytes": max(0, dev["peak_bytes"] - moved),
            "peak_allocated_bytes": max(0, dev["peak_allocated_bytes"] - moved),
            "steady_state_allocated_bytes": max(0, dev["steady_state_allocated_bytes"] - moved),
            "cpu_offload_host_bytes": moved - off["round"]}


# MoE families whose checkpoints keep one tensor per expert and whose stacked experts
# transformers 5.25 builds by the two conversions the sharded load does (backends/cuda/
# sharded_load.py: MergeModulelist(dim=0), then Concatenate(dim=1) of gate and up; mixtral
# renames block_sparse_moe to mlp first), conversion_mapping.py; tests/test_fsdp_qlora.py checks
# each against transformers' own mapping. Any other MoE loads whole on every rank.
SHARDED_LOAD_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def sharded_load_refusal(experts: int, hf: dict[str, Any], remote_code: bool, packing: bool) -> str | None:
    """Why fsdp's sharded load (backends/cuda/sharded_load.py: every rank reads only its rows of
    the checkpoint) does not apply, so every rank loads the whole model and then shards it;
    None where it applies. The same rule for the planner and the runtime: ``experts`` (the
    model description's: an MoE outside ``SHARDED_LOAD_MOE``, whose stacked experts
    transformers builds in a way the sharded load does not), config.json ``hf`` (a multimodal
    checkpoint's language model is renamed as it loads), the model's own code, packed rows."""
    if remote_code:
        return "the model's own code (model.trust_remote_code)"
    if packing:
        return "train.packing checks the packed rows with a forward before FSDP shards the model"
    if experts and hf.get("model_type") not in SHARDED_LOAD_MOE:
        return (f"an MoE ({hf.get('model_type')}) whose stacked experts the sharded load does not build "
                f"(it builds {', '.join(SHARDED_LOAD_MOE)})")
    if is_multimodal(hf):
        return "a multimodal checkpoint"
    return None


def sharded_load_peak(held: list[Tensor], s: Setup, mm: Any) -> dict[str, int]:
    """What fsdp's sharded load holds beside the rank's shards, at its largest (one checkpoint
    tensor at a time, backends/cuda/sharded_load.py fill): ``host`` the host's share (a 4-bit
    weight read whole from the mapped file and copied out of it, in the weights' dtype; another
    weight's rows alone: read, then cast into the shard), ``file`` the file's pages it touched
    (unmapped when the tensor is done), ``device`` the device's (a 4-bit weight whole and packed
    where it quantizes; nothing on the CPU, where the host is the device). A stacked expert
    parameter [E, ...] is built in its shard one expert's checkpoint tensor at a time: at most
    one expert's slab (numel / E; gate_up's is two tensors read one after the other, so this is
    twice the largest one) mapped and cast beside the shard."""
    best = {"host": 0, "file": 0, "device": 0}
    for t in held:
        if t.role in ("lora_A", "lora_B", "dora_m"):
            continue
        if t.role == "expert" and t.shape:
            slab = t.numel // t.shape[0]
            host, file, dev = slab * t.dtype_bytes, slab * s.wd, 0
        elif t.quant == "bnb4":
            whole = t.numel * s.wd
            packed, _ = mm.bnb4_bytes(t.numel, s.double_quant)
            # safetensors hands the tensor back as a view of the mapped file (its pages, not a
            # copy); a GPU quantizes it in its own memory, the CPU in the host's, through
            # bitsandbytes' torch ops (backends/default/ops.py quantize_4bit): the scaled fp32
            # values and their int32 bucket indices (4 + 4 bytes an element), the uint8 codes and
            # the two shifted halves packed (1 + 0.5 + 0.5), live together at their peak
            host, file, dev = 0, whole, whole + packed
            if s.device != "cuda":
                host, dev = BNB_CPU_QUANTIZE_BYTES_PER_ELEMENT * t.numel + packed, 0
        else:
            rows = t.local_numel * t.dtype_bytes
            host, file, dev = rows, rows, 0
        if host + file + dev > sum(best.values()):
            best = {"host": host, "file": file, "device": dev}
    return best
