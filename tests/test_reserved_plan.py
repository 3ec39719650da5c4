"""Plans in the memory that runs out (issue 30): reserved, the device level and the host, for the
load, step 1 and the steady state, held against what was measured: the H200 records of
scripts/gpu_check.sh (tests/data/measured/h200_gpu_check.json), the RSS of a real 4-bit load on
this CPU, and the published parameter counts of PEFT's MetaMathQA runs."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from finetune.backends.cuda import trace
from finetune.backends.cuda.alloc_config import parse_alloc_conf
from finetune.backends import memory_model
from finetune.planner import plan
from finetune.model.source import local_model_dir
from finetune.planner.setup import inventory, resolve
from conftest import HAS_TORCH, REPO, finetune_cmd, make_spec
import warm_cli

H200 = json.loads((REPO / "tests" / "data" / "measured" / "h200_gpu_check.json").read_text())
METAMATH = json.loads((REPO / "tests" / "data" / "measured" / "peft_metamathqa.json").read_text())


def _cli_plan(tmp_path: Path, *overrides: str) -> dict:
    out = tmp_path / "plan"
    r = warm_cli.run([*finetune_cmd(), "mode=plan", *overrides, f"hydra.run.dir={out}"], capture_output=True,
                       text=True, cwd=tmp_path, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    return {"plan": json.loads((out / "plan.json").read_text()), "stdout": r.stdout}


@pytest.fixture(scope="module")
def h200_plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The two H200 runs planned as they ran: their command, torch's default allocator (as
    measured), capped at the widest micro-batch of their ten steps (the data's own first steps
    are replayed at their own widths)."""
    out = {}
    for optim in H200["runs"]:
        out[optim] = _cli_plan(tmp_path_factory.mktemp(optim), *H200["command"].split(), f"optim={optim}",
                               f"train.seq_len={H200['widest_of_the_ten_steps']}", "backend.alloc_conf=")
    return out


@pytest.mark.parametrize("optim", list(H200["runs"]))
def test_h200_reserved_and_nvml_within_10_percent(h200_plans: dict, optim: str) -> None:
    p, measured = h200_plans[optim]["plan"], H200["runs"][optim]
    steady = p["phases"]["steady"]
    assert abs(steady["reserved_bytes"] / measured["peak_reserved_bytes"] - 1) < 0.10, steady
    assert abs(p["max_device_level_bytes"] / measured["device_used_bytes"] - 1) < 0.10, p["max_device_level_bytes"]
    # the plan's reserved never below its allocated, in any phase
    assert all(ph["reserved_bytes"] >= ph["allocated_bytes"] for ph in p["phases"].values())
    assert "NVML used = reserved + CUDA context 524 MiB" in h200_plans[optim]["stdout"]


def test_h200_step2_leap_of_the_8bit_run(h200_plans: dict) -> None:
    """Step 2 reserves more than step 1 at the same phase while allocated barely moves: the
    8-bit state created at step 1's end took blocks the activations had cached."""
    planned = h200_plans["adamw_8bit"]["plan"]["step2_reserved_leap_bytes"]
    measured = H200["runs"]["adamw_8bit"]["step2_reserved_leap_bytes"]
    assert planned > 0 and abs(planned / measured - 1) < 0.25, (planned, measured)


def test_h200_step_peaks_of_allocated(h200_plans: dict, tmp_path: Path) -> None:
    """The step peaks of allocated the H200 runs printed, from the replay at the data's own
    first widths (plan.json data.step_widths, its head fraction): autograd releases each op's
    saved tensors once its backward has run, so a layer's MLP gradients take the blocks its own
    activations free (trace.py's backward; allocating them all first put the paged run's step 1
    at 1041 MiB and the 8-bit run's step 2 71 MiB over its step 1)."""
    def steps(optim: str) -> dict[int, int]:
        data = h200_plans[optim]["plan"]["data"]
        spec = make_spec(tmp_path, "mode=plan", *H200["command"].split(), f"optim={optim}", "backend.alloc_conf=")
        _, figs = _replay(spec, steps=2, resolve_args=(H200["widest_of_the_ten_steps"], None, data["head_fraction"]),
                          step_widths=tuple(data["step_widths"]))
        return {k: max(f.peak_allocated for n, f in figs.items() if n.startswith(f"step{k}:")) for k in (1, 2)}

    paged, measured = steps("paged_adamw_8bit"), H200["runs"]["paged_adamw_8bit"]["step_peak_allocated_bytes"]
    for k in (1, 2):  # printed in MiB to 4 digits
        assert abs(paged[k] / measured[str(k)] - 1) < 0.005, (k, paged[k], measured[str(k)])
    eight, m8 = steps("adamw_8bit"), H200["runs"]["adamw_8bit"]
    assert abs(eight[1] / m8["step_peak_allocated_bytes"]["1"] - 1) < 0.005, eight
    # printed +5.03 MiB: the step-2 activations beside the 8-bit state, less the step-1 optimizer's peak
    assert abs((eight[2] - eight[1]) - m8["step2_over_step1_peak_allocated_bytes"]) < 2**20, eight


