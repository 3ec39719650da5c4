"""The plan as a user reads it (a table, plan.json) and as the run checks it (plan_error)."""

from __future__ import annotations

from typing import Any, cast

from finetune.io import atomic_write_json
from finetune.planner import preference
from finetune.planner.fit import plan
from finetune.data.lengths import data_lengths
from finetune.model.inventory import GIB
from finetune.records import PLAN_KEYS, RANK_KEYS, WEIGHT_KEYS, Census, Plan, Sample
from finetune.spec import RunSpec
from finetune.backends import capabilities, memory_model


def _err(predicted: int | None, measured: int | None) -> dict[str, Any]:
    if predicted is None or measured is None:
        rel = None
    elif measured == 0:
        rel = 0.0 if predicted == 0 else None
    else:
        rel = (predicted - measured) / measured
    return {"predicted": predicted, "measured": measured,
            "error_bytes": None if predicted is None or measured is None else predicted - measured,
            "relative_error": rel}

def plan_error(plan: Plan, census: Census | None, measured: Sample | None) -> dict[str, Any]:
    """Per-category prediction error after the first optimizer step.

    Args:
        plan: a plan() result for the run as it is (micro-batch, checkpointing).
        census: Backend.census() (bytes by category of live tensors).
        measured: the accountant's sample after the step (allocated, step_peak_allocated, ...).

    Returns:
        {category: {predicted, measured, error_bytes, relative_error}}; relative error is
        (predicted - measured) / measured, None where either side is unknown. Gradients are
        released by the step, so a census of 0 there is reported as not measured.
    """
    b = plan["bytes"]
    c: Census = census or {}
    m: Sample = measured or {}
    weights_measured = None
    if c:
        weights_measured = sum(int(c.get(k) or 0) for k in WEIGHT_KEYS)
    grads_measured = c.get("grads")
    out = {
        "weights": _err(b["weights"], weights_measured),
        "trainable_weights": _err(b["trainable_weights"], c.get("trainable_weights")),
        "grads": _err(b["grads"], grads_measured if grads_measured else None),
        "optimizer_state": _err(b["optimizer_state"], c.get("optimizer_state")),
        "optimizer_state_paged": _err(b["optimizer_state_paged"], c.get("optimizer_state_paged")),
        "steady_state_allocated": _err(plan.get("steady_state_allocated_bytes"), m.get("allocated")),
        "peak_allocated": _err(plan.get("peak_allocated_bytes"),
                               m.get("step_peak_allocated", m.get("peak_allocated"))),
    }
    step1 = (plan.get("phases") or {}).get("step1")
    if step1:  # the first step in the metrics that run out: the allocator's reserve, NVML, the host
        out["step1_reserved"] = _err(step1["reserved_bytes"], m.get("step_peak_reserved", m.get("peak_reserved")))
        out["step1_device_level"] = _err(step1["device_bytes"], m.get("device_used"))
        out["step1_host"] = _err(step1["host_bytes"], m.get("peak_rss", m.get("rss")))
    return out


_RUN_ERR_LABELS = (("peak_allocated", "allocated"), ("peak_reserved", "reserved"),
                   ("peak_device_level", "device (NVML)"), ("peak_host", "host RSS"))


def format_run_plan_error(err: dict[str, Any] | None) -> str:
    """One line: each metric's planned steady state against the run's measured peak, where both
    are known ("" when nothing is)."""
    if not err:
        return ""
    parts = []
    for key, label in _RUN_ERR_LABELS:
        e = err.get(key) or {}
        if e.get("predicted") is None or e.get("measured") is None or e.get("relative_error") is None:
            continue
        parts.append(f"{label} {e['predicted'] / GIB:.2f} vs {e['measured'] / GIB:.2f} GiB "
                     f"({100 * e['relative_error']:+.1f}%)")
    return ("[plan] planned steady state vs the run's peaks: " + "; ".join(parts)) if parts else ""


