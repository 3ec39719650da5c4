"""FSDP with method=qlora and backend.cpu_offload (issue 34), under torchrun on the CPU (gloo).

Two real `torchrun --nproc-per-node 2` runs of 5 steps, shared by the tests (module fixture):
a tiny Llama with FSDP-QLoRA, and a tiny Mixtral (MoE) with FSDP-QLoRA and CPU offload. Each
rank writes its own census (tests/dist_scripts/torch_rank_memory.py); the one-process
references train in this process. The plans are the planner's own, per rank.

What the CPU can and cannot show: here the "device" is the host, so CPU offload moves nothing
between memories; what is compared is the plan's host figure per rank (the process's base plus
everything the rank holds, offloaded or not) against the rank's measured peak RSS, and the
bytes the plan puts on the host against the census of the tensors the rank holds there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from families import build_family

from tests.conftest import REPO, make_cfg, make_spec, needs_torch
from tests.test_dist_torch import _env, _steps
import warm_cli

pytestmark = needs_torch

COMMON = ["backend=cuda", "backend.device=cpu", "method=qlora", "train.steps=5", "train.eval_every=0",
          "train.progress=false", "train.warmup_steps=1"]
LORA = tuple("method=lora" if c == "method=qlora" else c for c in COMMON)
SCRIPT = str(REPO / "tests" / "dist_scripts" / "torch_rank_memory.py")
# family -> the overrides of its two-rank run (the MoE one offloads too)
RUNS = {"llama": ("backend.strategy=fsdp",), "mixtral": ("backend.strategy=fsdp", "backend.cpu_offload=true")}


def _model(family: str) -> str:
    return f"model.path={build_family(family)}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per family: the one-process run (micro-batch 4), the two-rank run (micro-batch 2 each:
    the same 4 samples a step), each rank's record, and the plan of the two-rank run."""
    from finetune import planner
    from finetune.resolver import resolve
    from finetune.run.loop import train

    from finetune.run.state import RunState

    base = tmp_path_factory.mktemp("fsdpq")
    out: dict[str, dict] = {}
    for fam, over in RUNS.items():
        one = base / f"{fam}-one"
        train(resolve(make_cfg(one, *COMMON, _model(fam), "train.batch_size=4")))
        out[fam] = {"one": one, **_two_ranks(base, fam, _model(fam), "train.batch_size=2", *over)}
    # the governor's run: LoRA on a tiny Qwen3 (a second dense family through the sharded load; its
    # fp32 shards are what CPU offload moves, where a tiny model's 4-bit ones weigh less than
    # activation offload saves), under a budget below the
    # plan with every cheaper lever (micro-batch 1, checkpointing, activation offload) and above
    # the plan with CPU offload; planned as the run plans it, at the data's own lengths
    from transformers import AutoTokenizer

    from finetune.data import build

    lora = (*LORA, _model("qwen3"))
    train(resolve(make_cfg(base / "lora-one", *lora, "train.batch_size=4")))
    spec = make_spec(base / "budget-plan", *lora, "train.batch_size=2", *RUNS["llama"], "backend.num_devices=2")
    _, stats = build(spec, AutoTokenizer.from_pretrained(str(build_family("qwen3"))))
    at = {"seq_len": stats["max_padded_tokens"], "head_fraction": stats.get("head_fraction"), "recommend": False}
    smallest = RunState("cuda", 1, 2, True)
    cheaper, offloaded = (planner.plan(spec, state=st, **at)["fits_bytes"]
                          for st in (smallest.with_(activation_offload=True), smallest.with_(cpu_offload=True)))
    assert offloaded < cheaper, (offloaded, cheaper)
    out["governed"] = {"one": base / "lora-one", **_two_ranks(base, "governed", "train.batch_size=2", *RUNS["llama"],
                                                              f"memory.budget={(offloaded + cheaper) // 2}",
                                                              common=lora)}
    return out


