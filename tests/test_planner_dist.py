"""The planner for several processes (issue 11): per-rank plans for DDP and FSDP on cuda and
data parallel on mlx, from real planner calls. Expected figures are computed here from the
model's own inventory (planner.inventory) with the sharding rule FSDP2 uses (ceil(dim0 / N)
rows per rank, dim 0 padded to a multiple of N for gathers and reduce-scatters), never typed in.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from finetune.resolver import resolve
from conftest import REPO, make_cfg, make_spec, needs_torch
import warm_cli

from finetune import planner
from finetune.errors import UserError
from finetune.planner import DDP_BUCKET_BYTES
from finetune.planner.setup import DTYPE_BYTES, GRAD_ACTIVATION_OVERLAP

GiB = 2**30
SEVEN_B = ("mode=plan", "model=llama2-7b", "method=full", "backend=cuda")


def _plan(tmp_path: Path, *over: str) -> dict:
    return planner.plan(make_spec(tmp_path, *over), recommend=False)


def _local(t: planner.Tensor, n: int) -> int:
    """Elements one rank holds of ``t``: ceil(rows / n) rows."""
    return -(-t.shape[0] // n) * math.prod(t.shape[1:])


def _padded(t: planner.Tensor, n: int) -> int:
    return -(-t.shape[0] // n) * n * math.prod(t.shape[1:])


def _units(tensors: list[planner.Tensor]) -> dict:
    units: dict = {}
    for t in tensors:
        units.setdefault(t.layer, []).append(t)
    return units


def _expected_fsdp(tmp_path: Path, n: int, *over: str) -> dict:
    """Per-rank state and FSDP buffers of the config, from its inventory."""
    arch, s = planner.resolve(make_spec(tmp_path, *over))
    inv = planner.inventory(arch, s)
    trainable = [t for t in inv if t.trainable]
    units = _units(inv)
    # the runtime's MixedPrecisionPolicy: gathered (and differentiated) in the autocast dtype and
    # reduced in fp32 under autocast; otherwise every parameter in its own dtype
    def unsharded(t: planner.Tensor) -> int:
        return DTYPE_BYTES[s.compute_dtype] if s.autocast else t.dtype_bytes

    def reduced(t: planner.Tensor) -> int:
        return 4 if s.autocast else t.dtype_bytes

    layer_gather = max(sum(_padded(t, n) * unsharded(t) for t in ts) for k, ts in units.items() if k is not None)
    root_gather = sum(_padded(t, n) * unsharded(t) for t in units[None])
    out = {
        "weights": sum(_local(t, n) * t.dtype_bytes for t in inv),
        "grads": sum(_local(t, n) * t.dtype_bytes for t in trainable),
        "optimizer_state": 2 * sum(_local(t, n) * t.dtype_bytes for t in trainable),  # adamw: exp_avg, exp_avg_sq
        "all_gather": root_gather + 2 * layer_gather,
        "unsharded_grads": max(sum(t.numel * unsharded(t) for t in ts if t.trainable) for ts in units.values()),
        "reduce_scatter": max(sum(_padded(t, n) * reduced(t) for t in ts if t.trainable) for ts in units.values()),
    }
    buffers = ["all_gather", "unsharded_grads", "reduce_scatter"]
    if s.device != "cuda":
        # gloo's copies (a plan without a GPU, on this box too): the all-gather's flat temporary
        # of the unit it gathers beside the all_gather buffer, the reduce-scatter's input cloned
        out["gloo_all_gather_flat"] = max(layer_gather, root_gather - 2 * layer_gather)
        out["gloo_reduce_scatter_copy"] = out["reduce_scatter"]
        buffers += ["gloo_all_gather_flat", "gloo_reduce_scatter_copy"]
    out["buffers"] = {k: out[k] for k in buffers}
    return out


def _peak_allocated(tmp_path: Path, p: dict, *over: str) -> int:
    """The per-rank peak rebuilt from the plan's own categories and named buffers: weights +
    state + rounding + the larger phase (forward/backward with the forward/backward buffers;
    the step's workspace; the gradient sum's bucket)."""
    _, s = planner.resolve(make_spec(tmp_path, *over))
    b = p["bytes"]
    W, S, G = b["weights"], b["optimizer_state"], b["grads"]
    bufs = p["collective_buffers"]

    def extra(phase: str) -> int:
        return sum(v["bytes"] for v in bufs.values() if v["phase"] == phase)

    fb = planner.memory_model(s.backend).grads_during_forward_backward(
        s, b["activations"] + b["logits"], G, GRAD_ACTIVATION_OVERLAP)
    phases = [fb + extra("forward_backward"), G + p["optimizer_step_workspace_bytes"] + extra("optimizer_step")]
    if extra("grad_sync"):
        phases.append(G + extra("grad_sync"))
    return W + S + p["per_device"][0]["overhead_detail"]["allocator_rounding_512B"] + max(phases)


def _state(p: dict) -> int:
    b = p["bytes"]
    return b["weights"] + b["grads"] + b["optimizer_state"]


# ---- fsdp ---------------------------------------------------------------------------------------

def test_fsdp_7b_over_8_ranks_holds_an_eighth_plus_the_largest_units_buffers(tmp_path: Path) -> None:
    fsdp_over = (*SEVEN_B, "backend.strategy=fsdp", "backend.num_devices=8")
    fsdp = _plan(tmp_path, *fsdp_over)
    ddp = _plan(tmp_path, *SEVEN_B, "backend.num_devices=8")
    want = _expected_fsdp(tmp_path, 8, *fsdp_over)
    for k in ("weights", "grads", "optimizer_state"):
        assert fsdp["bytes"][k] == want[k], k
    # Llama-2-7B's first dims (4096, 11008, 32000) all divide by 8: exactly an eighth, no padding
    assert 8 * _state(fsdp) == _state(ddp)
    assert {k: v["bytes"] for k, v in fsdp["collective_buffers"].items()} == want["buffers"]
    # one rank's micro-batch: activations and logits as the replicated plan's
    assert fsdp["bytes"]["activations"] == ddp["bytes"]["activations"]
    assert fsdp["bytes"]["logits"] == ddp["bytes"]["logits"]
    # the peak is the sharded state + activations + the named buffers, nothing unnamed
    assert fsdp["peak_allocated_bytes"] == _peak_allocated(tmp_path, fsdp, *fsdp_over)
    assert fsdp["peak_phase"] == "forward_backward"
    # per rank: plan.json's peak is a rank's (memory.budget is per GPU)
    pr = fsdp["per_rank"]
    assert pr["strategy"] == "fsdp" and pr["world_size"] == 8 and pr["ranks_identical"] is True
    assert [r["rank"] for r in pr["ranks"]] == list(range(8))
    assert all(r["peak_bytes"] == fsdp["peak_bytes"] == fsdp["max_device_peak_bytes"] for r in pr["ranks"])
    assert pr["ranks"][0]["buffers"] == want["buffers"]
    assert pr["overall"]["peak_bytes"] == 8 * fsdp["peak_bytes"]
    assert pr["overall"]["weights"] == ddp["bytes"]["weights"]


def test_fsdp_uneven_shards_round_up_per_parameter(tmp_path: Path) -> None:
    over = ("backend=cuda", "backend.device=cuda", "method=full", "backend.strategy=fsdp", "backend.num_devices=3")
    p = _plan(tmp_path, *over)
    want = _expected_fsdp(tmp_path, 3, *over)
    for k in ("weights", "grads", "optimizer_state"):
        assert p["bytes"][k] == want[k], k
    one = _plan(tmp_path, "backend=cuda", "backend.device=cuda", "method=full")
    assert 3 * p["bytes"]["weights"] > one["bytes"]["weights"]  # tiny's 64-wide dims do not divide by 3
    assert {k: v["bytes"] for k, v in p["collective_buffers"].items()} == want["buffers"]
    assert p["peak_allocated_bytes"] == _peak_allocated(tmp_path, p, *over)


def test_fsdp_lora_shards_the_frozen_base_too(tmp_path: Path) -> None:
    over = (*SEVEN_B[:2], "backend=cuda", "method=lora", "backend.strategy=fsdp", "backend.num_devices=4")
    p = _plan(tmp_path, *over)
    want = _expected_fsdp(tmp_path, 4, *over)
    one = _plan(tmp_path, *SEVEN_B[:2], "backend=cuda", "method=lora")
    assert p["bytes"]["weights"] == want["weights"] and 4 * p["bytes"]["weights"] == one["bytes"]["weights"]
    assert p["bytes"]["grads"] == want["grads"] and 4 * p["bytes"]["grads"] == one["bytes"]["grads"]
    assert p["bytes"]["optimizer_state"] == want["optimizer_state"]
    bufs = {k: v["bytes"] for k, v in p["collective_buffers"].items()}
    assert bufs == want["buffers"]
    # fp32 adapters (PEFT's autocast_adapter_dtype) gathered and reduced in fp32; r=8 and 4096 divide by 4
    assert bufs["reduce_scatter"] == bufs["unsharded_grads"] > 0
    assert p["peak_allocated_bytes"] == _peak_allocated(tmp_path, p, *over)


def test_fsdp_under_autocast_gathers_in_bf16_and_reduces_in_fp32(tmp_path: Path) -> None:
    over = ("backend=cuda", "backend.device=cuda", "method=full", "precision=bf16-mixed", "backend.strategy=fsdp",
            "backend.num_devices=2")
    p = _plan(tmp_path, *over)
    want = _expected_fsdp(tmp_path, 2, *over)
    assert {k: v["bytes"] for k, v in p["collective_buffers"].items()} == want["buffers"]
    arch, s = planner.resolve(make_spec(tmp_path, *over))
    inv = planner.inventory(arch, s)
    assert s.weight_dtype == "float32" and s.compute_dtype == "bfloat16"
    layer = max(sum(t.numel for t in inv if t.layer == i) for i in range(arch.layers))
    root = sum(t.numel for t in inv if t.layer is None)
    assert p["collective_buffers"]["all_gather"]["bytes"] == 2 * (root + 2 * layer)  # tiny's dims divide by 2
    bufs = p["collective_buffers"]
    assert bufs["reduce_scatter"]["bytes"] == 2 * bufs["unsharded_grads"]["bytes"]
    assert p["peak_allocated_bytes"] == _peak_allocated(tmp_path, p, *over)


_FSDP_WORKER = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config

m, out = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(Qwen2Config(
    hidden_size=m["hidden_size"], num_hidden_layers=m["num_hidden_layers"], num_attention_heads=m["num_attention_heads"],
    num_key_value_heads=m["num_key_value_heads"], intermediate_size=m["intermediate_size"], vocab_size=m["vocab_size"],
    tie_word_embeddings=m["tie_word_embeddings"]))
for layer in model.model.layers:
    fully_shard(layer)  # a unit per decoder layer, then the root, as the runtime wraps them
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, m["vocab_size"], (2, 16))
model(input_ids=ids, labels=ids).loss.backward()
opt.step()
storages = lambda ts: sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())
params = list(model.parameters())
figures = {
    "rank": dist.get_rank(),
    "weights": storages([p._local_tensor for p in params]),
    "grads": storages([p.grad._local_tensor for p in params]),
    "optimizer_state": sum(v._local_tensor.numel() * v._local_tensor.element_size()
                           for st in opt.state.values() for k, v in st.items() if k != "step")}
with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:  # a file each: the ranks' stdout lines interleave
    json.dump(figures, f)
dist.destroy_process_group()
"""