def run_plan_error(plan: Plan | None, peaks: dict[str, Any]) -> dict[str, Any] | None:
    """The whole run's peaks against the plan's steady state: reserved, the device level (NVML's
    device used) and the host (RSS), beside allocated; None without a plan. ``peaks``: the
    accountant summary's ``peaks``."""
    if not plan or not plan.get("phases"):
        return None
    st = plan["phases"]["steady"]
    return {"peak_allocated": _err(st["allocated_bytes"], peaks.get("allocated_bytes")),
            "peak_reserved": _err(st["reserved_bytes"], peaks.get("reserved_bytes")),
            "peak_device_level": _err(plan.get("max_device_level_bytes"), peaks.get("device_used_bytes")),
            "peak_host": _err(plan.get("max_host_bytes"), peaks.get("rss_bytes"))}

def _gib(b: int | None) -> str:
    return f"{'?':>9s} {'?':>16s}" if b is None else f"{b / GIB:9.3f} {b:16,d}"

def format_table(plan: Plan) -> str:
    """The plan as a table for a terminal (GiB = 2^30 bytes, labelled)."""
    b = plan["bytes"]
    fits = plan.get("fits")
    verdict = "unknown (no budget)" if fits is None else ("yes" if fits else "NO")
    dt = plan.get("dtypes") or {}
    pr = plan.get("per_rank")
    where = f"{plan['device']}{' x' + str(plan['devices']) if plan['devices'] > 1 else ''}"
    if pr:
        where += f", {pr['strategy']} over {pr['world_size']} ranks"
    head = (f"plan: {plan['model'].get('name') or 'model'} {plan['method']} {plan['optim']} {plan['precision']} "
            f"on {plan['backend']} ({where}): "
            f"peak {plan['fits_bytes'] / GIB:.2f} GiB per {'rank' if pr else 'device'}"
            + (" (NVML used" + (", paged state left out" if any(dv.get("evictable_bytes") for dv in plan["per_device"])
                                else "") + ")" if plan.get("phases") and plan["fits_bytes"] != plan["max_device_peak_bytes"]
               else "")
            + " vs budget "
            + (f"{budget / GIB:.2f} GiB" if (budget := plan.get("budget_bytes")) else "unknown")
            + f", fits: {verdict}")
    device_head, device_lines = memory_model(plan["backend"]).device_report(plan)
    head += device_head
    lines = [head,
             f"  params: {plan['params_total']:,} total, {plan['params_trainable']:,} trainable",
             (f"  micro-batch {plan['batch_size']} x grad_accum {plan['grad_accum']} = {plan['effective_batch']}"
              + (f" per rank, x {pr['world_size']} ranks = {plan['effective_batch'] * pr['world_size']} per step"
                 if pr else "")
              + f", seq_len {plan['seq_len']}, grad_checkpointing {plan['grad_checkpointing']}, "
              f"attention {plan['attn_implementation']}"),
             (f"  dtypes: weights {dt.get('weights')}" + (f", adapters {dt['adapters']}" if dt.get("adapters") else "")
              + f", compute {dt.get('compute')}" + (f", quantized {dt['quantized']}" if dt.get("quantized") else "")
              + (f" (stored dtype from {dt['stored']})" if dt.get("stored") else "")),
             f"  {'category' + (' (per rank)' if pr else ''):32s}{'GiB':>9s} {'bytes':>16s}"]
    if plan.get("preference"):  # a preference objective: pairs, rows, the reference
        lines.insert(-1, preference.table_line(plan["preference"]))
    for cat in PLAN_KEYS:
        note = {"trainable_weights": " (part of weights)", "optimizer_state_paged": " (unified memory, not in peak)"}.get(cat, "")
        lines.append(f"  {cat:32s}{_gib(b[cat])}{note}")
    for k, v in (plan.get("collective_buffers") or {}).items():
        lines.append(f"  {'buffer: ' + k:32s}{_gib(v['bytes'])}  (transient, {v['phase']})")
    lines.append(f"  {'steady state (after a step)':32s}{_gib(plan['steady_state_allocated_bytes'])}")
    lines.append(f"  {'peak allocated':32s}{_gib(plan['peak_allocated_bytes'])}  ({plan['peak_phase']})")
    lines.append(f"  {'peak (with overhead)':32s}{_gib(plan['peak_bytes'])}")
    lines += _phase_lines(plan)
    off = plan.get("activation_offload")
    if off:
        lines.append(f"  {'activation offload':32s}{_gib(off['device_saving_bytes'])}  (device saving; host "
                     f"{off['host_bytes'] / GIB:.2f} GiB{' pinned' if off['pinned'] else ''}; moved "
                     f"{off['transfer_bytes_per_step'] / GIB:.2f} GiB a step, to the host and back)")
    cpu_off = cast(dict[str, Any], plan["per_device"][0]).get("cpu_offload_host_bytes")
    if isinstance(cpu_off, int):  # backend.cpu_offload: FSDP's shards, their gradients and the state
        lines.append(f"  {'cpu offload (host, per rank)':32s}{_gib(cpu_off)}  (shards, gradients and optimizer "
                     "state in host memory" + ("; on the CPU the device is the host)" if plan["device"] == "cpu"
                                                else ")"))
    if plan["devices"] > 1:
        budget = plan.get("budget_bytes")
        lines.append(f"  per device (GiB){'':6s}{'weights':>9s}{'grads':>9s}{'optim':>9s}{'paged':>9s}{'activ':>9s}"
                     f"{'logits':>9s}{'peak':>9s}  fits  modules")
        for dv in plan["per_device"]:
            db = dv["bytes"]
            ok = "?" if budget is None else ("yes" if dv["peak_bytes"] <= budget else "NO")
            lines.append(f"    gpu {dv['index']:<16d}" + "".join(f"{db[k] / GIB:9.2f}" for k in RANK_KEYS)
                + f"{dv['peak_bytes'] / GIB:9.2f}  {ok:4s}  {dv['modules']}")
    if pr:
        lines += _rank_table(pr, plan.get("budget_bytes"))
    lines.append(f"  {'budget':32s}{_gib(plan.get('budget_bytes'))}  ({plan.get('budget_source')})")
    lines += device_lines
    if plan.get("budget_bytes") is None:
        gpu = plan["device"] == capabilities(plan["backend"]).gpu_device
        where = "per GPU" if gpu else "of this device"
        lines.append(f"  fits is unknown: {'no CUDA device is visible here' if gpu else 'the device size is unknown'}; "
                     f"set memory.budget (bytes {where}), e.g. memory.budget=48GiB")
    rec = plan.get("recommendation")
    if rec:
        lines += _advice_lines(plan, rec)
    need = plan.get("needs")
    if need:
        lines += _needs_lines(need)
    data = plan.get("data")
    if data:
        lines += _data_lines(plan, data)
    for n in plan.get("notes", []):
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def _needs_lines(need: dict[str, Any]) -> list[str]:
    """What the run needs to fit its budget on its devices (planner.fit ``_needs``), GiB = 2^30 bytes."""
    n, budget = need["devices"], need["budget_bytes"]
    where = f"{n} device{'s' if n > 1 else ''} of {budget / GIB:.2f} GiB"
    if not need["fits"]:
        every = need.get("every_lever_peak_bytes")
        out = [f"  needs: nothing fits {where}" + (f" (every lever together peaks at {every / GIB:.2f} GiB per device)"
                                                   if every else "")]
        out += [f"    would fit: {w}" for w in need.get("would_fit", [])]
        return out
    # ranks (one process a device) unless the layers are split in one process
    ranks = 1 if "split" in need.get("levers", []) else n
    each = f" per rank ({ranks * need['host_bytes'] / GIB:.2f} GiB for {ranks} ranks on one machine)" if ranks > 1 else ""
    out = [f"  needs, to fit {where}: {need['change'] or 'nothing changed'} (peak {need['peak_bytes'] / GIB:.2f} GiB "
           f"per device); host RAM {need['host_bytes'] / GIB:.2f} GiB the process cannot give back{each}"
           + (f", plus the checkpoint's mapped pages at the load ({need['host_file_bytes'] / GIB:.2f} GiB, dropped under "
              "pressure)" if need.get("host_file_bytes") else "")]
    if need.get("transfer_bytes_per_step"):
        out.append(f"    moved over the host link: {need['transfer_bytes_per_step'] / GIB:.2f} GiB a step")
    out += [f"    {lv}: {cost}" for lv, cost in zip(need["levers"], need["costs"])]
    return out