def _two_ranks(base: Path, name: str, *over: str, common: tuple[str, ...] = tuple(COMMON)) -> dict:
    """One ``torchrun --nproc-per-node 2`` run of ``common`` and ``over``: its run dir, output,
    each rank's record and the plan of it, per rank."""
    from finetune import planner

    two, ranks = base / f"{name}-two", base / f"{name}-ranks"
    ranks.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", SCRIPT,
           *common, *over, f"hydra.run.dir={two}"]
    r = warm_cli.run(cmd, capture_output=True, text=True, env={**_env(), "RANK_MEMORY_DIR": str(ranks)},
                       cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    plan = planner.plan(make_spec(base / f"{name}-plan", *common, *over, "mode=plan", "backend.num_devices=2"),
                        recommend=False)
    return {"two": two, "stderr": r.stderr, "output": r.stdout + r.stderr, "plan": plan,
            "ranks": [json.loads((ranks / f"rank{i}.json").read_text()) for i in (0, 1)]}


@pytest.mark.parametrize("family", list(RUNS))
def test_two_ranks_train_the_one_process_losses(runs, family: str) -> None:
    d = runs[family]
    ref, got = _steps(d["one"]), _steps(d["two"])
    assert [s["step"] for s in got] == [1, 2, 3, 4, 5]
    assert [s["loss"] for s in got] == pytest.approx([s["loss"] for s in ref], rel=1e-6)
    assert [s["grad_norm"] for s in got] == pytest.approx([s["grad_norm"] for s in ref], rel=1e-5)
    assert [s["tokens"] for s in got] == [s["tokens"] for s in ref]
    assert "2 ranks (fsdp)" in d["stderr"]
    # the adapter rank 0 wrote (its trainable weights alone gathered from the shards) holds the
    # one-process adapter's keys and weights
    from safetensors.torch import load_file

    a, b = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (d["one"], d["two"]))
    assert sorted(a) == sorted(b) and a
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


@pytest.mark.parametrize("family", list(RUNS))
def test_each_rank_holds_half_the_4bit_weights_and_the_plan_to_the_byte(runs, family: str) -> None:
    d = runs[family]
    one = json.loads((d["one"] / "summary.json").read_text())["memory"]["census_end"]
    plan = d["plan"]["per_rank"]["ranks"]
    for rank, rec in enumerate(d["ranks"]):
        c = rec["census"]
        # every weight of these models has an even number of rows (4-bit ones: of their float
        # storage), so each rank holds exactly half; bitsandbytes' QuantState is no parameter,
        # so every rank keeps all of it
        assert c["frozen_weights"] * 2 == one["frozen_weights_bytes"]
        assert c["trainable_weights"] * 2 == one["trainable_weights_bytes"]
        assert c["quant_buffers"] == one["quant_buffers_bytes"] == d["plan"]["quant_constants_bytes"] > 0
        p = plan[rank]
        assert c["frozen_weights"] + c["trainable_weights"] + c["quant_buffers"] == p["weights"]
        assert c["optimizer_state"] == p["optimizer_state"] > 0
        assert c["grads"] == 0  # set to None after the step


def test_cpu_offload_puts_the_shards_and_state_on_the_host_as_planned(runs) -> None:
    """The plan's host figure under cpu_offload: the offloaded bytes (shards, gradients, state)
    are the census's tensors (all on the host here), and the rank's whole host figure (the
    process base, 453 MiB measured on this box, plus what the rank holds) is within 10% of the
    rank's measured peak RSS. And what the rank holds between steps as the plan has it (the
    offloaded shards and state, the quantization constants beside them, the libraries' first
    use) is within 10% of the rank's RSS growth from just before the load to after its last
    step, the C heap's free pages handed back (the growth that is live; the runtime hands them
    back itself only after a step that left 32 MiB or more, which a model this small never
    does). On a model of a few hundred KiB that growth is mostly the libraries' first use; on
    the 110M model of benchmarks/results/fsdp_sharded_load_cpu.txt section 4 the offloaded
    state is 211 of its 244 MiB."""
    from finetune.backends.cuda.memory import HOST_FIRST_STEPS_CPU_BYTES

    d = runs["mixtral"]
    dev = d["plan"]["per_device"][0]
    summary = json.loads((d["two"] / "summary.json").read_text())
    planned_host = max(ph["host_bytes"] for ph in d["plan"]["per_rank"]["ranks"][0]["phases"].values())
    grads_planned = d["plan"]["per_rank"]["ranks"][0]["grads"]
    # between steps: the gradients are freed (set to None), the rest stays
    resting = dev["cpu_offload_host_bytes"] - grads_planned + d["plan"]["quant_constants_bytes"]
    for rank, rec in enumerate(d["ranks"]):
        c = rec["census"]
        assert dev["cpu_offload_host_bytes"] - grads_planned == (
            c["frozen_weights"] + c["trainable_weights"] + c["optimizer_state"])
        peak = summary["ranks"][rank]["peak_rss"]
        assert abs(planned_host - peak) <= 0.10 * peak, (planned_host, peak)
        growth = rec["rss_after_step_trimmed"] - rec["rss_before_load"]
        planned_growth = resting + HOST_FIRST_STEPS_CPU_BYTES
        print(f"rank {rank}: planned host {planned_host} B, peak RSS {peak} B; RSS growth from the load to after "
              f"step 5 {rec['rss_after_step'] - rec['rss_before_load']} B ({growth} B trimmed), planned {planned_growth} B")
        assert abs(planned_growth - growth) <= 0.10 * growth, (planned_growth, growth)