@needs_torch
def test_fsdp_shards_match_torch_fully_shard(tmp_path: Path) -> None:
    """Three gloo ranks of the tiny model under FSDP2 fully_shard: every rank's parameter and
    gradient storage is the plan's per-rank figure (padded to rank 0's shard), rank 0's Adam
    state is the plan's and no rank holds more."""
    over = ("backend=cuda", "backend.device=cuda", "method=full", "precision=32-true", "backend.strategy=fsdp",
            "backend.num_devices=3")
    p = _plan(tmp_path, *over)
    m = make_cfg(tmp_path, *over).model.config
    model = {k: m[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                               "intermediate_size", "vocab_size", "tie_word_embeddings")}
    worker = tmp_path / "fsdp_worker.py"
    worker.write_text(_FSDP_WORKER)
    r = warm_cli.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        str(worker), json.dumps(model), str(tmp_path)], capture_output=True, text=True, timeout=300, check=False,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(3)]
    assert [d["rank"] for d in ranks] == [0, 1, 2]
    assert all(d["weights"] == p["bytes"]["weights"] and d["grads"] == p["bytes"]["grads"] for d in ranks)
    assert ranks[0]["optimizer_state"] == p["bytes"]["optimizer_state"]
    assert all(d["optimizer_state"] <= p["bytes"]["optimizer_state"] for d in ranks)


