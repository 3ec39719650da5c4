"""Merge samples of the ranks of a distributed run (or several processes) into an Overall row.

Pure functions over recorded samples: the transport (torch.distributed.gather_object of each
rank's ``Accountant.samples``, or files) is the caller's. Figures are summed with care for
what they measure:

- process figures (allocator, census, RSS, process swap): summed over ranks;
- device figures (NVML used/total, other processes): one reading per physical device, so a
  device two ranks share is counted once (keyed by host and device index);
- host figures (system swap, RAM): one per host (its largest reading), summed over hosts;
  pressure percentages are never summed.

Every figure also gets min and max over ranks and the rank holding the max, which is how an
unbalanced split (one GPU with the embeddings) shows. A sum is None when any rank could not
measure the figure, so a partial sum is never passed off as the total.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from finetune.accounting.probes import NON_ALLOCATOR_PARTS, reconcile_nvml

PROCESS_KEYS = ("allocated", "reserved", "peak_allocated", "peak_reserved", "step_peak_allocated",
                "step_peak_reserved", "rss", "peak_rss", "swap_process", "process_device_used", "cuda_context",
                "paged_optimizer_state", "inactive_split", "alloc_retries", "num_ooms", "mlx_active", "mlx_cache",
                "mlx_peak")
DEVICE_KEYS = ("device_used", "device_total", "other_processes_used")
HOST_KEYS = ("swap_used", "swap_total", "swap_growth", "system_total", "system_available")
NO_SUM_KEYS = ("psi_some_avg10", "psi_full_avg10", "pressure_level")


def _stats(vals: list[tuple[int, Any]]) -> dict[str, Any]:
    known = [(r, v) for r, v in vals if v is not None]
    if not known:
        return {"sum": None, "min": None, "max": None, "max_rank": None}
    r_max, v_max = max(known, key=lambda t: t[1])
    return {"sum": None, "min": min(v for _, v in known), "max": v_max, "max_rank": r_max}


def _sum_or_none(vals: list[Any]) -> Any:
    return None if not vals or any(v is None for v in vals) else sum(vals)


def gather(samples_per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge one sample per rank, taken at the same step and phase.

    Args:
        samples_per_rank: rank r's sample at index r (each carries ``rank``, ``host`` and its
            ``devices`` rows, as Accountant.sample records them).

    Returns:
        {"step", "phase", "ranks": the samples, "overall": {figure: {"sum", "min", "max",
        "max_rank"}}, "census": {category: same}}; overall also carries the derived
        non_allocator and non_allocator_unexplained sums.
    """
    ranks = list(samples_per_rank)
    if not ranks:
        raise ValueError("gather() needs at least one rank's sample")
    rank_ids = [s.get("rank", i) for i, s in enumerate(ranks)]
    overall: dict[str, dict[str, Any]] = {}
    for k in PROCESS_KEYS:
        if any(k in s for s in ranks):
            st = _stats([(r, s.get(k)) for r, s in zip(rank_ids, ranks)])
            st["sum"] = _sum_or_none([s.get(k) for s in ranks])
            overall[k] = st
    # device figures: one reading per (host, device index)
    per_dev: dict[tuple[str, int], dict[str, Any]] = {}
    for s in ranks:
        for d in s.get("devices") or []:
            per_dev.setdefault((s.get("host", ""), d["index"]), {**d, "rank": s.get("rank")})
    for k in DEVICE_KEYS:
        st = _stats([(r, s.get(k)) for r, s in zip(rank_ids, ranks)])
        st["sum"] = _sum_or_none([d.get(k) for d in per_dev.values()]) if per_dev else None
        overall[k] = st
    # host figures: per host the largest reading, summed over hosts
    hosts: dict[str, dict[str, Any]] = {}
    for s in ranks:
        h = hosts.setdefault(s.get("host", ""), {})
        for k in HOST_KEYS:
            v = s.get(k)
            h[k] = v if k not in h else (None if v is None or h[k] is None else max(h[k], v))
    for k in HOST_KEYS:
        st = _stats([(r, s.get(k)) for r, s in zip(rank_ids, ranks)])
        st["sum"] = _sum_or_none([h.get(k) for h in hosts.values()])
        overall[k] = st
    for k in NO_SUM_KEYS:
        overall[k] = _stats([(r, s.get(k)) for r, s in zip(rank_ids, ranks)])
    # the non-allocator gap from the sums, so a shared device is not subtracted twice
    na, unexplained = reconcile_nvml(overall["device_used"]["sum"], overall.get("reserved", {}).get("sum"),
                                     [overall.get(k, {}).get("sum") for k in NON_ALLOCATOR_PARTS])
    overall["non_allocator"] = {**_stats([(r, s.get("non_allocator")) for r, s in zip(rank_ids, ranks)]), "sum": na}
    overall["non_allocator_unexplained"] = {
        **_stats([(r, s.get("non_allocator_unexplained")) for r, s in zip(rank_ids, ranks)]), "sum": unexplained}
    census: dict[str, dict[str, Any]] = {}
    cats = sorted({k for s in ranks for k in (s.get("census") or {})})
    for k in cats:
        vals = [(s.get("census") or {}).get(k) for s in ranks]
        census[k] = {**_stats(list(zip(rank_ids, vals))), "sum": _sum_or_none(vals)}
    return {"step": ranks[0].get("step"), "phase": ranks[0].get("phase"), "ranks": ranks,
            "overall": {k: v for k, v in overall.items()}, "census": census,
            "num_devices": len(per_dev), "num_hosts": len(hosts)}


def gather_timeline(timelines: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Align each rank's timeline on (step, phase, micro) and gather every moment all ranks
    sampled, in rank 0's order.

    Args:
        timelines: rank r's ``Accountant.samples`` at index r.
    """
    if not timelines:
        return []
    keyed = [{(s["step"], s["phase"], s.get("micro", 0)): s for s in tl} for tl in timelines]
    out = []
    for s in timelines[0]:
        key = (s["step"], s["phase"], s.get("micro", 0))
        if all(key in k for k in keyed):
            out.append(gather([k[key] for k in keyed]))
    return out
