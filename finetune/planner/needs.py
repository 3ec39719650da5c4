"""What a run needs to fit (``mode=plan``'s ``needs``): the fewest levers, of the loss in chunks,
checkpointing, activation offload, FSDP, the layers split over the devices and FSDP's state in
host memory (backend.cpu_offload), that fit a budget
on each device, with the host RAM they take; and the primitives the levers share with
``finetune.planner.fit`` (a Setup changed, whether a plan fits, the micro-batch search)."""

from __future__ import annotations

import dataclasses
from typing import Any

from finetune.backends import capabilities
from finetune.errors import UserError
from finetune.model.types import ModelDesc
from finetune.planner import preference
from finetune.planner.price import _core
from finetune.planner.setup import Setup
from finetune.records import PlanCore

# the chunk the levers suggest: 1,024 tokens x a 152k vocabulary is 0.6 GB of fp32 logits per
# chunk, small beside the whole [B, T, V], large enough that the head's matmuls stay efficient
LOSS_CHUNK_LEVER = 1024


def _setup_with(s: Setup, **changes: Any) -> Setup:
    return dataclasses.replace(s, **changes)


def _fits(p: PlanCore, budget: int | None) -> bool | None:
    """Whether the plan fits ``budget`` bytes per device: in the metric that runs out first, the
    device level (what NVML shows: reserved, the context, libraries, paged state) in every phase,
    where the backend plans it above allocated; else the peak with overhead."""
    return None if budget is None else p["fits_bytes"] <= budget


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _micro_change(d: int, eff: int) -> str:
    return f"train.batch_size={d} train.grad_accum={eff // d}"


def largest_fitting(arch: ModelDesc, s: Setup, budget: int, **changes: Any) -> tuple[int, Setup, PlanCore] | None:
    """The largest micro-batch ``d`` (a divisor of the effective batch, at most ``s.batch``) at
    which ``s`` with ``changes`` fits ``budget``, the effective batch kept: (d, that setup, its
    plan core), or None where none fits. What each lever after the micro-batch asks."""
    eff = s.effective_batch
    for d in _divisors_desc(eff):
        if d > s.batch:
            continue
        on = _setup_with(s, batch=d, grad_accum=eff // d, **changes)
        p = _core(arch, on)
        if _fits(p, budget):
            return d, on, p
    return None


def _largest_true(candidates: list[int], ok: Any) -> int | None:
    """The first of ``candidates`` (largest first) where ``ok`` holds, for an ``ok`` that holds
    from some point on (memory falls with the micro-batch): bisected."""
    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo] if lo < len(candidates) else None


# The levers "what do I need" combines, in the order of least throughput lost per byte saved:
# the loss a chunk at a time (no slower), checkpointing (a third more compute), activation
# offload (transfers over the host link each step), FSDP over the devices (collectives each
# layer), then the layers split over the devices in one process (device_map=auto: one GPU
# computes at a time), last FSDP's shards, gradients and optimizer state in host memory
# (backend.cpu_offload: every layer's shards over the host link each step, the optimizer on the
# CPU). A smaller micro-batch comes with any of them (the same math, slower steps); it is
# searched for each set, the largest that fits.
NEED_LEVERS: tuple[str, ...] = ("loss_chunk", "ckpt", "offload", "fsdp", "split", "cpu_offload")


# the most devices "what would fit" looks for
NEED_DEVICES_MAX = 64


def _need_changes(lever: str, s: Setup) -> dict[str, Any] | None:
    """The Setup changes of one lever on ``s``, or None where it does not apply."""
    caps = capabilities(s.backend)
    if lever == "loss_chunk":
        return None if s.loss_chunk or (s.strategy == "fsdp" and s.world_size > 1) or preference.whole_head(s) \
            else {"loss_chunk": LOSS_CHUNK_LEVER}
    if lever == "ckpt":
        return None if s.ckpt else {"ckpt": True}
    if lever == "offload":
        return None if s.offload or caps.no_activation_offload is not None else {"offload": True}
    if lever == "fsdp":
        return {"strategy": "fsdp"} if s.world_size > 1 and s.strategy != "fsdp" and "fsdp" in caps.strategies else None
    if lever == "split":  # every rank's samples in one process whose layers span the devices
        if s.world_size <= 1 or s.device != caps.gpu_device or s.cpu_offload:
            return None
        return {"world_size": 1, "n_devices": s.world_size, "grad_accum": s.grad_accum * s.world_size}
    if lever == "cpu_offload":  # FSDP's shards on the host: with fsdp, over ranks
        if s.cpu_offload or s.world_size <= 1 or "fsdp" not in caps.strategies or caps.no_cpu_offload:
            return None
        return {"cpu_offload": True, "strategy": "fsdp"}
    raise ValueError(lever)


