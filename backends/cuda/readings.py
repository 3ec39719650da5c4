"""The cuda runtime's memory readings: the caching allocator's figures per CUDA device the model
uses (``memory``), the census of live tensors by category (``census``), and the allocator's
limits and cache (``set_memory_limits``, ``release_cache``). A mixin of ``CudaBackend``, which
sets the model, optimizer and devices these read.
"""

from __future__ import annotations

import gc
from typing import Any, cast

import torch

from finetune.records import CENSUS_KEYS, Census, CensusKey, DeviceReading, MemoryReading


def quant_tensors(qs: Any) -> list[torch.Tensor]:
    """Every tensor a bitsandbytes QuantState holds (absmax, code, offset, nested state2)."""
    out = []
    for v in vars(qs).values():
        if torch.is_tensor(v):
            out.append(v)
        elif type(v).__name__ == "QuantState":
            out.extend(quant_tensors(v))
    return out



class CudaReadings:
    """What the accountant and the governor read and set of the cuda runtime's memory."""

    model: Any
    optimizer: Any
    _contexts: dict[int, int | None]
    _totals: dict[int, int] | None

    # ---- memory ------------------------------------------------------------------------
    def _cuda_indices(self) -> list[int]:
        # Placement is fixed after setup; walking every parameter per sample cost ~200 us.
        if getattr(self, "_indices", None) is None:
            self._indices = sorted({p.device.index or 0 for p in self.model.parameters() if p.device.type == "cuda"})
        return self._indices

    def memory(self) -> MemoryReading:
        """Allocator figures (bytes) per CUDA device the model uses, plus their sums. Sums of
        per-device peaks bound the simultaneous peak from above. All None on CPU."""
        keys = ("allocated", "reserved", "peak_allocated", "peak_reserved", "inactive_split",
                "alloc_retries", "num_ooms")
        indices = self._cuda_indices()
        if not indices:
            return MemoryReading(allocated=None, reserved=None, peak_allocated=None, peak_reserved=None,
                                 inactive_split=None, alloc_retries=None, num_ooms=None, device_total=None,
                                 devices=None)
        devices: list[DeviceReading] = []
        if self._totals is None:
            self._totals = {i: int(torch.cuda.get_device_properties(i).total_memory) for i in indices}
        for i in indices:
            # the nested form: memory_stats() flattens this same dict in Python, which costs
            # more than the allocator's own C++ call, at every sample
            s = torch.cuda.memory_stats_as_nested_dict(i)
            alloc, res, split = (s.get(k, {}).get("all", {}) for k in
                                 ("allocated_bytes", "reserved_bytes", "inactive_split_bytes"))
            devices.append(DeviceReading(**{
                "index": i,
                "allocated": int(alloc.get("current", 0)),
                "reserved": int(res.get("current", 0)),
                "peak_allocated": int(alloc.get("peak", 0)),
                "peak_reserved": int(res.get("peak", 0)),
                "inactive_split": int(split.get("current", 0)),
                "alloc_retries": int(s.get("num_alloc_retries", 0)),
                "num_ooms": int(s.get("num_ooms", 0)),
                "device_total": self._totals[i],
                "cuda_context": self._contexts.get(i),  # measured at setup, see measure_cuda_contexts
            }))
        out = cast(MemoryReading, {k: sum(cast(int, d.get(k)) for d in devices) for k in keys})
        out["device_total"] = sum(self._totals[i] for i in indices)
        ctx = [d.get("cuda_context") for d in devices]
        out["cuda_context"] = None if None in ctx else sum(cast(list[int], ctx))
        out["devices"] = devices
        return out

    def reset_peak(self) -> None:
        """Reset torch's peak counters on every CUDA device the model uses (every visible
        device before setup, so the load itself is inside the run's peak)."""
        if getattr(self, "model", None) is None:
            # Before the first CUDA allocation there is nothing to reset, and torch refuses
            # ("Invalid device argument") until its allocator exists (seen on an H200).
            indices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
        else:
            indices = self._cuda_indices()
        for i in indices:
            torch.cuda.reset_peak_memory_stats(i)

    def census(self) -> Census:
        """Bytes of live tensors by category, each tensor counted once (tied weights and the
        quantile maps bitsandbytes shares between parameters are deduplicated by address).
        optimizer_state counts state tensors on their parameter's device type (torch's Adam
        keeps its per-tensor ``step`` as a host scalar beside CUDA params: not allocator
        memory); optimizer_state_paged counts bitsandbytes paged (unified-memory) buffers."""
        out: dict[CensusKey, int] = dict.fromkeys(CENSUS_KEYS, 0)
        seen: set[tuple[str, int, int]] = set()

        from finetune.backends.cuda.distributed import local

        def add(key: CensusKey, t: Any) -> None:
            if not torch.is_tensor(t) or t.device.type == "meta":
                return
            t = local(t)  # fsdp: this rank's shard is what its memory holds
            nbytes = t.numel() * t.element_size()
            ident = (str(t.device), t.data_ptr(), nbytes)
            if nbytes and ident not in seen:
                seen.add(ident)
                out[key] += nbytes

        params = list(self.model.parameters())
        for p in params:
            add("trainable_weights" if p.requires_grad else "frozen_weights", p)
            if type(p).__name__ == "Params4bit" and p.quant_state is not None:
                for t in quant_tensors(p.quant_state):
                    add("quant_buffers", t)
        for mod in self.model.modules():  # fsdp: the shards are DTensors; Linear4bit keeps the state
            qs = getattr(mod, "quant_state", None) if hasattr(mod, "quant_storage") else None
            if qs is not None:
                for t in quant_tensors(qs):
                    add("quant_buffers", t)
        for p in params:
            add("grads", p.grad)
        for p, state in self.optimizer.state.items():
            for v in state.values():
                if getattr(v, "is_paged", False):
                    add("optimizer_state_paged", v)
                elif torch.is_tensor(v) and v.device.type == p.device.type:
                    add("optimizer_state", v)
        return cast(Census, out)  # every census category, each an int

    def release_cache(self) -> None:
        """gc, then hand torch's cached CUDA blocks back to the driver (nothing to do on CPU)."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def set_memory_limits(self, budget_bytes: int) -> dict[str, Any]:
        """Cap torch's allocator on each CUDA device the model uses at ``budget_bytes`` (a
        per-device budget). Returns {} on CPU, where torch has no such limit."""
        fractions = {}
        for i in self._cuda_indices():
            total = torch.cuda.get_device_properties(i).total_memory
            fractions[f"cuda:{i}"] = min(1.0, budget_bytes / total)
            torch.cuda.set_per_process_memory_fraction(fractions[f"cuda:{i}"], i)
        if not fractions:
            return {}
        return {"per_process_memory_fraction": fractions, "budget_bytes": int(budget_bytes)}

    def set_cache_limit(self, limit_bytes: int) -> int:
        """torch's caching allocator has no cap on its cached blocks (``Capabilities.cache_limit``
        is False, so the governor never calls this)."""
        raise NotImplementedError("torch's caching allocator has no cache limit to set")