def _advice_lines(plan: Plan, rec: dict[str, Any]) -> list[str]:
    """What to type: the largest micro-batch that fits and its overrides, what the governor
    does itself (memory.adapt), and each lever of a plan over its budget as the overrides that
    make it fit, what it saves and what it costs, cheapest first (GiB = 2^30 bytes)."""
    out = []
    big, eff = rec.get("largest_micro_batch"), plan["effective_batch"]
    with_ckpt = rec.get("max_micro_batch_with_grad_checkpointing")
    if plan.get("packing") or "largest_micro_batch" not in rec:  # packed: train.tokens_per_micro is the lever
        out.append(f"  largest micro-batch that fits: {rec.get('max_micro_batch')}"
                   + (f" (with grad checkpointing: {with_ckpt})" if "max_micro_batch_with_grad_checkpointing" in rec
                      else ""))
    elif big is None:
        out.append("  largest micro-batch that fits: none" + (
            f"; with gradient checkpointing {with_ckpt} (train.grad_checkpointing=true"
            + (f" train.batch_size={with_ckpt} train.grad_accum={eff // with_ckpt}" if with_ckpt != plan["batch_size"]
               else "") + ")" if with_ckpt else
            f", not even 1 with gradient checkpointing (peak {rec['smallest_peak_bytes'] / GIB:.2f} GiB)"))
    else:
        b, a = big["batch_size"], big["grad_accum"]
        size = f"at least {b}" if big.get("search_max") else f"{b}"
        if (b, a) == (plan["batch_size"], plan["grad_accum"]):
            out.append(f"  largest micro-batch that fits: {size}, as configured")
        elif b < plan["batch_size"]:
            out.append(f"  largest micro-batch that fits: {size}: {big['change']} (the same effective batch {eff})")
        else:
            keep = f"train.batch_size={eff} train.grad_accum=1"
            what = (f"the same effective batch {eff} in fewer micro-batches" if b * a == eff
                    else f"an effective batch of {b * a}, not {eff}: other math"
                    + (f"; {keep} keeps it" if plan["grad_accum"] > 1 else ""))
            out.append(f"  largest micro-batch that fits: {size}: {big['change']} ({what}; the governor lowers a "
                       "micro-batch that does not fit, never raises one: type it to use it)")
    gov = rec.get("governor")
    levers = rec.get("levers") or []
    if gov is not None:
        if gov["change"]:
            does = f"applies {gov['change']} itself before loading (peak {gov['peak_bytes'] / GIB:.2f} GiB)"
        elif gov["fits"]:
            does = "finds the run fits as configured, at the data's widths, and changes nothing"
        else:
            does = (f"cannot fit it (micro-batch 1 with gradient checkpointing peaks at "
                    f"{rec['smallest_peak_bytes'] / GIB:.2f} GiB): the run stops before loading")
        out.append(f"  with memory.adapt=true (the default) the governor {does}" if gov["adapt"] else
                   f"  memory.adapt=false: the run changes nothing itself (with memory.adapt=true the governor {does})")
    if levers:
        out.append("  to fit the budget, type any one of these (cheapest first):")
        width = min(max(len(lv["change"]) for lv in levers), 72)
        for lv in levers:
            saves = lv.get("saves_bytes")
            out.append(f"    {lv['change']:{width}s}  " + (f"saves {saves / GIB:6.2f} GiB, " if saves is not None else "")
                       + f"peak {lv['peak_bytes'] / GIB:.2f} GiB" + (f": {lv['cost']}" if lv.get("cost") else ""))
    elif rec.get("max_micro_batch") is None and with_ckpt is None:
        out.append(f"  nothing fits: micro-batch 1 with gradient checkpointing peaks at "
                   f"{rec['smallest_peak_bytes'] / GIB:.2f} GiB, and no single lever (8-bit optimizer, lora, qlora, "
                   "bf16-true, fewer adapted layers, shorter seq_len, more GPUs) brings it under the budget")
    return out


