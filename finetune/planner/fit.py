"""The plan of one config and fitting a run to a budget, on top of pricing (``price``).

``plan`` prices the config's setup, judges it against the budget and finds the levers that would
make it fit. ``fit_to_budget`` keeps the run's math while it fits it: the loss a chunk of tokens
at a time, smaller micro-batches (accumulation rises to match), then gradient checkpointing;
else the levers that would make it fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from finetune import budget as budget_mod
from finetune.backends import capabilities, device_memory, memory_model
from finetune.budget import parse_budget
from finetune.errors import UserError
from finetune.model.types import ModelDesc
from finetune.planner.needs import (
    LOSS_CHUNK_LEVER,
    _divisors_desc,
    _fits,
    _largest_true,
    _micro_change,
    _needs,
    _offload,
    _setup_with,
    fit_cpu_offload,
    largest_fitting,
)
from finetune.planner import preference
from finetune.planner.price import _core
from finetune.planner.setup import SCHEMA_VERSION, Setup, resolve
from finetune.records import Plan, PlanCore
from finetune.run.state import RunState
from finetune.spec import ModelSpec, RunSpec


def chunk_lever_ok(spec: RunSpec, s: Setup) -> bool:
    """Whether the governor may turn on ``train.loss_chunk`` for this run: it is off, the
    ranks are not FSDP shards (the head's weights are sharded outside FSDP's forward) and,
    on cuda, the loss is not compiled (the chunked loss picks rows on the host). The same
    refusals the runtimes give a user who sets it."""
    compiled = spec.train.compile
    return (not s.loss_chunk and not preference.whole_head(s) and not (s.strategy == "fsdp" and s.world_size > 1)
            and not (compiled and not capabilities(s.backend).chunked_loss_with_compile))


def _largest_fitting_micro(arch: ModelDesc, s: Setup, budget: int, ckpt: bool) -> int | None:
    eff = s.effective_batch
    for d in _divisors_desc(eff):
        if _fits(_core(arch, _setup_with(s, batch=d, grad_accum=eff // d, ckpt=ckpt)), budget):
            return d
    return None

def _single_changes(arch: ModelDesc, s: Setup) -> list[tuple[str, dict[str, Any]]]:
    """The one-override changes the levers try on ``s``: (the override, its Setup changes)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if not s.ckpt:
        out.append(("train.grad_checkpointing=true", {"ckpt": True}))
    if not s.loss_chunk and not (s.strategy == "fsdp" and s.world_size > 1) and not preference.whole_head(s):
        out.append((f"train.loss_chunk={LOSS_CHUNK_LEVER}", {"loss_chunk": LOSS_CHUNK_LEVER}))  # the logits never whole
    caps = capabilities(s.backend)
    if not s.offload and caps.no_activation_offload is None:
        out.append(("train.activation_offload=true", {"offload": True}))
    if s.optim in ("adamw", "adam") and "adamw_8bit" in caps.optimizers:
        out.append(("optim=adamw_8bit", {"optim": "adamw_8bit"}))
        if s.device == caps.gpu_device and "paged_adamw_8bit" in caps.optimizers:
            out.append(("optim=paged_adamw_8bit", {"optim": "paged_adamw_8bit"}))
    if s.method in ("full", "dora") and "lora" in caps.methods:
        # plain LoRA: no DoRA magnitudes (or, from full, adapters instead of every weight); a
        # full run's setup already holds every layer and the default keys, as method=lora's
        out.append(("method=lora", {"method": "lora"}))
    qlora = memory_model(s.backend).qlora_lever(arch, s) if "qlora" in caps.methods else None
    if qlora is not None:
        out.append(("method=qlora", {"method": "qlora", **qlora}))
    if s.device == caps.gpu_device and "expandable_segments:true" not in (s.alloc_conf or "").lower().replace(" ", ""):
        # reserved without the fragmentation between steps' shapes (the allocator replayed with it)
        out.append(("backend.alloc_conf=expandable_segments:True", {"alloc_conf": "expandable_segments:True"}))
    if s.precision != "bf16-true":
        out.append(("precision=bf16-true", {"weight_dtype": "bfloat16", "compute_dtype": "bfloat16", "autocast": False,
                                             "adapter_dtype": "bfloat16", "precision": "bf16-true"}))
    return out

def _searched_levers(arch: ModelDesc, s: Setup, budget: int, skip: set[str] | frozenset[str] = frozenset()
                     ) -> list[dict[str, Any]]:
    """The levers whose value is searched: the most adapted layers, GPUs and seq_len that fit
    (``skip``: those not to search, by their key: method.lora.num_layers, backend.device_map,
    train.seq_len)."""
    out: list[dict[str, Any]] = []
    caps = capabilities(s.backend)
    if s.adapters and len(s.lora_layers) > 1 and "method.lora.num_layers" not in skip:
        best = None
        lo, hi = 1, len(s.lora_layers) - 1
        while lo <= hi:  # more layers -> more memory: bisect the largest N that fits
            mid = (lo + hi) // 2
            if _fits(_core(arch, _setup_with(s, lora_layers=tuple(range(arch.layers - mid, arch.layers)))), budget):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        if best:
            p = _core(arch, _setup_with(s, lora_layers=tuple(range(arch.layers - best, arch.layers))))
            out.append({"change": f"method.lora.num_layers={best}", "peak_bytes": p["fits_bytes"]})
    if s.device == caps.gpu_device and s.world_size == 1 and "backend.device_map" not in skip:
        # more GPUs: device_map=auto splits the layers over them (a model whose weights alone
        # exceed one device, e.g. an MoE's experts, fits no other way)
        for n in (2, 3, 4, 5, 6, 8, 12, 16):
            if n > s.n_devices:
                p = _core(arch, _setup_with(s, n_devices=n))
                if _fits(p, budget):
                    out.append({"change": f"backend.device_map=auto backend.num_devices={n}",
                                "peak_bytes": p["fits_bytes"]})
                    break
    best, lo, hi = None, 8, s.seq_len - 1 if "train.seq_len" not in skip else 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if _fits(_core(arch, _setup_with(s, seq_len=mid)), budget):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best:
        p = _core(arch, _setup_with(s, seq_len=best))
        out.append({"change": f"train.seq_len={best}", "peak_bytes": p["fits_bytes"]})
    return out