def test_each_rank_loads_only_its_shard_and_the_plan_prices_that_load(runs) -> None:
    """Every run loads by the sharded load, the MoE too (QLoRA on the Llama, QLoRA with CPU
    offload on the Mixtral, whose stacked experts each rank builds from its own experts'
    per-expert checkpoint tensors, LoRA on the Qwen3): each rank says so, none says it loads the
    whole model, and each rank's RSS high-water mark over its setup is within 10% of the plan's
    load-phase host figure, which holds the rank's shards and one tensor's staging, not the
    whole model. (On a model of a few hundred KiB the process's base is most of the figure; the
    growth at 110M parameters, and the MoE's before and after, is in benchmarks/results.)"""
    for name in ("llama", "mixtral", "governed"):
        d = runs[name]
        assert "loads the whole model" not in d["output"]
        said = [ln for ln in d["output"].splitlines() if "each rank loads only its shard" in ln]
        assert said, d["output"][-2000:]  # rank 0's log line (the other ranks' info lines are off)
        # the Mixtral's 2 layers x (gate_up_proj, down_proj) from per-expert tensors; none elsewhere
        assert all(f", {4 if name == 'mixtral' else 0} stacked expert weights" in ln for ln in said), said
        planned = d["plan"]["per_rank"]["ranks"][0]["phases"]["load"]["host_bytes"]
        for rec in d["ranks"]:
            assert abs(planned - rec["peak_rss_setup"]) <= 0.10 * rec["peak_rss_setup"], (planned, rec)
    plan = runs["mixtral"]["plan"]
    assert any("an MoE's stacked experts filled from this rank's experts" in n for n in plan["notes"]), plan["notes"]


def test_moe_expert_fill_is_the_whole_models_rows_bit_for_bit(tmp_path: Path) -> None:
    """The sharded load's expert fill on tiny MoEs of 3 experts (not divisible by 2 ranks: rank 0
    builds experts 0-1, rank 1 expert 2, torch.chunk's rows as FSDP2 shards them): each rank's
    rows of every weight, the stacked experts built from the checkpoint's per-expert tensors
    and the Mixtral's router renamed from block_sparse_moe, equal the whole model that
    from_pretrained loads, chunked, bit for bit: in fp32, cast to bf16 (transformers casts
    each expert's tensor before it stacks them), and under 4-bit QLoRA in bf16 (the experts
    stay unquantized, as transformers leaves them; the linears' packed 4-bit bytes and their
    biases too)."""
    import torch
    from families import COMMON, _build_once
    from finetune.backends.cuda import sharded_load
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    cpu = torch.device("cpu")
    moes = {"mixtral": {"num_local_experts": 3, "num_experts_per_tok": 2},
            "qwen2_moe": {"num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                          "shared_expert_intermediate_size": 96}}
    for mt, extra in moes.items():
        model_dir = _build_once(f"{mt}-e3-v1-s0", lambda mt=mt, extra=extra: AutoModelForCausalLM.from_config(
            AutoConfig.for_model(mt, **{**COMMON, **extra})), 0)
        for dtype, qlora in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
            bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                     bnb_4bit_quant_storage=dtype) if qlora else None
            whole = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, device_map={"": "cpu"},
                                                         **({"quantization_config": bnb} if qlora else {}))
            ref = dict(whole.named_parameters())
            hf, slots = sharded_load.skeleton(model_dir, sharded_load.config_of(model_dir, False), dtype, None, bnb,
                                              cpu)
            names = {id(m): n for n, m in hf.named_modules()}
            stacked = [s for s in slots if s.experts is not None]
            assert len(stacked) == 4  # 2 layers x (gate_up_proj, down_proj)
            assert len(slots) == len(ref)  # every weight of the model has its slot
            # the router, block_sparse_moe.gate in the Mixtral's checkpoint
            assert "model.layers.0.mlp.gate.weight" in {f"{names[id(s.module)]}.{s.attr}" for s in slots}
            for rank in (0, 1):
                for s in slots:
                    name = f"{names[id(s.module)]}.{s.attr}"
                    p = getattr(s.module, s.attr)
                    got = (sharded_load.expert_rows(s.experts, rank, 2, p.shape, p.dtype, cpu) if s.experts
                           else sharded_load.rows(s, rank, 2, dtype, cpu, cpu, p.dtype))
                    chunks = torch.chunk(ref[name].data, 2, dim=0)  # one chunk of a 1-row weight: rank 1 none
                    want = chunks[rank] if rank < len(chunks) else ref[name].data[:0]
                    if s.experts is not None:  # whole experts a rank, unquantized in the load's dtype
                        assert want.shape[0] == (2, 1)[rank] and want.dtype == dtype
                    assert got.dtype == want.dtype and got.shape == want.shape, (mt, name, got.dtype, want.dtype)
                    # the bytes: a 4-bit weight's packed storage viewed as bf16 may read as NaN
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (mt, dtype, qlora, rank, name)