_PHASE_LABELS = {"load": "load", "step1": "step 1", "steady": "steady state"}


def _phase_lines(plan: Plan) -> list[str]:
    """The load, step 1 and the steady state in the four metrics (GiB = 2^30 bytes), and what
    the device level adds to reserved: the figures a device and a host run out in."""
    phases = plan.get("phases")
    if not phases:
        return []
    pr = plan.get("per_rank")
    who = "per rank" if pr else ("on the fullest GPU" if plan["devices"] > 1 else "per device")
    # a device level planned above the allocator (a GPU's NVML view), with its allocator replayed
    replayed = any(dv.get("device_level_planned") for dv in plan["per_device"])
    dev_label = "NVML used" if replayed else "device"
    out = [f"  by phase ({who}, GiB)        {'allocated':>10s}{'reserved':>10s}{dev_label:>11s}{'host RSS':>10s}"]
    for k, label in _PHASE_LABELS.items():
        ph = phases[k]
        out.append(f"    {label:28s}" + "".join(f"{ph[m] / GIB:10.3f}" for m in ("allocated_bytes", "reserved_bytes"))
                   + f"{ph['device_bytes'] / GIB:11.3f}{ph['host_bytes'] / GIB:10.3f}")
    extra = next((dv.get("non_allocator") for dv in plan["per_device"]
                  if dv.get("phases") == phases), None) or {}
    if extra:
        names = {"cuda_context": "CUDA context", "lazy_modules": "kernels loaded on first use",
                 "paged_optimizer_state": "paged optimizer state (resident)", "nccl_buffers": "NCCL buffers (estimate)"}
        out.append("  NVML used = reserved + " + " + ".join(f"{names.get(k, k)} {v / 2**20:,.0f} MiB"
                                                          for k, v in extra.items() if v))
    host = plan.get("host")
    if host:
        ranks = host.get("ranks_on_host", 1)
        each = (f" per rank, {ranks * host['peak_anonymous_bytes'] / GIB:.2f} GiB for {ranks} ranks on one machine"
                if ranks > 1 else "")
        out.append(f"  host: {host['peak_anonymous_bytes'] / GIB:.2f} GiB the process cannot give back (the checkpoint's "
                   f"mapped pages left out){each} against {host['ram_bytes'] / GIB:.2f} GiB of RAM here: "
                   + ("fits" if host["fits"] else "does NOT fit"))
    leap = plan.get("step2_reserved_leap_bytes") or 0
    if replayed:
        conf = plan.get("alloc_conf") or "torch's default"
        out.append(f"  reserved: torch's caching allocator replayed ({conf}); step 2 reserves "
                   f"{leap / 2**20:+,.0f} MiB over step 1 at the same phase (what step 1 left cached: gradients and temporaries, "
                   "and the blocks its new optimizer state took)")
    return out