# ---- ddp ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["full", "lora"])
def test_ddp_over_4_ranks_is_the_one_process_plan_plus_the_bucket(tmp_path: Path, method: str) -> None:
    base = (*SEVEN_B[:2], "backend=cuda", f"method={method}")
    one = _plan(tmp_path, *base)
    four = _plan(tmp_path, *base, "backend.num_devices=4")
    assert four["bytes"] == one["bytes"] and four["devices"] == 1 and four["world_size"] == 4
    arch, s = planner.resolve(make_spec(tmp_path, *base))
    grads = [t.numel * t.dtype_bytes for t in planner.inventory(arch, s) if t.trainable]  # one dtype here
    bucket = four["collective_buffers"]["ddp_bucket"]["bytes"]
    assert four["collective_buffers"] == {"ddp_bucket": {"bytes": bucket, "phase": "grad_sync"}}
    if method == "lora":
        assert bucket == sum(grads) == one["bytes"]["grads"] < DDP_BUCKET_BYTES  # the adapters fit one bucket
    else:
        # gradients above the bucket (the embedding's) are summed in place; the rest are packed
        small = [g for g in grads if g <= DDP_BUCKET_BYTES]
        assert max(grads) > DDP_BUCKET_BYTES and max(small) <= bucket <= DDP_BUCKET_BYTES
    # the gradient sum is its own moment: weights + state + grads + one bucket
    sync = one["steady_state_allocated_bytes"] + one["bytes"]["grads"] + bucket \
        + one["per_device"][0]["overhead_detail"]["allocator_rounding_512B"]
    assert four["peak_allocated_bytes"] == max(one["peak_allocated_bytes"], sync)
    assert four["peak_allocated_bytes"] == _peak_allocated(tmp_path, four, *base, "backend.num_devices=4")
    pr = four["per_rank"]
    assert pr["strategy"] == "ddp" and len(pr["ranks"]) == 4
    assert pr["overall"]["optimizer_state"] == 4 * one["bytes"]["optimizer_state"]
    assert pr["overall"]["buffers"] == {"ddp_bucket": 4 * bucket}


