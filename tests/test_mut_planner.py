"""The planner's verdicts on their edges: a budget exactly the planned peak fits (one byte
less does not). Written for survivors of the
mutation run (benchmarks/mutation/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.config import compose
from finetune.planner import plan
from finetune.planner.fit import fit_to_budget
from finetune.resolver import resolve


def test_a_budget_equal_to_the_planned_peak_fits(tmp_path: Path) -> None:
    cfg = compose(tmp_path / "run", "backend=cuda", "train.batch_size=4", "train.grad_accum=1")
    peak = plan(resolve(cfg), recommend=False)["max_device_peak_bytes"]
    exact = fit_to_budget(resolve(cfg), peak)
    assert (exact.fits, exact.batch_size, exact.grad_accum, exact.events) == (True, 4, 1, [])
    below = fit_to_budget(resolve(cfg), peak - 1)
    assert below.fits and below.events, "one byte under the peak must change the run"
    assert below.batch_size * below.grad_accum == 4



def test_the_plan_table_prints_gib_of_2_30_bytes(tmp_path: Path) -> None:
    from finetune.planner import format_table

    p = plan(resolve(compose(tmp_path / "run", "backend=cuda", "memory.budget=2GiB")), recommend=False)
    text = format_table(p)
    head = text.splitlines()[0]
    assert f"peak {p['max_device_peak_bytes'] / 2**30:.2f} GiB per device vs budget 2.00 GiB" in head
    w = p["bytes"]["weights"]
    assert f"  {'weights':32s}{w / 2**30:9.3f} {w:16,d}" in text.splitlines()


def test_a_cuda_plan_without_a_budget_asks_for_one_per_gpu(tmp_path: Path) -> None:
    from finetune.planner import format_table

    p = plan(resolve(compose(tmp_path / "run", "backend=cuda", "backend.device=cuda")), recommend=False)
    if p.get("budget_bytes") is not None:
        pytest.skip("a CUDA device is visible: the plan has the device's size as its budget")
    assert ("  fits is unknown: no CUDA device is visible here; set memory.budget (bytes per GPU), "
            "e.g. memory.budget=48GiB") in format_table(p).splitlines()


def test_a_two_rank_plan_prints_both_ranks(tmp_path: Path) -> None:
    from finetune.planner import format_table

    p = plan(resolve(compose(tmp_path / "run", "backend=cuda", "backend.num_devices=2", "memory.budget=8GiB")),
             recommend=False)
    rows = [ln.split()[:2] for ln in format_table(p).splitlines() if ln.startswith("    rank")]
    assert rows == [["rank", "0"], ["rank", "1"]]
    assert "the same as rank 0" not in format_table(p)


def test_sgd_without_momentum_keeps_no_state_on_cuda() -> None:
    from finetune import planner

    assert planner.optimizer_state_bytes("sgd", "cuda", (1024, 1024), 4, True) == (0, 0)
    assert planner.optimizer_state_bytes("sgd", "cuda", (1024, 1024), 4, True, momentum=0.9) == (4 << 20, 0)


def test_device_map_auto_fills_gpus_as_accelerate_does() -> None:
    from finetune.planner.price import _split_layers

    # total 601, largest layer 100: every GPU but the last capped at 601 // 2 + 1.25 x 100 = 425,
    # GPU 0 keeping room for the largest layer (325): layer.2 would bring it to 400
    sizes = [("embed", 100), ("layer.0", 100), ("layer.1", 100), ("layer.2", 100), ("layer.3", 100), ("norm", 1),
             ("head", 100)]
    assert _split_layers(sizes, 2) == {"embed": 0, "layer.0": 0, "layer.1": 0, "layer.2": 1, "layer.3": 1,
                                       "norm": 1, "head": 1}
    assert set(_split_layers(sizes, 3).values()) <= {0, 1, 2}


def test_the_gpu_holding_every_layer_has_the_one_device_activations(tmp_path: Path) -> None:
    base = ("backend=cuda", "backend.device=cuda", "memory.budget=8GiB", "method=full")
    one = plan(resolve(compose(tmp_path / "one", *base)), recommend=False)
    split = plan(resolve(compose(tmp_path / "two", *base, "backend.device_map=auto", "backend.num_devices=2")), recommend=False)
    assert split["devices"] == 2 and [d["modules"] for d in split["per_device"]] == ["embed..embed", "layer.0..head"]
    assert split["per_device"][1]["bytes"]["activations"] == one["bytes"]["activations"]


def test_ddp_with_little_activation_peaks_at_the_gradient_sum(tmp_path: Path) -> None:
    # one short sample: the gradient sum (weights + state + grads + one bucket) is the peak
    p = plan(resolve(compose(tmp_path / "run", "backend=cuda", "backend.num_devices=2", "method=full", "memory.budget=8GiB",
                     "train.batch_size=1", "train.grad_accum=1", "train.seq_len=16")), recommend=False)
    bucket = p["collective_buffers"]["ddp_bucket"]["bytes"]
    assert p["peak_phase"] == "grad_sync"
    assert p["peak_allocated_bytes"] == p["steady_state_allocated_bytes"] + p["bytes"]["grads"] + bucket


def test_plan_error_is_predicted_minus_measured_in_bytes() -> None:
    from finetune.planner.present import plan_error

    b = {"weights": 100, "trainable_weights": 10, "grads": 10, "optimizer_state": 20, "optimizer_state_paged": 0}
    census = {"frozen_weights": 60, "trainable_weights": 10, "quant_buffers": 0, "grads": 12, "optimizer_state": 20,
              "optimizer_state_paged": 0}
    err = plan_error({"bytes": b}, census, {})
    assert err["weights"] == {"predicted": 100, "measured": 70, "error_bytes": 30, "relative_error": 30 / 70}
    assert err["grads"]["error_bytes"] == -2 and err["optimizer_state"]["error_bytes"] == 0


def test_the_plan_fit_to_budget_hands_back_is_the_chosen_run_without_a_search(tmp_path: Path) -> None:
    # the governor prints this plan's table when nothing fits; the levers are in its message
    res = fit_to_budget(resolve(compose(tmp_path / "run", "backend=cuda", "train.batch_size=4")), 1 << 20)
    assert not res.fits and res.plan["batch_size"] == 1 and res.plan["grad_checkpointing"] is True
    assert res.plan.get("recommendation") is None


def test_fewer_adapted_layers_is_a_lever_from_two_layers_on(tmp_path: Path) -> None:
    # every cheaper lever already on (checkpointing, activation offload), so only fewer layers remain
    base = ("backend=cuda", "train.batch_size=1", "train.grad_accum=1", "train.grad_checkpointing=true",
            "train.activation_offload=true")
    one_layer = plan(resolve(compose(tmp_path / "one", *base, "method.lora.num_layers=1")), recommend=False)
    res = fit_to_budget(resolve(compose(tmp_path / "two", *base)), one_layer["max_device_peak_bytes"])
    assert not res.fits and "method.lora.num_layers=1" in res.suggestions


@pytest.mark.parametrize(("ranks", "rows"), [(16, 16), (17, 1)])
def test_the_rank_table_shows_up_to_16_ranks_then_rank_0_for_all(tmp_path: Path, ranks: int, rows: int) -> None:
    from finetune.planner import format_table

    p = plan(resolve(compose(tmp_path / "run", "backend=cuda", f"backend.num_devices={ranks}", "memory.budget=8GiB")),
             recommend=False)
    assert p["strategy"] == "ddp" and p["world_size"] == ranks
    lines = format_table(p).splitlines()
    assert len([ln for ln in lines if ln.startswith("    rank ")]) == rows
    assert (f"    ranks 1..{ranks - 1}: the same as rank 0" in lines) == (rows == 1)


def test_a_one_process_plan_names_no_strategy_and_an_fsdp_shard_keeps_its_row_width(tmp_path: Path) -> None:
    from finetune.planner import Tensor

    assert plan(resolve(compose(tmp_path / "run", "backend=cuda")), recommend=False)["strategy"] is None
    t = Tensor("w", (10, 4, 2), 0, "linear", True, 4, shards=4)
    assert t.local_shape == (3, 4, 2) and t.local_numel == 24  # ceil(10 / 4) rows of the whole width


def test_the_chunked_loss_lever_is_offered_where_it_is_not_on_and_not_under_fsdp(tmp_path: Path) -> None:
    from finetune.planner.fit import LOSS_CHUNK_LEVER

    lever = f"train.loss_chunk={LOSS_CHUNK_LEVER}"
    base = ("backend=cuda", "train.batch_size=8", "train.grad_accum=1", "train.seq_len=256")

    def levers(*over: str) -> list[str]:
        cfg = compose(tmp_path / "run", *base, *over)
        budget = plan(resolve(compose(tmp_path / "c", *base, *over, f"train.loss_chunk={LOSS_CHUNK_LEVER}")),
                      recommend=False)["max_device_peak_bytes"]  # what the lever alone reaches
        return [lv["change"] for lv in plan(resolve(cfg), budget_bytes=budget)["recommendation"]["levers"]]

    assert lever in levers()
    assert lever not in levers("backend.num_devices=2", "backend.strategy=fsdp")  # FSDP cannot chunk it
    assert lever not in levers(f"train.loss_chunk={LOSS_CHUNK_LEVER}")  # already on


_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 512, "intermediate_size": 128}


def _linears(model_type: str, **extra) -> list[tuple[str, int, int, int]]:
    from finetune.model.describe import describe

    d = describe({**_SMALL, "model_type": model_type, **extra}, "config.json")
    return [(lin.key, lin.in_f, lin.out_f, lin.experts) for lin in d.blocks[0].linears]


def test_qwen3_moe_experts_are_moe_intermediate_size_wide() -> None:
    lins = _linears("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert [x for x in lins if x[0] == "experts"] == [("experts", 64, 64, 4), ("experts", 32, 64, 4)]  # 2 x 32 fused


def test_phi3_fuses_q_k_v_into_one_projection() -> None:
    # (4 heads + 2 x 2 kv heads) x head_dim 16
    assert _linears("phi3")[:2] == [("qkv_proj", 64, 128, 1), ("o_proj", 64, 64, 1)]


def test_a_gemma_1_block_has_the_two_llama_norms_not_gemma_2s_four() -> None:
    from finetune.model.describe import describe

    d = describe({**_SMALL, "model_type": "gemma"}, "config.json")
    assert [o[0] for o in d.blocks[0].others if o[2] == "norm"] == ["input_layernorm.weight",
                                                                      "post_attention_layernorm.weight"]


def test_gemma2_without_layer_types_windows_every_other_layer_from_the_first() -> None:
    from finetune.model.describe import describe

    d = describe({**_SMALL, "num_hidden_layers": 4, "model_type": "gemma2", "sliding_window": 8, "head_dim": 16},
                 "config.json")
    assert [b.sliding for b in d.blocks] == [True, False, True, False]