def test_the_moe_families_the_sharded_load_builds_are_transformers_own_conversions() -> None:
    """host_offload.SHARDED_LOAD_MOE (the planner's side, torch-free) names exactly the MoE
    families finetune describes whose transformers conversion mapping the sharded load does:
    renamings, and converters that stack per-expert tensors on dim 0 (then concatenate gate and
    up in the expert's slab). One outside it is refused in one line, by name."""
    from finetune.backends.cuda import host_offload, sharded_load
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    for mt in host_offload.SHARDED_LOAD_MOE:
        converters = [c for c in get_checkpoint_conversion_mapping(mt) or [] if isinstance(c, WeightConverter)]
        assert converters, mt  # its checkpoints keep experts apart
        assert all(not isinstance(sharded_load.expert_merge_dim(c.operations), str) for c in converters), mt
    why = host_offload.sharded_load_refusal(4, {"model_type": "gpt_oss"}, False, False)
    assert why is not None and why.startswith("an MoE (gpt_oss)") and "mixtral" in why
    assert host_offload.sharded_load_refusal(4, {"model_type": "mixtral"}, False, False) is None


def test_governor_takes_cpu_offload_on_every_rank_with_unchanged_losses(runs) -> None:
    """Under a budget only CPU offload meets (below the plan with a smaller micro-batch,
    checkpointing and activation offload), the governor's plan before loading takes it, last in
    its order, with the same effective batch; every rank's setup gets it, and the run trains
    the one-process run's losses."""
    from finetune.planner.fit import LEVER_COSTS

    d = runs["governed"]
    assert [k for k, _ in LEVER_COSTS][-1] == "backend.cpu_offload"
    events = json.loads((d["two"] / "summary.json").read_text())["adaptations"]
    assert [e["action"] for e in events] == ["enable_cpu_offload"], events
    ev = events[0]
    assert "nothing cheaper fits" in ev["reason"] and "activation offload" in ev["reason"]
    assert ev["after"]["cpu_offload"] and not ev["before"]["cpu_offload"]
    assert ev["after"]["batch_size"] * ev["after"]["grad_accum"] == 2  # per rank, as asked
    assert [rec["cpu_offload"] for rec in d["ranks"]] == [True, True]
    ref, got = _steps(d["one"]), _steps(d["two"])
    assert [s["loss"] for s in got] == pytest.approx([s["loss"] for s in ref], rel=1e-6)
    assert [s["grad_norm"] for s in got] == pytest.approx([s["grad_norm"] for s in ref], rel=1e-5)


def test_cpu_offload_is_refused_where_it_cannot_apply(tmp_path: Path) -> None:
    from finetune.errors import UserError

    with pytest.raises(UserError, match="no offload applies on mlx") as e:
        make_spec(tmp_path, "backend=mlx", "backend.cpu_offload=true")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="add backend.strategy=fsdp"):
        make_spec(tmp_path, "backend=cuda", "backend.cpu_offload=true")


def test_one_process_fsdp_with_cpu_offload_trains_the_same_losses(runs, tmp_path: Path) -> None:
    """backend.strategy=fsdp with backend.cpu_offload=true and no launcher: FSDP2 over a group of
    this one process (its one shard is the whole model, on the host), loaded by the sharded
    load, with activation offload too (gpu_bench.sh's row on a GPU), trains the plain one-process
    run's losses; the plan of it puts the model, its
    gradients and the optimizer state on the host (the device keeps the 4-bit constants)."""
    from finetune import planner
    from finetune.resolver import resolve
    from finetune.run.loop import train

    over = (*COMMON, _model("llama"), "train.batch_size=4", "backend.strategy=fsdp", "backend.cpu_offload=true",
            "train.activation_offload=true")
    train(resolve(make_cfg(tmp_path / "run", *over)))
    ref, got = _steps(runs["llama"]["one"]), _steps(tmp_path / "run")
    assert [s["loss"] for s in got] == pytest.approx([s["loss"] for s in ref], rel=1e-6)
    assert [s["grad_norm"] for s in got] == pytest.approx([s["grad_norm"] for s in ref], rel=1e-5)
    census = json.loads((tmp_path / "run" / "summary.json").read_text())["memory"]["census_end"]
    one = json.loads((runs["llama"]["one"] / "summary.json").read_text())["memory"]["census_end"]
    assert census["frozen_weights_bytes"] == one["frozen_weights_bytes"]  # the one shard: every row
    plan = planner.plan(make_spec(tmp_path / "plan", *over, "mode=plan"), recommend=False)
    dev = plan["per_device"][0]
    assert dev["cpu_offload_host_bytes"] == (census["frozen_weights_bytes"] + 2 * census["trainable_weights_bytes"]
                                             + census["optimizer_state_bytes"])