def test_one_process_and_device_map_split_have_no_ranks(tmp_path: Path) -> None:
    one = _plan(tmp_path, *SEVEN_B)
    assert one["world_size"] == 1 and one["per_rank"] is None and one["collective_buffers"] == {}
    split = _plan(tmp_path, *SEVEN_B, "backend.device_map=auto", "backend.num_devices=2")
    assert split["devices"] == 2 and split["world_size"] == 1 and split["per_rank"] is None
    assert sum(d["bytes"]["weights"] for d in split["per_device"]) == one["bytes"]["weights"]


def test_fit_to_budget_works_per_rank(tmp_path: Path) -> None:
    fsdp = _plan(tmp_path, *SEVEN_B, "backend.strategy=fsdp", "backend.num_devices=8")
    ddp = _plan(tmp_path, *SEVEN_B, "backend.num_devices=8")
    budget = (fsdp["peak_bytes"] + ddp["peak_bytes"]) // 2  # a rank fits under fsdp only
    res = planner.fit_to_budget(make_spec(tmp_path, *SEVEN_B, "backend.strategy=fsdp", "backend.num_devices=8"),
                                budget)
    assert res.fits and res.events == [] and res.plan["peak_bytes"] == fsdp["peak_bytes"]
    p = planner.plan(make_spec(tmp_path, *SEVEN_B, "backend.strategy=fsdp", "backend.num_devices=8",
                              "train.batch_size=64", f"memory.budget={budget}"))
    # levers never offer what the runtime refuses under fsdp (8-bit optimizers); 4-bit weights
    # shard (FSDP-QLoRA), so method=qlora is one
    levers = [lv["change"] for lv in (p["recommendation"] or {}).get("levers", [])]
    assert not any(c.startswith("optim=") for c in levers)
    assert any(c.startswith("method=qlora") for c in levers)


# ---- refusals -----------------------------------------------------------------------------------

def test_fsdp_refuses_device_map_auto_and_unshardable_optimizers(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="drop backend.device_map=auto") as e:
        _plan(tmp_path, *SEVEN_B, "backend.strategy=fsdp", "backend.device_map=auto", "backend.num_devices=2")
    assert "\n" not in str(e.value)
    for optim in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw", "adafactor"):
        with pytest.raises(UserError, match=f"optim={optim} is not supported under backend.strategy=fsdp"):
            _plan(tmp_path, *SEVEN_B, "backend.strategy=fsdp", "backend.num_devices=2", f"optim={optim}")
        assert _plan(tmp_path, *SEVEN_B, "backend.num_devices=2", f"optim={optim}")["per_rank"]  # ddp takes it
    for optim in ("adamw", "adam", "sgd"):
        assert _plan(tmp_path, *SEVEN_B, "backend.strategy=fsdp", "backend.num_devices=2", f"optim={optim}")["per_rank"]
    # qlora shards too: its 4-bit weights are stored in a float dtype FSDP2 splits (tests/test_fsdp_qlora.py)
    assert _plan(tmp_path, *SEVEN_B[:2], "backend=cuda", "method=qlora", "backend.strategy=fsdp",
                 "backend.num_devices=2")["per_rank"]
    # one process shards nothing: the strategy's refusals wait for several ranks
    assert _plan(tmp_path, *SEVEN_B, "backend.strategy=fsdp", "optim=adamw_8bit")["per_rank"] is None
    with pytest.raises(UserError, match="backend.strategy=fsdp"):
        _plan(tmp_path, "backend=mlx", "backend.strategy=fsdp", "backend.num_devices=2")


