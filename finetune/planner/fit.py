"""The plan of one config and fitting a run to a budget, on top of pricing (``price``).

``plan`` prices the config's setup, judges it against the budget and finds the levers that would
make it fit. ``fit_to_budget`` keeps the run's math while it fits it: the loss a chunk of tokens
at a time, smaller micro-batches (accumulation rises to match), then gradient checkpointing;
else the levers that would make it fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from finetune.backends import capabilities, device_memory, memory_model
from finetune import budget as budget_mod
from finetune.budget import parse_budget
from finetune.errors import UserError
from finetune.modeldesc import ModelDesc
from finetune.planner.model import SCHEMA_VERSION, Setup, resolve
from finetune.planner.price import _core
from finetune.records import Plan, PlanCore
from finetune.spec import ModelSpec, RunSpec
from finetune.state import RunState


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

def chunk_lever_ok(spec: RunSpec, s: Setup) -> bool:
    """Whether the governor may turn on ``train.loss_chunk`` for this run: it is off, the
    ranks are not FSDP shards (the head's weights are sharded outside FSDP's forward) and,
    on cuda, the loss is not compiled (the chunked loss picks rows on the host). The same
    refusals the runtimes give a user who sets it."""
    compiled = spec.train.compile
    return (not s.loss_chunk and not (s.strategy == "fsdp" and s.world_size > 1)
            and not (compiled and not capabilities(s.backend).chunked_loss_with_compile))

def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]

def _largest_fitting_micro(arch: ModelDesc, s: Setup, budget: int, ckpt: bool) -> int | None:
    eff = s.effective_batch
    for d in _divisors_desc(eff):
        if _fits(_core(arch, _setup_with(s, batch=d, grad_accum=eff // d, ckpt=ckpt)), budget):
            return d
    return None

def _levers(arch: ModelDesc, s: Setup, budget: int) -> list[dict[str, Any]]:
    """Single changes that make the run fit at its current micro-batch (or at micro-batch 1
    with checkpointing when nothing else is left), each with its predicted peak."""
    out: list[dict[str, Any]] = []

    def trial(change: str, **kw: Any) -> None:
        try:
            p = _core(arch, _setup_with(s, **kw))
        except UserError:
            return
        if _fits(p, budget):
            out.append({"change": change, "peak_bytes": p["fits_bytes"]})

    if not s.ckpt:
        trial("train.grad_checkpointing=true", ckpt=True)
    if not s.loss_chunk and not (s.strategy == "fsdp" and s.world_size > 1):
        trial(f"train.loss_chunk={LOSS_CHUNK_LEVER}", loss_chunk=LOSS_CHUNK_LEVER)  # the logits never whole
    caps = capabilities(s.backend)
    if s.optim in ("adamw", "adam") and "adamw_8bit" in caps.optimizers:
        trial("optim=adamw_8bit", optim="adamw_8bit")
        if s.device == caps.gpu_device and "paged_adamw_8bit" in caps.optimizers:
            trial("optim=paged_adamw_8bit", optim="paged_adamw_8bit")
    qlora = memory_model(s.backend).qlora_lever(arch, s) if "qlora" in caps.methods else None
    if qlora is not None:
        trial("method=qlora", method="qlora", **qlora)
    if s.device == caps.gpu_device and "expandable_segments:true" not in (s.alloc_conf or "").lower().replace(" ", ""):
        # reserved without the fragmentation between steps' shapes (the allocator replayed with it)
        trial("backend.alloc_conf=expandable_segments:True", alloc_conf="expandable_segments:True")
    if s.precision != "bf16-true":
        bf = {"weight_dtype": "bfloat16", "compute_dtype": "bfloat16", "autocast": False,
              "adapter_dtype": "bfloat16", "precision": "bf16-true"}
        trial("precision=bf16-true", **bf)
    if s.adapters and len(s.lora_layers) > 1:
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
    if s.device == caps.gpu_device and s.world_size == 1:
        # more GPUs: device_map=auto splits the layers over them (a model whose weights alone
        # exceed one device, e.g. an MoE's experts, fits no other way)
        for n in (2, 3, 4, 5, 6, 8, 12, 16):
            if n > s.n_devices:
                p = _core(arch, _setup_with(s, n_devices=n))
                if _fits(p, budget):
                    out.append({"change": f"backend.device_map=auto backend.num_devices={n}",
                                "peak_bytes": p["fits_bytes"]})
                    break
    best, lo, hi = None, 8, s.seq_len - 1
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

def _recommend(arch: ModelDesc, s: Setup, budget: int | None) -> dict[str, Any] | None:
    """Largest micro-batch that fits (a divisor of the effective batch, so the math stays the
    same), with and without checkpointing, and single levers that make the run fit."""
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
    base = s if micro is not None else smallest  # levers on top of the smallest configuration
    rec["levers"] = _levers(arch, base, budget) if not _fits(_core(arch, base), budget) else []
    if micro is None:
        rec["levers_apply_to"] = "micro-batch 1 with gradient checkpointing"
    return rec

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

def fit_to_budget(spec: RunSpec, budget_bytes: int, seq_len: int | None = None, state: Any = None,
                  head_fraction: float | None = None, pair_span: float | None = None,
                  row_targets: int | None = None, longest: int | None = None) -> FitResult:
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
    "train.seq_len=512".
    """
    arch, s = resolve(spec, seq_len, state, head_fraction, pair_span, row_targets, longest)
    data: dict[str, Any] = {"head_fraction": head_fraction, "pair_span": pair_span, "row_targets": row_targets,
                            "longest": longest}
    budget = int(budget_bytes)
    eff = s.effective_batch
    base = state or (RunState.from_spec(spec, s.backend) if s.packed else RunState(s.backend, s.batch, eff, s.ckpt))

    def full_plan(batch: int, ckpt: bool) -> Plan:
        return plan(spec, seq_len=seq_len, budget_bytes=budget, recommend=False, **data,
                    state=base.with_(micro_batch=batch if not s.packed else base.micro_batch,
                                     grad_checkpointing=ckpt, loss_chunk=s.loss_chunk))

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
        return _fit_packed(spec, arch, s, base, budget, before, events, seq_len, data)
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
            return FitResult(True, full_plan(d, ckpt), d, eff // d, ckpt, events, loss_chunk=s.loss_chunk)
    smallest = _setup_with(s, batch=1, grad_accum=eff, ckpt=True)
    suggestions = [lv["change"] for lv in _levers(arch, smallest, budget)]
    return FitResult(False, full_plan(1, True), 1, eff, True, [], suggestions, loss_chunk=s.loss_chunk)


def _fit_packed(spec: RunSpec, arch: ModelDesc, s: Setup, base: Any, budget: int, before: dict[str, Any],
                events: list[dict[str, Any]], seq_len: int | None, data: dict[str, Any]) -> FitResult:
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
    suggestions = [lv["change"] for lv in _levers(arch, smallest, budget)]
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
    return {"ram_bytes": ram, "peak_anonymous_bytes": anon, "fits": anon <= ram}


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
         step_widths: tuple[int, ...] = ()) -> Plan:
    """Predict a run's memory without loading weights (the content of plan.json).

    Args:
        spec: the run's resolved spec (finetune.resolver.resolve).
        seq_len: tokens per sample to plan for; default ``train.seq_len``. Pass the data's
            longest (truncated) sample for a tighter plan.
        budget_bytes: the budget to judge ``fits`` against; default ``memory.budget`` or the device.
        recommend: also search the largest micro-batch and levers that fit.
        state: the run's live state (finetune.state.RunState), where a run is under way.
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

    Returns:
        The plan (finetune.records.Plan): ints of bytes, written as plan.json.
    """
    arch, s = resolve(spec, seq_len, state, head_fraction, pair_span, row_targets, longest)
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
        **core,
        "device_total_bytes": device_total,
        "budget_bytes": budget,
        "budget_source": budget_source,
        "fits": fits,
        "host": host,
        **device,
        "recommendation": _recommend(arch, s, budget) if recommend else None,
        "notes": list(arch.notes) + s.notes + memory_model(s.backend).notes(s) + _approximations(arch, s),
    }
    return out