@pytest.mark.xfail(strict=True, reason="known miss: the runs' printed figures put step 1's forward end at 941-950 MiB "
                   "reserved (paged: 72 MiB at the backward is the largest of the three phases' leaps, so step 1 grew at most "
                   "72 MiB after its forward, and its backward reached the step peak of 1013 MiB; 8-bit: its step-2 forward, "
                   "478 MiB over step 1's, is within the run's 1.39 GiB); the replay ends step 1's forward at 856 MiB (835 "
                   "allocated), so its backward takes ~200 MiB of new segments for the fp32 gradients and it plans a ~250 MiB "
                   "leap at the forward. What the real forward holds or caches beyond the replay (~90 MiB) needs a per-phase "
                   "timeline on a GPU (the paged state itself is outside the allocator in both the run and the plan)")
def test_h200_step2_leap_of_the_paged_run(h200_plans: dict) -> None:
    planned = h200_plans["paged_adamw_8bit"]["plan"]["step2_reserved_leap_bytes"]
    measured = H200["runs"]["paged_adamw_8bit"]["step2_reserved_leap_bytes"]
    assert abs(planned / measured - 1) < 0.25, (planned, measured)


def test_paged_state_is_on_the_device_level_not_in_reserved(h200_plans: dict) -> None:
    """bitsandbytes' paged state: NVML counts it, the allocator does not; both runs end at the
    same NVML figure on the H200 (2.13 GiB), and so does the plan within 5%."""
    eight, paged = (h200_plans[o]["plan"] for o in ("adamw_8bit", "paged_adamw_8bit"))
    assert paged["per_device"][0]["non_allocator"]["paged_optimizer_state"] == paged["bytes"]["optimizer_state_paged"] > 0
    assert paged["phases"]["steady"]["reserved_bytes"] < eight["phases"]["steady"]["reserved_bytes"]
    assert abs(paged["max_device_level_bytes"] / eight["max_device_level_bytes"] - 1) < 0.05


def _replay(spec, steps: int = 3, loop: dict | None = None, resolve_args: tuple = (), **changes):
    """The run's allocations replayed: ``loop``, trace.build's options for a loop other than
    ours; ``resolve_args``, the planner's (seq_len, state, head_fraction) from the data;
    ``changes``, Setup fields changed."""
    arch, s = resolve(spec, *resolve_args)
    for k, v in changes.items():
        setattr(s, k, v)
    mm = memory_model("cuda")
    tensors = inventory(arch, s)
    held = mm.rank_tensors(tensors, s)
    order = ["embed"] + [f"layer.{i}" for i in range(arch.layers)] + ["head"]
    tr = trace.build(arch, s, held, mm, {m: 0 for m in order}, 0, mm.collective_buffers(tensors, s), steps=steps,
                     empty_cache_every=s.empty_cache_every, **(loop or {}))
    return tr, trace.replay(tr, parse_alloc_conf(s.alloc_conf))


@pytest.mark.parametrize("overrides", [
    ("model=llama3.2-3b", "method=full"), ("model=llama3.2-3b",), ("model=qwen3-30b-a3b", "train.seq_len=512"),
    ("model=gemma3-12b", "train.grad_checkpointing=true"), ("model=phi-4", "method=dora"),
    ("model=llama3.1-8b", "method=qlora", "train.grad_accum=3")])