def _data_lines(plan: Plan, data: dict[str, Any]) -> list[str]:
    """The data the plan read: its length distribution, what was planned, and the upper bound."""
    b = data["seq_len_bound"]
    what = "packed micro-batch of the run's steps" if data["packed"] else "sample (padded as the run pads)"
    pref = plan.get("preference")
    if pref:  # a preference run's items are pairs (a pair as long as its longer sample)
        what = "pair (padded as the run pads)"
    lines = [f"  data: {data['samples']:,} training {'pairs' if pref else 'samples'} ({data['source']}), tokens per "
             f"{'pair' if pref else 'sample'}: min {data['min']}, median {data['median']}, p90 {data['p90']}, "
             f"p99 {data['p99']}, max {data['max']}",
             f"  planned at the widest micro-batch the run will see: {plan['seq_len']} tokens (the longest {what}); "
             f"the bound at train.seq_len={b['seq_len']}: peak {b['max_device_peak_bytes'] / GIB:.2f} GiB"]
    if pref and pref["head_on_every_position"]:
        return lines + ["  the output head runs on every position: the log-probs are gathered from the whole logits"]
    return lines + [
            (f"  the output head runs on target positions only: at most {data['row_targets']:,} of a packed "
             f"micro-batch's {plan['seq_len']:,} positions in this data (prompts and pads carry no loss)"
             if data.get("row_targets") else
             f"  the output head runs on target positions only: at most {data['head_fraction']:.0%} of a micro-batch's "
             "positions in this data (prompts and pads carry no loss)")]