_NEED_OVERRIDES = {"loss_chunk": f"train.loss_chunk={LOSS_CHUNK_LEVER}", "ckpt": "train.grad_checkpointing=true",
                   "offload": "train.activation_offload=true", "fsdp": "backend.strategy=fsdp",
                   "split": "backend.device_map=auto", "cpu_offload": "backend.strategy=fsdp backend.cpu_offload=true"}


_NEED_COSTS = {"loss_chunk": "the output head and loss a chunk of tokens at a time: the same loss, no slower",
               "ckpt": "each layer's forward recomputed in backward: about a third more compute",
               "offload": "saved activations to host memory and back: host RAM and transfers each step",
               "fsdp": "weights, gradients and state sharded over the ranks: gathered layer by layer each step",
               "split": "the layers split over the devices in one process: one device computes at a time",
               "cpu_offload": "parameters, gradients and optimizer state in host memory: every layer's shards over "
                              "the host link each step, the optimizer step on the CPU"}


def _host_figures(p: PlanCore) -> tuple[int, int]:
    """(the most host memory the process cannot give back, the checkpoint's mapped pages at the
    load), over the phases of the device that peaks highest."""
    anon = max(ph["host_bytes"] - ph.get("host_file_bytes", 0) for ph in p["phases"].values())
    return anon, max(ph.get("host_file_bytes", 0) for ph in p["phases"].values())


