"""The cuda backend's memory explanations (torch's caching allocator, NVML, the CUDA context),
registered into the shared rules (finetune/accounting/rules.py). Pure functions over recorded
samples, as the shared ones; nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from finetune import rulebase as rules
from finetune.rulebase import Explanation, _ex, _where
from finetune.units import fmt_bytes as fb


def rule_non_allocator(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """NVML's used memory beyond the allocator's reserved, split into known parts."""
    cands = [s for s in samples if s.get("non_allocator") is not None]
    if not cands:
        return []
    # the samples that read NVML (between readings a sample carries the last gap)
    cands = [s for s in cands if s.get("system_fresh", True)] or cands
    opt = [s for s in cands if s["phase"] == "optimizer"]
    s = (opt or cands)[-1]
    na, used, res = s["non_allocator"], s["device_used"], s["reserved"]
    paged, ctxb, other = s.get("paged_optimizer_state"), s.get("cuda_context"), s.get("other_processes_used")
    un = s.get("non_allocator_unexplained")
    ndev = len(s.get("devices") or [])
    text = (f"NVML reports {fb(used)} used on {'the device' if ndev <= 1 else f'{ndev} devices'} {_where(s)}, "
            f"{fb(na)} more than the allocator's reserved {fb(res)}")
    parts = []
    if paged:
        parts.append(f"{fb(paged)} is paged optimizer state in unified memory (bitsandbytes, outside the allocator)")
    if ctxb is not None:
        parts.append(f"{fb(ctxb)} the CUDA context (measured when it was created)")
    if other is not None:
        parts.append(f"{fb(other)} other processes on the device")
    if parts:
        text += "; of that, " + ", ".join(parts)
    proc = s.get("process_device_used")
    if un is not None and un >= 0:
        text += (f", and {fb(un)} is unexplained" + (" (the CUDA context was not measured: it is part of this)"
                                                     if ctxb is None else
                                                     " (kernels CUDA loads on first use and library handles grow "
                                                     "the context after it was measured)"))
    elif un is not None:
        text += (f"; the known parts exceed the gap by {fb(-un)}: part of the paged state is resident "
                 "in host memory, not on the device")
    if proc is not None:
        text += (f". NVML attributes {fb(proc)} to this process, {fb(proc - res)} beyond its reserved "
                 "(context, libraries' workspaces, resident paged memory)")
    sev = "warning" if un is not None and un > ctx["unexplained_warn_bytes"] else "info"
    return [_ex("non_allocator", sev, text + ".", device_used=used, reserved=res, non_allocator=na,
                paged_optimizer_state=paged, cuda_context=ctxb, other_processes=other, unexplained=un,
                process_device_used=proc)]


def rule_allocator_retries(samples: list[dict[str, Any]], ctx: dict[str, Any]) -> list[Explanation]:
    """cudaMalloc retries (the allocator freed its cache to satisfy a request) and OOMs."""
    if not samples:
        return []
    s = samples[-1]
    r, o = s.get("alloc_retries") or s.get("num_alloc_retries"), s.get("num_ooms")
    if not r and not o:
        return []
    text = ((f"The CUDA caching allocator had to free its cache and retry an allocation {r} time(s)" if r else
             "The CUDA allocator")
            + (f" and hit {o} out-of-memory error(s)" if o else "")
            + f" by {_where(s)}: the run is at the edge of device memory; each retry synchronizes and slows the step.")
    return [_ex("allocator_retries", "warning", text, alloc_retries_count=r, num_ooms_count=o)]


def _cache_growth(limit: int | None) -> str:
    return ("the caching allocator keeps blocks of each new size (batches of varying length), so this is "
            "cache, not live data; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets blocks be reused "
            "across sizes.")


def _fragmentation(split: int | None) -> str:
    text = "the caching allocator holds freed blocks that this process reuses but no one else can"
    if split:
        text += (f"; {fb(split)} are inactive split blocks (fragmentation): "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces it")
    return text + "."


rules.register(rule_non_allocator, after="rule_cache_growth")
rules.register(rule_allocator_retries, after="rule_fragmentation")
# fallback: samples that name no backend read as torch's allocator, as they always have
rules.register_allocator_words(rules.AllocatorWords("cuda", None, None, _cache_growth, _fragmentation), fallback=True)