# ---- mlx ----------------------------------------------------------------------------------------

def test_mlx_ranks_replicate_and_hold_one_summed_gradient_tree(tmp_path: Path) -> None:
    one = _plan(tmp_path, "backend=mlx", "method=full")
    two = _plan(tmp_path, "backend=mlx", "method=full", "backend.num_devices=2")
    assert two["bytes"] == one["bytes"] and two["world_size"] == 2 and two["strategy"] == "ddp"
    arch, s = planner.resolve(make_spec(tmp_path, "backend=mlx", "method=full"))
    tree = sum(t.numel * t.dtype_bytes for t in planner.inventory(arch, s) if t.trainable)
    assert tree == one["bytes"]["grads"]
    assert two["collective_buffers"] == {"all_sum_output": {"bytes": tree, "phase": "optimizer_step"}}
    assert two["peak_allocated_bytes"] == _peak_allocated(tmp_path, two, "backend=mlx", "method=full",
                                                          "backend.num_devices=2")
    assert [r["rank"] for r in two["per_rank"]["ranks"]] == [0, 1]


# ---- the CLI ------------------------------------------------------------------------------------

def test_plan_cli_prints_a_row_per_rank_then_overall(tmp_path: Path) -> None:
    r = warm_cli.run([sys.executable, "-m", "finetune", *SEVEN_B, "backend.strategy=fsdp", "backend.num_devices=8",
                        "memory.budget=80GiB", f"hydra.run.dir={tmp_path / 'plan'}"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "(cuda, fsdp over 8 ranks)" in out and "GiB per rank" in out
    rows = [ln.split()[1] for ln in out.splitlines() if ln.strip().startswith("rank ")]
    assert rows == [str(i) for i in range(8)]
    assert "Overall" in out and "ranks are identical under fsdp" in out
    assert "buffer: all_gather" in out and "buffer: reduce_scatter" in out
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    pr = plan["per_rank"]
    assert pr["world_size"] == 8 and pr["strategy"] == "fsdp" and len(pr["ranks"]) == 8
    assert plan["peak_bytes"] == pr["ranks"][0]["peak_bytes"] and plan["budget_bytes"] == 80 * GiB
    assert plan["fits"] is True and pr["overall"]["peak_bytes"] == 8 * plan["peak_bytes"]
    assert all(isinstance(v, int) for row in pr["ranks"] for k, v in row.items() if k not in ("buffers", "phases"))
    assert all(row["phases"] == plan["phases"] for row in pr["ranks"])


@pytest.mark.parametrize("model", ["tiny", "qwen2-0.5b"])  # a layer's gather the largest; the root's (its vocabulary)
def test_fsdp_on_the_cpu_prices_gloos_copies_of_the_units_it_moves(tmp_path: Path, model: str) -> None:
    """Without a GPU the ranks' collectives are gloo's, which copy where NCCL works in place: the
    all-gather's flat temporary of the unit it gathers (a layer's, or at the root's own gather,
    before any layer's is alive, what the root holds beyond two layers' buffers) and the
    reduce-scatter's clone of its input. Each is priced at its unit's bytes, beside the buffers
    a GPU plan has; a GPU plan has no such rows."""
    over = (f"model={model}", "backend=cuda", "backend.device=cpu", "method=full", "backend.strategy=fsdp",
            "backend.num_devices=2")
    p = _plan(tmp_path, *over)
    want = _expected_fsdp(tmp_path, 2, *over)
    bufs = {k: v["bytes"] for k, v in p["collective_buffers"].items()}
    assert bufs == want["buffers"] and bufs["gloo_all_gather_flat"] > 0 and bufs["gloo_reduce_scatter_copy"] > 0
    gpu = _plan(tmp_path, *("backend.device=cuda" if o == "backend.device=cpu" else o for o in over))
    assert not any(k.startswith("gloo") for k in gpu["collective_buffers"])