def test_plan_on_a_gpu_moves_the_shards_to_the_host(tmp_path: Path) -> None:
    """Llama-2-70B QLoRA over 2 GPUs of 16 GiB: 'what do I need' takes FSDP with CPU offload (the
    layers split in one process peaks above 16 GiB), and the offloaded plan holds each rank's
    shards, gradients and Adam state on the host, computed here from the inventory."""
    import math

    from finetune import planner
    from finetune.backends.cuda import memory as mm

    over = ("mode=plan", "backend=cuda", "model=llama2-70b", "method=qlora", "backend.num_devices=2",
            "memory.budget=16GiB")
    p = planner.plan(make_spec(tmp_path, *over), recommend=False, needs=True)
    needs = p["needs"]
    assert needs["fits"] and needs["levers"] == ["cpu_offload"]
    assert needs["change"].startswith("backend.strategy=fsdp backend.cpu_offload=true")
    off = planner.plan(make_spec(tmp_path, *over, "backend.strategy=fsdp", "backend.cpu_offload=true",
                                 "train.batch_size=1", "train.grad_accum=4"), recommend=False)
    # the host RAM the needs name: the highest phase's (the whole 4-bit model at the load), the
    # checkpoint's mapped pages apart
    assert needs["host_bytes"] == max(ph["host_bytes"] - ph["host_file_bytes"] for ph in off["phases"].values())
    arch, s = planner.resolve(make_spec(tmp_path, *over, "backend.strategy=fsdp", "backend.cpu_offload=true"))
    held = mm.rank_tensors(planner.inventory(arch, s), s)
    shards = sum(mm.weight_bytes(t, s)[0] for t in held)
    trainable = sum(t.local_numel * t.dtype_bytes for t in held if t.trainable)
    adam = sum(2 * t.local_numel * t.dtype_bytes + 4 for t in held if t.trainable)
    assert off["per_device"][0]["cpu_offload_host_bytes"] == shards + trainable + adam
    steady = off["phases"]["steady"]
    assert steady["host_bytes"] - steady["host_offload_bytes"] == mm.HOST_BASE_CUDA_BYTES
    assert steady["host_offload_bytes"] == shards + trainable + adam
    # the device keeps the 4-bit constants, not the shards: its steady allocation is below them
    assert steady["allocated_bytes"] < shards
    assert math.isclose(off["quant_constants_bytes"], p["quant_constants_bytes"])


def test_governor_takes_cpu_offload_last_before_loading(tmp_path: Path) -> None:
    """Llama-2-70B QLoRA sharded over 2 GPUs with a 16 GiB budget: a smaller micro-batch,
    checkpointing and activation offload do not fit it (each rank's load alone holds its shards
    and one layer whole), so the governor's plan before loading takes CPU offload, says why, and
    the plan it fits is the offloaded one. Every rank runs this same function on the same spec,
    so every rank takes the same lever (the CPU cannot show it on a run: there the device is
    the host, and offload saves nothing)."""
    from finetune import planner

    spec = make_spec(tmp_path, "mode=plan", "backend=cuda", "model=llama2-70b", "method=qlora",
                     "backend.strategy=fsdp", "backend.num_devices=2", "train.batch_size=2", "train.grad_accum=2")
    budget = 16 * 2**30
    res = planner.fit_to_budget(spec, budget, suggest=False)
    assert res.fits and res.cpu_offload
    ev = res.events[-1]
    assert ev["action"] == "enable_cpu_offload" and "nothing cheaper fits" in ev["reason"]
    assert ev["after"]["peak_bytes"] == res.plan["fits_bytes"] <= budget < ev["before"]["peak_bytes"]
    assert ev["after"]["batch_size"] * ev["after"]["grad_accum"] == 4  # the same effective batch
    assert res.plan["per_device"][0]["cpu_offload_host_bytes"] > 0