def test_replay_reserved_never_below_allocated(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    """Every family's replayed step (dense, MoE, soft-capped local/global, fused projections,
    4-bit) allocates and frees every tensor it creates, and the allocator's reserve covers what
    is live at every phase."""
    spec = make_spec(tmp_path, "mode=plan", "backend=cuda", *overrides)
    tr, figs = _replay(spec)
    allocs = {k for op, k, _ in tr.events if op == "alloc"}
    frees = [k for op, k, _ in tr.events if op == "free"]
    assert len(frees) == len(set(frees)) and set(frees) <= allocs
    for name, f in figs.items():
        assert f.peak_reserved >= f.peak_allocated > 0 and f.end_reserved >= f.end_allocated, name
    # what stays allocated after a step is the weights, the optimizer state and the workspaces
    assert figs["step2:optimizer"].end_allocated == figs["step3:optimizer"].end_allocated


def test_empty_cache_every_step_lowers_the_steady_reserve(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "mode=plan", "backend=cuda", "model=llama3.2-3b", "method=full", "train.seq_len=512",
                     "backend.alloc_conf=")
    kept = _replay(spec)[1]["step3:forward"].peak_reserved
    emptied = _replay(spec, empty_cache_every=1)[1]["step3:forward"].peak_reserved
    assert emptied < kept


def test_a_bad_alloc_conf_is_one_line(tmp_path: Path) -> None:
    r = warm_cli.run([*finetune_cmd(), "mode=plan", "backend=cuda", "backend.alloc_conf=expandable:yes",
                        f"hydra.run.dir={tmp_path / 'r'}"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "backend.alloc_conf" in lines[0] and "expandable_segments" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "r" / "plan.json").exists()


def test_expandable_segments_is_the_default_and_a_lever(tmp_path: Path) -> None:
    dflt = plan(make_spec(tmp_path, "mode=plan", "backend=cuda", "model=llama2-7b", "method=full",
                          "optim=adamw_8bit"), recommend=False)
    assert dflt["alloc_conf"] == "expandable_segments:True"
    off = plan(make_spec(tmp_path, "mode=plan", "backend=cuda", "model=llama2-7b", "method=full", "optim=adamw_8bit",
                         "backend.alloc_conf=", "train.batch_size=1", "train.grad_checkpointing=true"),
               budget_bytes=None, recommend=False)
    assert dflt["phases"]["steady"]["reserved_bytes"] <= plan(make_spec(
        tmp_path, "mode=plan", "backend=cuda", "model=llama2-7b", "method=full", "optim=adamw_8bit",
        "backend.alloc_conf="), recommend=False)["phases"]["steady"]["reserved_bytes"]
    # a budget between the expandable and the default allocator's device level: the lever names it
    on = plan(make_spec(tmp_path, "mode=plan", "backend=cuda", "model=llama2-7b", "method=full", "optim=adamw_8bit",
                        "train.batch_size=1", "train.grad_checkpointing=true"), recommend=False)
    assert on["fits_bytes"] < off["fits_bytes"]
    budget = (on["fits_bytes"] + off["fits_bytes"]) // 2
    p = plan(make_spec(tmp_path, "mode=plan", "backend=cuda", "model=llama2-7b", "method=full", "optim=adamw_8bit",
                       "backend.alloc_conf=", "train.batch_size=1", "train.grad_checkpointing=true",
                       f"memory.budget={budget}"))
    assert not p["fits"]
    assert "backend.alloc_conf=expandable_segments:True" in [lv["change"] for lv in p["recommendation"]["levers"]]


@pytest.mark.parametrize("run", list(METAMATH["runs"]))
def test_metamathqa_runs_planned_to_the_published_parameter(tmp_path: Path, run: str) -> None:
    """PEFT's MetaMathQA runs of Llama-3.2-3B, written as our command lines: the plan's
    parameter count is the published ``num_total_params`` to the parameter (LoRA r32 and r64,
    DoRA r32, full), and every phase is planned."""
    r = METAMATH["runs"][run]
    p = plan(make_spec(tmp_path, "mode=plan", *r["command"].split()), recommend=False)
    assert p["params_total"] == r["num_total_params"]
    assert p["params_trainable"] == r["num_trainable_params"]
    assert set(p["phases"]) == {"load", "step1", "steady"}


@pytest.mark.skipif(not HAS_TORCH or not Path("/proc/self/status").exists(), reason="torch is not installed, or no /proc")
def test_qlora_load_host_peak_within_10_percent(tmp_path: Path) -> None:
    """A real 4-bit load on this CPU (bitsandbytes NF4, the run's own CudaBackend.setup): the
    process's peak RSS through the load against the plan's host figure for the load."""
    args = ["backend=cuda", "backend.device=cpu", "method=qlora", "model.config.hidden_size=1024", "model.config.num_hidden_layers=8",
            "model.config.num_attention_heads=16", "model.config.num_key_value_heads=4", "model.config.intermediate_size=4096"]
    script = textwrap.dedent(f"""
        import json, sys
        from finetune.config import compose
        from finetune.resolver import resolve
        from finetune.model.source import local_model_dir
        from finetune.backends.runtimes import get_backend
        spec = resolve(compose({str(tmp_path / 'run')!r}, *{args!r}))
        b = get_backend("cuda")
        b.connect(spec)
        b.setup(spec, local_model_dir(spec.model, seed=0))
        # VmHWM, this process image's own peak RSS: getrusage's ru_maxrss keeps the forking
        # parent's peak across exec (Linux keeps signal->maxrss), a pytest worker's here
        hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
        print(json.dumps({{"maxrss": int(hwm.split()[1]) * 1024}}))
    """)
    # the tiny model built once, before the measured process (its build is not the load)
    spec = make_spec(tmp_path, "mode=plan", *args)
    local_model_dir(spec.model, seed=0)
    p = plan(spec, recommend=False)
    r = warm_cli.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    measured = json.loads(r.stdout.strip().splitlines()[-1])["maxrss"]
    planned = p["phases"]["load"]["host_bytes"]
    assert abs(planned / measured - 1) < 0.10, (planned, measured)


# PEFT's run.py loop (tests/data/measured/peft_metamathqa.json "their_loop"): zero_grad before the
# forward, the model's output (bf16 logits of every position, the KV cache) held until the next
# forward returns, right-padded batches with a mask
THEIR_LOOP = {"zero_grad_first": True, "outputs_kept": True}


def _their_step(spec, width: int) -> tuple[int, int]:
    """(reserved peak, allocated at the end) of the steady step (after an emptied cache)."""
    _, figs = _replay(spec, loop=THEIR_LOOP, seq_len=width, step_widths=(), padding_mask=True)
    return max(f.peak_reserved for k, f in figs.items() if k.startswith("step3:")), figs["step3:optimizer"].end_allocated


@pytest.mark.parametrize("run", list(METAMATH["runs"]))
def test_metamathqa_their_loop_within_10_percent(tmp_path: Path, run: str) -> None:
    """PEFT's MetaMathQA runs replayed with their loop: the steady step's reserved peak within
    10% of the published 99th percentile of the steps' reserved, at both ends of the widths the
    p99 step can have (unpublished: one step in 20 is padded to the longest of 80 samples, so the
    p99 step is at about the 99.7th percentile sample, just under the 1,300-character cap: 400 to
    540 tokens if the tokenizer gives 3.3 to 2.5 characters a token on this text, an assumption:
    neither the data nor Llama-3's tokenizer is on this machine; benchmarks/results/
    plan_vs_metamathqa.txt prints the whole range). And their published mean allocated after a step (a figure of the
    same runs that no reserved model enters) within 2% at the mean sample's width: the logits
    and KV cache their loop keeps are 0.33 GB of LoRA's 6.9 GB."""
    r = METAMATH["runs"][run]
    spec = make_spec(tmp_path, "mode=plan", *r["command"].split())
    for width in (400, 540):
        reserved, _ = _their_step(spec, width)
        assert abs(reserved / r["reserved_99th_bytes"] - 1) < 0.10, (width, reserved, r["reserved_99th_bytes"])
    _, end = _their_step(spec, round(METAMATH["mean_sample_tokens"]))
    assert abs(end / r["allocated_after_step_avg_bytes"] - 1) < 0.02, (end, r["allocated_after_step_avg_bytes"])


def test_their_loop_keeps_gradients_and_outputs_past_the_step(tmp_path: Path) -> None:
    """zero_grad before the forward: a full fine-tune's gradients are still allocated after the
    optimizer step and through empty_cache; outputs_kept adds the logits and KV cache there."""
    spec = make_spec(tmp_path, "mode=plan", "backend=cuda", "model=llama3.2-3b", "method=full", "train.seq_len=256",
                     "memory.empty_cache_every=1", "backend.alloc_conf=")
    _, ours = _replay(spec)
    _, zg = _replay(spec, loop={"zero_grad_first": True})
    _, both = _replay(spec, loop=THEIR_LOOP)
    # Llama-3.2-3B's parameters in bf16 (a block the allocator did not split counts whole: a
    # remainder of at most 1 MiB a gradient)
    grads = 3212749824 * 2
    assert 0 <= zg["step3:optimizer"].end_allocated - ours["step3:optimizer"].end_allocated - grads < grads * 1e-3
    logits = 4 * 256 * 128256 * 2  # [B, T, V] bf16, B=4
    kept = both["step3:optimizer"].end_allocated - zg["step3:optimizer"].end_allocated
    assert logits < kept < logits * 2, kept