_RANK_COLS = (("weights", "weights"), ("grads", "grads"), ("optimizer_state", "optim"), ("activations", "activ"),
              ("logits", "logits"))
_BUFFER_LABELS = {"all_gather": "gather", "unsharded_grads": "unsh.grad", "reduce_scatter": "r-scatter",
                  "ddp_bucket": "bucket", "all_sum_output": "all_sum"}
_MAX_RANK_ROWS = 16  # beyond this many ranks, rank 0's row stands for the identical others


def _rank_table(pr: dict[str, Any], budget: int | None) -> list[str]:
    """A row per rank, then Overall (sums over ranks), GiB = 2^30 bytes."""
    names = list(pr["ranks"][0]["buffers"])
    heads = [h for _, h in _RANK_COLS] + [_BUFFER_LABELS.get(n, n[:9]) for n in names] + ["peak", "reserved",
                                                                                          "device"]
    out = [f"  per rank (GiB), {pr['strategy']} over {pr['world_size']} ranks"
           + "".join(f"{h:>10s}" for h in heads) + "  fits"]

    def row(label: str, r: dict[str, Any], fits: str) -> str:
        st = (r.get("phases") or {}).get("steady") or {}
        vals = [r[k] for k, _ in _RANK_COLS] + [r["buffers"][n] for n in names] + [
            r["peak_bytes"], st.get("reserved_bytes", 0), st.get("device_bytes", 0)]
        width = len(f"  per rank (GiB), {pr['strategy']} over {pr['world_size']} ranks")
        return f"{'    ' + label:{width}s}" + "".join(f"{v / GIB:10.2f}" for v in vals) + f"  {fits}"

    ranks = pr["ranks"]
    shown = ranks if len(ranks) <= _MAX_RANK_ROWS else ranks[:1]
    for r in shown:
        judged = max((ph["device_bytes"] for ph in (r.get("phases") or {}).values()), default=r["peak_bytes"])
        ok = "?" if budget is None else ("yes" if judged <= budget else "NO")
        out.append(row(f"rank {r['rank']}", r, ok))
    if len(shown) < len(ranks):
        out.append(f"    ranks 1..{len(ranks) - 1}: the same as rank 0")
    out.append(row("Overall", pr["overall"], ""))
    if pr.get("ranks_identical"):
        out.append(f"  ranks are identical under {pr['strategy']}: each holds the same share of the model and runs the "
                   "same micro-batch size (planned figures, not measured differences); Overall sums the ranks; "
                   "reserved and device are the steady state's, fits the device level's highest phase")
    return out


def run_plan(spec: RunSpec) -> Plan:
    """mode=plan: compute the plan, write ``paths.run_dir/plan.json`` atomically (temp file +
    rename), print the table, return the plan.

    Where the data can be read as the run reads it (finetune.data.lengths), the plan prices the
    widest micro-batch the run will really see, with the samples' length distribution and the
    ``train.seq_len`` plan as the upper bound in ``data``; else it plans ``train.seq_len`` and
    a note says why the data was not read."""
    lengths, why = data_lengths(spec)
    if lengths is None:
        p = plan(spec)
        p["notes"].append(f"planned at train.seq_len: the data's lengths were not read ({why})")
    else:
        bound = plan(spec, recommend=False)
        # unpacked, the run pads to at most train.seq_len already (data.padded_length)
        p = plan(spec, seq_len=lengths.planned_tokens, head_fraction=lengths.head_fraction,
                 pair_span=lengths.pair_span, row_targets=lengths.row_targets,
                 longest=lengths.max if lengths.packed else None, step_widths=lengths.step_widths,
                 pairs=lengths.pairs)
        p["data"] = {**lengths.as_dict(),
                     "seq_len_bound": {"seq_len": bound["seq_len"], "peak_bytes": bound["peak_bytes"],
                                       "max_device_peak_bytes": bound["max_device_peak_bytes"],
                                       "fits": bound["fits"]}}
    atomic_write_json(spec.paths.run_dir / "plan.json", p)
    print(format_table(p))
    return p