def _levers(arch: ModelDesc, s: Setup, budget: int) -> list[dict[str, Any]]:
    """Single changes that make the run fit at its current micro-batch (or at micro-batch 1
    with checkpointing when nothing else is left), each with its predicted peak."""
    out: list[dict[str, Any]] = []
    for change, kw in _single_changes(arch, s):
        try:
            p = _core(arch, _setup_with(s, **kw))
        except UserError:
            continue
        if _fits(p, budget):
            out.append({"change": change, "peak_bytes": p["fits_bytes"]})
    return out + _searched_levers(arch, s, budget)

def _levers_under(arch: ModelDesc, s: Setup, limit: int) -> list[dict[str, Any]]:
    """Changes, each typed as overrides, that bring the peak under ``limit`` bytes: the largest
    smaller micro-batch that does (accumulation rises to match, so the math stays the same),
    else with gradient checkpointing; then each of ``_levers``. Where none of those does, the
    levers on top of micro-batch 1 with checkpointing, those overrides included."""
    out: list[dict[str, Any]] = []
    eff = s.effective_batch

    def micro_lever(d: int, ckpt: bool) -> None:
        p = _core(arch, _setup_with(s, batch=d, grad_accum=eff // d, ckpt=ckpt))
        out.append({"change": ("train.grad_checkpointing=true " if ckpt and not s.ckpt else "")
                    + f"train.batch_size={d} train.grad_accum={eff // d}", "peak_bytes": p["max_device_peak_bytes"]})

    micro = None if s.packed else _largest_fitting_micro(arch, s, limit, s.ckpt)
    if micro is not None and micro < s.batch:
        micro_lever(micro, s.ckpt)
    if micro is None and not s.packed and not s.ckpt:
        with_ckpt = _largest_fitting_micro(arch, s, limit, True)
        if with_ckpt is not None and with_ckpt < s.batch:  # at s.batch it is _levers' own checkpointing lever
            micro_lever(with_ckpt, True)
    out += _levers(arch, s, limit)
    if micro is not None or (s.batch == 1 or s.packed) and s.ckpt:
        return out
    # no micro-batch fits: also the levers on top of the smallest configuration, as the
    # recommendation's are ("levers_apply_to"), with the overrides that make it
    smallest = _setup_with(s, batch=1, grad_accum=eff, ckpt=True) if not s.packed else _setup_with(s, ckpt=True)
    prefix = ("" if s.packed else f"train.batch_size=1 train.grad_accum={eff} ") + ("" if s.ckpt else "train.grad_checkpointing=true ")
    seen = {lv["change"] for lv in out}
    return out + [{**lv, "change": prefix + lv["change"]} for lv in _levers(arch, smallest, limit)
                  if prefix + lv["change"] not in seen]

# What each lever costs the user, cheapest first: the order a plan that does not fit lists them
# in, each lever named by its own (first) override. A smaller micro-batch costs speed only (the
# effective batch and the math stay); checkpointing costs compute; the chunked loss a little
# compute; the rest change what is trained or how (optimizer state, precision, the method,
# fewer adapted layers, shorter samples), and more GPUs cost hardware.
LEVER_COSTS: tuple[tuple[str, str], ...] = (
    ("train.batch_size", "the same effective batch in smaller micro-batches: the same math, slower steps"),
    ("train.grad_checkpointing", "each layer's forward recomputed in backward: about a third more compute"),
    ("train.loss_chunk", "the output head and loss a chunk of tokens at a time: the same loss"),
    ("train.activation_offload", "saved activations to host memory and back: host RAM and transfers each step"),
    ("backend.alloc_conf", "torch's expandable segments: less reserved between steps' shapes"),
    ("optim=adamw_8bit", "8-bit optimizer state"),
    ("optim=paged_adamw_8bit", "8-bit optimizer state, paged to host memory under pressure"),
    ("precision=bf16-true", "weights, adapters and their updates in bf16"),
    ("method=lora", "LoRA adapters"),
    ("method=qlora", "LoRA on a 4-bit base: the frozen weights quantized"),
    ("method.lora.num_layers", "adapters on the top layers only"),
    ("train.seq_len", "samples cut shorter: their tails not trained"),
    ("backend.device_map", "more GPUs, the layers split over them"),
    ("backend.cpu_offload", "FSDP's shards, gradients and optimizer state in host memory: transfers each step"),
)
# the largest micro-batch a plan looks for above the effective batch (a bound on the search)
MICRO_BATCH_SEARCH_MAX = 4096


def _lever_cost(change: str, s: Setup) -> tuple[int, str]:
    """(rank in ``LEVER_COSTS``, what it costs) of a lever, by its first override."""
    first = change.split()[0]
    for i, (name, cost) in enumerate(LEVER_COSTS):
        if first == name or first.split("=")[0] == name:
            if name == "method=lora":
                cost = "LoRA adapters instead of every weight" if s.method == "full" else "LoRA without DoRA's magnitudes"
            return i, cost
    return len(LEVER_COSTS), ""






def _advice(arch: ModelDesc, s: Setup, budget: int) -> list[dict[str, Any]]:
    """The levers of a run that does not fit ``budget``, each typed as every override it needs
    on top of the configured run and ordered by what it costs the user (``LEVER_COSTS``).

    A lever is tried alone; where it fits only with a smaller micro-batch or checkpointing too,
    the fewest of those are added (a smaller micro-batch first, then checkpointing, then both).
    A lever whose extra overrides fit without it is left out: the extras alone are cheaper.
    Each is ``{change, peak_bytes, saves_bytes, cost}``: the plan's peak with it (in the metric
    that runs out first) and what it saves against the configured run's."""
    here = _core(arch, s)["fits_bytes"]
    if here <= budget:
        return []
    eff = s.effective_batch

    seen: dict[tuple[tuple[str, Any], ...], PlanCore | None] = {}

    def ok(**kw: Any) -> PlanCore | None:
        """The plan with ``kw`` changed where it fits, else None (each priced once)."""
        key = tuple(sorted(kw.items()))
        if key not in seen:
            try:
                p: PlanCore | None = _core(arch, _setup_with(s, **kw))
            except UserError:  # a combination the backend refuses (8-bit state under FSDP, ...)
                p = None
            seen[key] = p if p is not None and _fits(p, budget) else None
        return seen[key]

    below = [] if s.packed else [d for d in _divisors_desc(eff) if d < s.batch]  # smaller micro-batches
    micro = _largest_true(below, lambda d: ok(batch=d, grad_accum=eff // d) is not None)
    ckpt_here = not s.ckpt and ok(ckpt=True) is not None
    micro_ckpt = None if s.ckpt or ckpt_here else _largest_true(
        below, lambda d: ok(batch=d, grad_accum=eff // d, ckpt=True) is not None)
    out: list[dict[str, Any]] = []

    def add(change: str, p: PlanCore) -> None:
        rank, cost = _lever_cost(change, s)
        out.append({"change": change, "peak_bytes": p["fits_bytes"], "saves_bytes": here - p["fits_bytes"],
                    "cost": cost, "_rank": rank})

    if micro is not None and (p := ok(batch=micro, grad_accum=eff // micro)) is not None:
        add(_micro_change(micro, eff), p)
    if ckpt_here and (p := ok(ckpt=True)) is not None:
        add("train.grad_checkpointing=true", p)
    elif micro_ckpt is not None and micro is None and (p := ok(batch=micro_ckpt, grad_accum=eff // micro_ckpt,
                                                                  ckpt=True)) is not None:
        add(f"train.grad_checkpointing=true {_micro_change(micro_ckpt, eff)}", p)
    # the extras a lever may need, cheapest first, each only where it alone does not fit
    floor = max(micro or 0, micro_ckpt or 0)
    smallest_kw: dict[str, Any] = {"ckpt": True} if s.packed else {"batch": 1, "grad_accum": eff, "ckpt": True}
    for change, kw in _single_changes(arch, s):
        if "ckpt" in kw:
            continue
        p = ok(**kw)
        if p is not None:
            add(change, p)
            continue
        if ok(**kw, **smallest_kw) is None:  # not even with micro-batch 1 and checkpointing: no extras help
            continue
        d = _largest_true([d for d in below if d > (micro or 0)],
                          lambda d: ok(**kw, batch=d, grad_accum=eff // d) is not None)
        if d is not None and (p := ok(**kw, batch=d, grad_accum=eff // d)) is not None:
            add(f"{change} {_micro_change(d, eff)}", p)
            continue
        if s.ckpt or ckpt_here:
            continue
        if (p := ok(**kw, ckpt=True)) is not None:
            add(f"{change} train.grad_checkpointing=true", p)
            continue
        d = _largest_true([d for d in below if d > floor],
                          lambda d: ok(**kw, batch=d, grad_accum=eff // d, ckpt=True) is not None)
        if d is not None and (p := ok(**kw, batch=d, grad_accum=eff // d, ckpt=True)) is not None:
            add(f"{change} train.grad_checkpointing=true {_micro_change(d, eff)}", p)
    # the searched levers (layers, GPUs, seq_len): at the configured micro-batch, else at the
    # smallest configuration (micro-batch 1 with checkpointing) where that alone does not fit
    found = _searched_levers(arch, s, budget)
    if ok(**smallest_kw) is None:
        have = {lv["change"].split("=")[0] for lv in found}
        extra = ("" if s.packed or s.batch == 1 else f" {_micro_change(1, eff)}") + \
            ("" if s.ckpt else " train.grad_checkpointing=true")
        found += [{**lv, "change": lv["change"] + extra}
                  for lv in _searched_levers(arch, _setup_with(s, **smallest_kw), budget, have)]
    for lv in found:
        rank, cost = _lever_cost(lv["change"], s)
        out.append({**lv, "saves_bytes": here - lv["peak_bytes"], "cost": cost, "_rank": rank})
    out.sort(key=lambda lv: lv["_rank"])  # stable: a lever's own order within its kind
    return [{k: v for k, v in lv.items() if k != "_rank"} for lv in out]


def _largest_micro(arch: ModelDesc, s: Setup, budget: int, divisor: int | None) -> dict[str, Any] | None:
    """The largest micro-batch that fits, with the overrides that set it: below the effective
    batch the largest divisor of it (``divisor``; accumulation rises to match, the math
    unchanged), and where the whole effective batch fits in one micro-batch, the largest size
    above it (one micro-batch a step: a larger effective batch), searched up to
    ``MICRO_BATCH_SEARCH_MAX``. None where not even micro-batch 1 fits, or packed (the
    micro-batch is train.tokens_per_micro there)."""
    if s.packed or divisor is None:
        return None
    eff, d = s.effective_batch, divisor
    if d == eff:
        def fits_at(b: int) -> bool:
            return bool(_fits(_core(arch, _setup_with(s, batch=b, grad_accum=1)), budget))

        lo, hi = eff, 2 * eff  # lo fits; double until hi does not, then bisect between them
        while hi <= MICRO_BATCH_SEARCH_MAX and fits_at(hi):
            lo, hi = hi, 2 * hi
        hi = min(hi, MICRO_BATCH_SEARCH_MAX + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
        d = lo
    accum = eff // d if d <= eff else 1
    return {"batch_size": d, "grad_accum": accum, "effective_batch": d * accum,
            "change": f"train.batch_size={d} train.grad_accum={accum}",
            "peak_bytes": _core(arch, _setup_with(s, batch=d, grad_accum=accum))["fits_bytes"],
            "search_max": MICRO_BATCH_SEARCH_MAX if d >= MICRO_BATCH_SEARCH_MAX else None}


def _recommend(arch: ModelDesc, s: Setup, budget: int | None) -> dict[str, Any] | None:
    """Largest micro-batch that fits (a divisor of the effective batch, so the math stays the
    same; and where the whole effective batch fits, the largest above it), with and without
    checkpointing, and the levers of a run that does not fit, typed and cheapest first."""
    if budget is None:
        return None
    eff = s.effective_batch
    micro = _largest_fitting_micro(arch, s, budget, s.ckpt)
    rec: dict[str, Any] = {"max_micro_batch": micro,
                           "max_micro_batch_note": f"largest divisor of the effective batch ({eff}) that fits"}
    if not s.ckpt:
        rec["max_micro_batch_with_grad_checkpointing"] = _largest_fitting_micro(arch, s, budget, True)
    smallest = _setup_with(s, batch=1, grad_accum=eff, ckpt=True)
    rec["smallest_peak_bytes"] = _core(arch, smallest)["fits_bytes"]  # micro-batch 1 + checkpointing
    rec["largest_micro_batch"] = _largest_micro(arch, s, budget, micro)
    rec["levers"] = _advice(arch, s, budget)
    if micro is None:
        rec["levers_apply_to"] = "the configured run: each change holds every override it needs"
    return rec


# ---- what a run needs: the fewest levers that fit N devices of a size ------------------------------











def _governor_advice(spec: RunSpec, budget: int, s: Setup, **fit: Any) -> dict[str, Any] | None:
    """What the governor does before loading with this plan's budget (``fit_to_budget``, the
    function it calls): the overrides it applies itself where ``memory.adapt=true`` (the
    loss in chunks, a smaller micro-batch, then checkpointing), or None where it cannot fit."""
    try:
        res = fit_to_budget(spec, budget, suggest=False, **fit)
    except UserError:
        return None
    change: list[str] = []
    if res.loss_chunk != s.loss_chunk:
        change.append(f"train.loss_chunk={res.loss_chunk}")
    if not s.packed and res.batch_size != s.batch:
        change.append(_micro_change(res.batch_size, res.batch_size * res.grad_accum))
    state = fit.get("state")
    if s.packed and res.tokens_per_micro != (state.tokens_per_micro if state is not None else spec.train.packed_tokens):
        change.append(f"train.tokens_per_micro={res.tokens_per_micro}")
    if res.grad_checkpointing and not s.ckpt:
        change.append("train.grad_checkpointing=true")
    if res.activation_offload and not s.offload:
        change.append("train.activation_offload=true")
    if res.cpu_offload and not s.cpu_offload:
        change.append("backend.cpu_offload=true")
    return {"adapt": bool(spec.memory.adapt), "fits": res.fits, "change": " ".join(change) if res.fits else None,
            "peak_bytes": res.plan["fits_bytes"] if res.fits else None}

@dataclass
class FitResult:
    """What fit_to_budget decided. ``events`` are {trigger, action, before, after} dicts."""

    fits: bool
    plan: Plan
    batch_size: int
    grad_accum: int
    grad_checkpointing: bool
    events: list[dict[str, Any]] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    loss_chunk: int = 0  # train.loss_chunk the fitted run uses (0: the whole logits)
    tokens_per_micro: int = 0  # train.packing: tokens per packed micro-batch the fitted run uses (0: not packed)
    activation_offload: bool = False  # train.activation_offload the fitted run uses
    cpu_offload: bool = False  # backend.cpu_offload the fitted run uses

def fit_to_budget(spec: RunSpec, budget_bytes: int, seq_len: int | None = None, state: Any = None,
                  head_fraction: float | None = None, pair_span: float | None = None,
                  row_targets: int | None = None, longest: int | None = None, suggest: bool = True,
                  pairs: int | None = None, pair_positions: int | None = None) -> FitResult:
    """Change the run, keeping its math, until the plan fits ``budget_bytes`` (per device).

    First, where the backend allows it, compute the loss a chunk of ``LOSS_CHUNK_LEVER``
    tokens at a time (``train.loss_chunk``): the [B, T, V] logits never exist, the loss and
    gradients are the same within float rounding and the step is no slower (the largest
    tensor of a large-vocabulary step goes first, and the micro-batch stays as large as it
    can). Then lower the micro-batch to the largest divisor of the effective batch that fits
    (grad_accum rises so batch_size * grad_accum stays exactly the same); if even micro-batch 1
    does not fit, turn on gradient checkpointing and take the largest micro-batch that fits with
    it. If nothing fits, return fits=False with the plan at micro-batch 1 with checkpointing and
    suggestions (each alone makes it fit), e.g. "method=qlora", "method.lora.num_layers=4",
    "train.seq_len=512" (``suggest=False``: none searched, for a caller that only needs the
    decision). A preference run's ``pairs`` and ``pair_positions`` are the data's, as ``plan`` takes them.
    """
    data: dict[str, Any] = {"head_fraction": head_fraction, "pair_span": pair_span, "row_targets": row_targets,
                            "longest": longest, "pairs": pairs, "pair_positions": pair_positions}
    arch, s = resolve(spec, seq_len, state, **data)
    budget = int(budget_bytes)
    eff = s.effective_batch
    base = state or (RunState.from_spec(spec, s.backend) if s.packed else RunState(s.backend, s.batch, eff, s.ckpt,
                                                                                   activation_offload=s.offload))

    def full_plan(batch: int, ckpt: bool, offload: bool | None = None) -> Plan:
        return plan(spec, seq_len=seq_len, budget_bytes=budget, recommend=False, **data,
                    state=base.with_(micro_batch=batch if not s.packed else base.micro_batch,
                                     grad_checkpointing=ckpt, loss_chunk=s.loss_chunk,
                                     activation_offload=s.offload if offload is None else offload))

    p0 = _core(arch, s)
    before = {"batch_size": s.batch, "grad_accum": s.grad_accum, "grad_checkpointing": s.ckpt,
              "peak_bytes": p0["fits_bytes"], "budget_bytes": budget}
    if _fits(p0, budget):
        return FitResult(True, full_plan(s.batch, s.ckpt), s.batch, s.grad_accum, s.ckpt, loss_chunk=s.loss_chunk,
                         tokens_per_micro=base.tokens_per_micro)
    events: list[dict[str, Any]] = []
    chunked = _setup_with(s, loss_chunk=LOSS_CHUNK_LEVER)
    pc = _core(arch, chunked) if chunk_lever_ok(spec, s) else p0
    if pc["fits_bytes"] < p0["fits_bytes"]:  # a step of over LOSS_CHUNK_LEVER targets
        s = chunked
        events.append({"trigger": "plan_over_budget", "action": "enable_loss_chunk",
                       "before": {"loss_chunk": 0, "peak_bytes": p0["fits_bytes"], "budget_bytes": budget},
                       "after": {"loss_chunk": LOSS_CHUNK_LEVER, "peak_bytes": pc["fits_bytes"]}})
        if _fits(pc, budget):
            return FitResult(True, full_plan(s.batch, s.ckpt), s.batch, s.grad_accum, s.ckpt, events,
                             loss_chunk=s.loss_chunk, tokens_per_micro=base.tokens_per_micro)
        before = {**before, "peak_bytes": pc["fits_bytes"]}
    if s.packed:
        return _fit_packed(spec, arch, s, base, budget, before, events, seq_len, data, suggest)
    for ckpt in ((s.ckpt,) if s.ckpt else (False, True)):
        for d in _divisors_desc(eff):
            if d > s.batch:
                continue
            p = _core(arch, _setup_with(s, batch=d, grad_accum=eff // d, ckpt=ckpt))
            if not _fits(p, budget):
                continue
            if d != s.batch:
                events.append({"trigger": "plan_over_budget", "action": "lower_micro_batch", "before": before,
                               "after": {"batch_size": d, "grad_accum": eff // d, "grad_checkpointing": s.ckpt,
                                         "peak_bytes": _core(arch, _setup_with(s, batch=d, grad_accum=eff // d))["fits_bytes"]}})
            if ckpt and not s.ckpt:
                prev = events[-1]["after"] if events else before
                events.append({"trigger": "plan_over_budget", "action": "enable_grad_checkpointing",
                               "before": {**prev}, "after": {**prev, "grad_checkpointing": True,
                                                             "peak_bytes": p["fits_bytes"]}})
            return FitResult(True, full_plan(d, ckpt), d, eff // d, ckpt, events, loss_chunk=s.loss_chunk,
                             activation_offload=s.offload)
    offloaded = _fit_offload(arch, s, budget, before, events)
    if offloaded is not None:
        d, evs = offloaded
        return FitResult(True, full_plan(d, True, True), d, eff // d, True, evs, loss_chunk=s.loss_chunk,
                         activation_offload=True)
    hosted = fit_cpu_offload(arch, s, budget, before, events)  # the last lever: FSDP's state on the host
    if hosted is not None:
        on, evs = hosted
        return FitResult(True, plan(spec, seq_len=seq_len, budget_bytes=budget, recommend=False, **data,
                                    state=base.with_(micro_batch=on.batch, grad_checkpointing=on.ckpt,
                                                     loss_chunk=s.loss_chunk, activation_offload=s.offload,
                                                     cpu_offload=True)),
                         on.batch, on.grad_accum, on.ckpt, evs, loss_chunk=s.loss_chunk, activation_offload=s.offload,
                         cpu_offload=True)
    smallest = _setup_with(s, batch=1, grad_accum=eff, ckpt=True)
    suggestions = [lv["change"] for lv in _levers(arch, smallest, budget)] if suggest else []
    return FitResult(False, full_plan(1, True), 1, eff, True, [], suggestions, loss_chunk=s.loss_chunk)


def _fit_offload(arch: ModelDesc, s: Setup, budget: int, before: dict[str, Any], events: list[dict[str, Any]]
                 ) -> tuple[int, list[dict[str, Any]]] | None:
    """The lever after gradient checkpointing (``LEVER_COSTS``' order: what costs the least
    throughput per byte saved first): activation offload on top of checkpointing, at the
    largest micro-batch that fits with it. (micro-batch, the events that say what was taken
    and why), or None where the backend has no offload, it is on already, or nothing fits."""
    if s.offload or capabilities(s.backend).no_activation_offload is not None:
        return None
    eff = s.effective_batch
    found = largest_fitting(arch, s, budget, ckpt=True, offload=True)
    if found is None:
        return None
    d, on, p = found
    evs = list(events)
    prev: dict[str, Any] = {k: v for k, v in before.items() if k != "budget_bytes"}
    if d != s.batch:
        after = {**prev, "batch_size": d, "grad_accum": eff // d,
                 "peak_bytes": _core(arch, _setup_with(s, batch=d, grad_accum=eff // d))["fits_bytes"]}
        evs.append({"trigger": "plan_over_budget", "action": "lower_micro_batch", "before": before, "after": after,
                    "reason": "the same effective batch in smaller micro-batches: no throughput lost per sample"})
        prev = after
    ckpt_peak = _core(arch, _setup_with(s, batch=d, grad_accum=eff // d, ckpt=True))["fits_bytes"]
    if not s.ckpt:
        after = {**prev, "grad_checkpointing": True, "peak_bytes": ckpt_peak}
        evs.append({"trigger": "plan_over_budget", "action": "enable_grad_checkpointing", "before": prev,
                    "after": after, "reason": "each layer recomputed in backward: about a third more compute"})
        prev = after
    off = _offload(on, p) or {}
    evs.append({"trigger": "plan_over_budget", "action": "enable_activation_offload",
                "before": {**prev, "activation_offload": False},
                "after": {**prev, "activation_offload": True, "peak_bytes": p["fits_bytes"],
                          "host_bytes": off.get("host_bytes"),
                          "transfer_bytes_per_step": off.get("transfer_bytes_per_step")},
                "reason": f"micro-batch {d} with gradient checkpointing"
                          + (" and the chunked loss" if s.loss_chunk else "")
                          + f" peaks at {ckpt_peak} B, over the budget of {budget} B; the saved activations go "
                          f"to host memory ({off.get('host_bytes')} B) and back, "
                          f"{off.get('transfer_bytes_per_step')} B moved a step"})
    return d, evs


def _fit_packed(spec: RunSpec, arch: ModelDesc, s: Setup, base: Any, budget: int, before: dict[str, Any],
                events: list[dict[str, Any]], seq_len: int | None, data: dict[str, Any], suggest: bool = True
                ) -> FitResult:
    """train.packing: the micro-batch lever is tokens per micro-batch. Halve it (then with
    gradient checkpointing) until the plan fits; each step's samples stay the same, packed
    into more micro-batches. A micro-batch holds at least one whole sample, so the row priced
    for ``c`` tokens is ``min(the width planned, max(c, the longest sample))`` (the longest:
    train.seq_len, the data's cap). The data's figures measured at the configured tokens per
    micro-batch (its targets and pairs per row) give way to their bounds below it."""
    tokens = base.tokens_per_micro
    longest = s.longest_sample or min(spec.train.seq_len, s.seq_len)
    candidates = [tokens]
    while candidates[-1] > longest:
        candidates.append(max(candidates[-1] // 2, longest))

    def width(c: int) -> int:
        return min(s.seq_len, max(c, longest))

    def at(c: int, ckpt: bool) -> Setup:
        if c == tokens:
            return _setup_with(s, seq_len=width(c), ckpt=ckpt)
        return resolve(spec, width(c), base.with_(tokens_per_micro=c, grad_checkpointing=ckpt,
                                                   loss_chunk=s.loss_chunk), **data)[1]

    def priced(c: int, ckpt: bool) -> PlanCore:
        return _core(arch, at(c, ckpt))

    before = {**before, "tokens_per_micro": tokens}
    for ckpt in ((s.ckpt,) if s.ckpt else (False, True)):
        for c in candidates:
            p = priced(c, ckpt)
            if not _fits(p, budget):
                continue
            if c != tokens:
                events.append({"trigger": "plan_over_budget", "action": "lower_tokens_per_micro",
                               "before": {"tokens_per_micro": tokens, "peak_bytes": before["peak_bytes"],
                                          "budget_bytes": budget},
                               "after": {"tokens_per_micro": c,
                                         "peak_bytes": priced(c, s.ckpt)["fits_bytes"]}})
            if ckpt and not s.ckpt:
                prev = events[-1]["after"] if events else {"tokens_per_micro": tokens,
                                                           "peak_bytes": before["peak_bytes"]}
                events.append({"trigger": "plan_over_budget", "action": "enable_grad_checkpointing",
                               "before": {**prev, "grad_checkpointing": False},
                               "after": {**prev, "grad_checkpointing": True, "peak_bytes": p["fits_bytes"]}})
            state = base.with_(tokens_per_micro=c, grad_checkpointing=ckpt, loss_chunk=s.loss_chunk)
            full = plan(spec, seq_len=width(c), budget_bytes=budget, recommend=False, state=state, **data)
            return FitResult(True, full, base.micro_batch, base.grad_accum, ckpt, events, loss_chunk=s.loss_chunk,
                             tokens_per_micro=c)
    last = candidates[-1]
    smallest = at(last, True)
    suggestions = [lv["change"] for lv in _levers(arch, smallest, budget)] if suggest else []
    state = base.with_(tokens_per_micro=last, grad_checkpointing=True, loss_chunk=s.loss_chunk)
    return FitResult(False, plan(spec, seq_len=width(last), budget_bytes=budget, recommend=False, state=state,
                                 **data),
                     base.micro_batch, base.grad_accum, True, [], suggestions, loss_chunk=s.loss_chunk,
                     tokens_per_micro=last)


# ---- the plan of one config (plan.json): priced, judged against the budget, levers found -----

def _budget(s: Setup, override: int | None) -> tuple[int | None, str, int | None]:
    """(budget bytes per device, where it came from, device total)."""
    dm = device_memory(s.backend, s.device)
    if override is not None:
        return int(override), "argument", dm.total_bytes
    if s.budget_text is not None:
        return parse_budget(s.budget_text, dm.total_bytes), f"memory.budget={s.budget_text}", dm.total_bytes
    label = dm.source + (" (estimate)" if dm.estimate and "estimate" not in dm.source else "")
    return dm.total_bytes, f"device: {label}", dm.total_bytes


def _host_check(core: PlanCore) -> dict[str, Any] | None:
    """The host's RAM against the plan's host peak on a device of its own (a GPU): the process's
    anonymous memory, what cannot be given back (the checkpoint's mapped pages are left out).
    None where the device is the host (its figures are the device's) or RAM is unknown."""
    if not core["per_device"][0].get("device_level_planned"):
        return None
    ram = budget_mod.system_ram()
    if not ram:
        return None
    anon = max(p["host_bytes"] - p.get("host_file_bytes", 0) for p in core["phases"].values())
    # the ranks of a launch on one machine (torchrun --nproc-per-node) share its RAM: each holds
    # its own (FSDP loads the whole model in each rank's host memory; cpu_offload keeps the shards)
    ranks = (core.get("per_rank") or {}).get("world_size", 1)
    return {"ram_bytes": ram, "peak_anonymous_bytes": anon, "ranks_on_host": ranks, "fits": anon * ranks <= ram}


def _model_name(model: ModelSpec) -> str:
    """What the plan calls the model: the preset's name, or the path when the default preset
    only carries a user's ``model.path`` (``model.path=Qwen/Qwen3-8B`` is not "tiny")."""
    name, path = model.name, model.path
    return str(path) if path and name == "tiny" else name


def _approximations(arch: ModelDesc, s: Setup) -> list[str]:
    """What the plan prices approximately for this model, said in the plan."""
    out = []
    if arch.experts:
        out.append(f"MoE: all {arch.experts} experts' weights priced exactly; activations approximated as each "
                   f"token's top-{arch.top_k} expert MLPs (the dispatch's own index copies are not counted)")
    if arch.experts and s.method == "qlora" and memory_model(s.backend).quant_of(s, "expert", arch.hidden) is None:
        out.append(f"qlora on {s.backend}: the experts are stacked parameters, not Linear layers, and stay in "
                   f"{s.weight_dtype} (only the attention projections are quantized)")
    if arch.final_softcap or arch.attn_softcap:
        out.append("soft-capping: the tanh outputs of the capped scores/logits priced from the modeling code "
                   "(not calibrated separately)")
    if not arch.gated_mlp:
        out.append("plain MLP: priced from its two real matrices and one activation")
    return out




def _packing(spec: RunSpec, s: Setup, arch: ModelDesc, state: Any) -> dict[str, Any] | None:
    """train.packing as planned: the tokens of the micro-batch priced, and the attention path
    that keeps samples apart (the same one the runtime takes)."""
    if not s.packed:
        return None
    path = memory_model(s.backend).packed_attention(s, arch)
    return {"tokens_per_micro": state.tokens_per_micro if state is not None else spec.train.packed_tokens,
            "tokens_priced": s.seq_len, "attention": path}


def plan(spec: RunSpec, seq_len: int | None = None, budget_bytes: int | None = None,
         recommend: bool = True, state: Any = None, head_fraction: float | None = None,
         pair_span: float | None = None, row_targets: int | None = None, longest: int | None = None,
         step_widths: tuple[int, ...] = (), needs: bool | None = None, pairs: int | None = None,
         pair_positions: int | None = None) -> Plan:
    """Predict a run's memory without loading weights (the content of plan.json).

    Args:
        spec: the run's resolved spec (finetune.resolver.resolve).
        seq_len: tokens per sample to plan for; default ``train.seq_len``. Pass the data's
            longest (truncated) sample for a tighter plan.
        budget_bytes: the budget to judge ``fits`` against; default ``memory.budget`` or the device.
        recommend: also search the largest micro-batch and levers that fit.
        state: the run's live state (finetune.run.state.RunState), where a run is under way.
        head_fraction: the most of a micro-batch's positions that are targets, from the data
            (the output head runs on targets only); None: every position.
        pair_span: packed, the most (query, key) pairs per position of a packed micro-batch,
            from the data (its samples' squares summed over its width); None: the bound, the
            longest sample ``train.seq_len`` allows.
        row_targets: packed, the most target positions of a packed micro-batch, from the data
            (``max_micro_targets``); None: ``head_fraction`` of its positions.
        longest: packed, the data's longest sample (tokens); None: ``train.seq_len``.
        step_widths: the padded widths of the run's first steps, from the data: the caching
            allocator's replay runs them at their own shapes (step 2's leap over step 1).
        pairs: a preference run's pairs, from the data (a precomputed reference's table).
        pair_positions: a preference run's most positions a pair takes with its prompt run
            once, from the data (``finetune.data.pairs.pair_positions``); None: its two padded
            rows, the bound.

    Returns:
        The plan (finetune.records.Plan): ints of bytes, written as plan.json.
    """
    arch, s = resolve(spec, seq_len, state, head_fraction, pair_span, row_targets, longest, pairs, pair_positions)
    s.step_widths = tuple(int(w) for w in step_widths)
    core = _core(arch, s)
    budget, budget_source, device_total = _budget(s, budget_bytes)
    fits = _fits(core, budget)
    host = _host_check(core)
    if fits and host is not None and not host["fits"]:
        fits = False  # the device has room, the host's RAM does not
    # what the device limits beyond the budget (mlx: Metal's working set), with the levers
    # that bring the peak under it; past what the machine has, the run does not fit
    device, runs_out = memory_model(s.backend).device_checks(
        spec, s, core["max_device_peak_bytes"], budget,
        (lambda limit: _levers_under(arch, s, limit)) if recommend else None)
    if runs_out:
        fits = False
    out: Plan = {
        "schema_version": SCHEMA_VERSION,
        "backend": s.backend,
        "device": s.device,
        "devices": s.n_devices,
        "world_size": s.world_size,
        "strategy": s.strategy if s.world_size > 1 else None,
        "model": {"name": _model_name(spec.model), **arch.summary()},
        "method": s.method,
        "optim": s.optim,
        "precision": s.precision,
        "dtypes": {"weights": s.weight_dtype, "adapters": s.adapter_dtype if s.adapters else None,
                   "compute": s.compute_dtype, "autocast": s.autocast,
                   "stored": s.dtype_source,  # where the checkpoint's dtype was read
                   "quantized": memory_model(s.backend).quant_label(s)},
        "lora": {"rank": s.rank, "keys": list(s.keys), "layers": len(s.lora_layers)} if s.adapters else None,
        "batch_size": s.batch,
        "grad_accum": s.grad_accum,
        # per rank, as RunState.effective_batch (x world_size per step); packed, the samples
        # of a step whatever the number of micro-batches
        "effective_batch": (state.effective_batch if state is not None else spec.train.effective_batch)
        if s.packed else s.effective_batch,
        "seq_len": s.seq_len,
        "grad_checkpointing": s.ckpt,
        "attn_implementation": memory_model(s.backend).ATTENTION_LABEL or s.attn,
        "packing": _packing(spec, s, arch, state),
        "activation_offload": _offload(s, core),
        **core,
        "device_total_bytes": device_total,
        "budget_bytes": budget,
        "budget_source": budget_source,
        "fits": fits,
        "host": host,
        **device,
        "recommendation": _recommend(arch, s, budget) if recommend else None,
        "needs": None,
        "notes": list(arch.notes) + s.notes + memory_model(s.backend).notes(s) + _approximations(arch, s),
    }
    if s.objective != "sft":  # a preference run's (SFT's plans as they were)
        out["objective"] = s.objective
        out["preference"] = preference.section(arch, s, core)
    # what the run needs to fit this budget on its devices, where it does not as configured
    want = recommend if needs is None else needs  # needs=True: without the recommendation's search
    out["needs"] = _needs(arch, s, budget) if want and budget is not None and not fits else None
    rec = out["recommendation"]
    if rec is not None and budget is not None:
        # what the run does about a plan over its budget by itself (memory.adapt), as the governor decides it
        rec["governor"] = None if _fits(core, budget) else _governor_advice(
            spec, budget, s, seq_len=seq_len, state=state, head_fraction=head_fraction, pair_span=pair_span,
            row_targets=row_targets, longest=longest)
    return out