def _needs(arch: ModelDesc, s: Setup, budget: int) -> dict[str, Any]:
    """What this run needs to fit ``budget`` bytes on each of its devices: the fewest levers of
    ``NEED_LEVERS`` (among as few, the cheapest by their order) with the largest micro-batch
    that fits with them, and the host memory that takes; else that nothing fits, the budget
    per device every lever together needs here, and the fewest devices of this size that fit."""
    from itertools import combinations

    devices = max(s.world_size, s.n_devices)
    applicable = [lv for lv in NEED_LEVERS if _need_changes(lv, s) is not None]

    def setup_of(levers: tuple[str, ...]) -> Setup | None:
        if "split" in levers and "cpu_offload" in levers:  # one process, or FSDP's ranks: not both
            return None
        kw: dict[str, Any] = {}
        for lv in levers:
            kw.update(_need_changes(lv, s) or {})
        return _setup_with(s, **kw)

    def priced(x: Setup) -> PlanCore | None:
        try:
            return _core(arch, x)
        except UserError:  # a combination the backend refuses (qlora under fsdp, ...)
            return None

    def best_micro(x: Setup) -> tuple[int, PlanCore] | None:
        """The largest micro-batch up to the configured one that fits with ``x``'s levers."""
        if x.packed:
            p = priced(x)
            return (x.batch, p) if p is not None and _fits(p, budget) else None
        eff = x.effective_batch
        cands = [d for d in _divisors_desc(eff) if d <= s.batch]
        got: dict[int, PlanCore | None] = {}

        def ok(d: int) -> bool:
            got[d] = priced(_setup_with(x, batch=d, grad_accum=eff // d))
            return got[d] is not None and bool(_fits(got[d], budget))  # type: ignore[arg-type]

        d = _largest_true(cands, ok) if cands else None
        return None if d is None else (d, got[d] if d in got else priced(_setup_with(x, batch=d, grad_accum=eff // d)))  # type: ignore[return-value]

    def at_one(x: Setup | None) -> PlanCore | None:
        return None if x is None else priced(_setup_with(x, batch=1, grad_accum=x.effective_batch)
                                             if not x.packed else x)

    # every lever at once (the layers split in one process, or FSDP's state on the host: the
    # one that peaks lower)
    alls = [tuple(lv for lv in applicable if lv != drop) for drop in ("cpu_offload", "split")]
    tried = [(p, x) for x in (setup_of(a) for a in dict.fromkeys(alls)) for p in [at_one(x)] if p is not None]
    every_one, every = min(tried, key=lambda px: px[0]["fits_bytes"]) if tried else (None, None)
    found = None
    if every_one is not None and _fits(every_one, budget):
        for k in range(len(applicable) + 1):
            for levers in combinations(applicable, k):  # in NEED_LEVERS' order: the cheapest sets first
                x = setup_of(levers)
                if x is None:
                    continue
                one = priced(_setup_with(x, batch=1, grad_accum=x.effective_batch) if not x.packed else x)
                if one is None or not _fits(one, budget):
                    continue
                got = best_micro(x)
                if got is not None:
                    found = (levers, x, *got)
                    break
            if found:
                break
    out: dict[str, Any] = {"devices": devices, "budget_bytes": budget}
    if found is None:
        out["fits"] = False
        out["every_lever_peak_bytes"] = every_one["fits_bytes"] if every_one is not None else None
        more = None
        if every is not None and every.device == capabilities(s.backend).gpu_device:
            for n in range(devices + 1, NEED_DEVICES_MAX + 1):  # the layers split over n devices of this size
                x = _setup_with(every, world_size=1, n_devices=n, batch=1, cpu_offload=False,
                                grad_accum=s.effective_batch * s.world_size)
                p = priced(x)
                if p is not None and _fits(p, budget):
                    more = n
                    break
        out["would_fit"] = ([f"memory.budget={every_one['fits_bytes']} bytes per device (every lever, "
                             f"{devices} device{'s' if devices > 1 else ''})"] if every_one is not None else []) + \
            ([f"backend.num_devices={more} with {' '.join(_NEED_OVERRIDES[lv] for lv in applicable if lv not in ('split', 'cpu_offload'))} "
              "backend.device_map=auto train.batch_size=1"] if more else [])
        return out
    levers, x, d, p = found
    eff = x.effective_batch
    # each override once (cpu_offload names the strategy fsdp too)
    change = list(dict.fromkeys(w for lv in levers for w in _NEED_OVERRIDES[lv].split()))
    if d != s.batch or eff != s.effective_batch:
        change.append(_micro_change(d, eff))
    anon, mapped = _host_figures(p)
    off = _offload(_setup_with(x, batch=d, grad_accum=eff // d), p)
    out.update({"fits": True, "levers": list(levers), "change": " ".join(change), "peak_bytes": p["fits_bytes"],
                "batch_size": d, "grad_accum": eff // d, "host_bytes": anon, "host_file_bytes": mapped,
                "transfer_bytes_per_step": off["transfer_bytes_per_step"] if off else None,
                "costs": [_NEED_COSTS[lv] for lv in levers]})
    return out


def _offload(s: Setup, core: PlanCore) -> dict[str, Any] | None:
    """train.activation_offload as planned: per micro-batch what the hooks move to the host (and
    back: the transfer volume, twice that a micro-batch), what the device saves (less the most
    backward brings back at once) and the host memory it takes; per step the transfers of
    every micro-batch, which is the throughput cost (bytes over the host link)."""
    d = core["activations_detail"]
    if not s.offload:
        return None
    moved = d.get("offloaded", 0)
    return {"bytes_per_micro_batch": moved, "back_at_once_bytes": d.get("offload_back", 0),
            "device_saving_bytes": moved - d.get("offload_back", 0), "host_bytes": moved,
            "pinned": s.device == capabilities(s.backend).gpu_device,  # pinned host pages where a GPU copies
            "transfer_bytes_per_micro_batch": 2 * moved, "transfer_bytes_per_step": 2 * moved * s.grad_accum}


def fit_cpu_offload(arch: ModelDesc, s: Setup, budget: int, before: dict[str, Any],
                    events: list[dict[str, Any]]) -> tuple[Setup, list[dict[str, Any]]] | None:
    """The governor's last lever before loading (``LEVER_COSTS``' order, after activation
    offload): FSDP's shards, gradients and optimizer state in host memory, on a run that is
    sharded over ranks already (the strategy is the launch's: no lever changes it), at the
    largest micro-batch that fits with it (checkpointing and activation offload as the run has
    them, then with checkpointing). (the setup it takes, the events that say what and why), or
    None where it does not apply or nothing fits. Every rank plans the same: the same lever."""
    if (s.cpu_offload or s.strategy != "fsdp" or s.world_size <= 1
            or capabilities(s.backend).no_cpu_offload is not None):
        return None
    eff = s.effective_batch
    for ckpt in ((s.ckpt,) if s.ckpt else (False, True)):
        found = largest_fitting(arch, s, budget, ckpt=ckpt, cpu_offload=True)
        if found is None:
            continue
        d, on, p = found
        prev = {k: v for k, v in before.items() if k != "budget_bytes"}
        host = max(ph["host_bytes"] for ph in p["phases"].values())
        return on, [*events, {
            "trigger": "plan_over_budget", "action": "enable_cpu_offload",
            "before": {**prev, "cpu_offload": False},
            "after": {**prev, "batch_size": d, "grad_accum": eff // d, "grad_checkpointing": ckpt,
                      "cpu_offload": True, "peak_bytes": p["fits_bytes"], "host_bytes": host},
            "reason": f"nothing cheaper fits the budget of {budget} B (the smaller micro-batch, checkpointing, "
                      "activation offload); FSDP's shards, gradients and optimizer state go to host memory "
                      f"({host} B on the host per rank at its highest phase), each layer's shards copied over "
                      "the host link every step and the optimizer stepping on the CPU"}]
    return None
