"""The mission's own commands as a user types them: the default precision keeps the
checkpoint's dtype, `mode=plan` plans for the target machine, a pre-quantized MLX checkpoint
trains with LoRA, and the MLX cache limit follows the measured step, not the budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import make_cfg, make_spec, needs_mlx, needs_torch
import warm_cli

from finetune import planner
from finetune.model.source import stored_dtype
from finetune.resolver import resolve

GiB = 1 << 30


def _plan(tmp_path: Path, *over: str) -> dict:
    return planner.plan(make_spec(tmp_path / "p", *over), recommend=False)


def test_default_precision_plans_the_stored_dtype_of_a_72b(tmp_path: Path) -> None:
    p = _plan(tmp_path, "mode=plan", "backend=mlx", "model=qwen2-72b")
    assert p["precision"] == "auto"
    assert (p["dtypes"]["weights"], p["dtypes"]["adapters"]) == ("bfloat16", "float32")
    assert "model.dtype of preset qwen2-72b" in p["dtypes"]["stored"]
    # every parameter once at 2 bytes (adapters are 4 bytes and trainable)
    adapters = p["bytes"]["trainable_weights"]
    assert p["bytes"]["weights"] == 2 * (p["params_total"] - adapters // 4) + adapters
    assert 144e9 < p["bytes"]["weights"] < 146e9  # "about 145 GB" (72.7 B parameters in bf16)
    fp32 = _plan(tmp_path, "mode=plan", "backend=mlx", "model=qwen2-72b", "precision=32-true")
    assert fp32["bytes"]["weights"] == 4 * fp32["params_total"]  # the explicit precisions still cast


def test_stored_dtype_is_read_from_config_json(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    cfg = make_cfg(tmp_path / "r", f"model.path={d}").model
    assert stored_dtype(cfg) == ("float16", f"{d / 'config.json'} torch_dtype")
    (d / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    assert stored_dtype(cfg)[0] == "bfloat16"
    (d / "config.json").write_text("{}")
    assert stored_dtype(cfg)[0] == "float32"  # the preset `tiny` says float32 too
    assert stored_dtype(make_cfg(tmp_path / "r", "model=llama2-7b").model)[0] == "float16"


def test_cuda_plan_from_a_machine_without_a_gpu(tmp_path: Path) -> None:
    over = ("mode=plan", "backend=cuda", "optim=paged_adamw_8bit", "model=llama2-7b", "method=full")
    p = _plan(tmp_path, *over)
    assert p["device"] == "cuda" and p["fits"] is None and p["budget_bytes"] is None
    # paged 8-bit state: 2 bytes/param of the large tensors, in unified memory, not in the peak
    assert p["bytes"]["optimizer_state_paged"] > 1.9 * p["params_total"]
    assert "memory.budget=48GiB" in planner.format_table(p)
    # llama-2 is stored in fp16; a full fine-tune trains it in bf16 (same bytes), and says so
    assert p["dtypes"]["weights"] == "bfloat16" and any("stores float16" in n for n in p["notes"])
    cpu = _plan(tmp_path, *over, "backend.device=cpu")
    assert cpu["device"] == "cpu" and cpu["bytes"]["optimizer_state_paged"] == 0  # bnb pages only on CUDA
    two = _plan(tmp_path, *over, "backend.device_map=auto", "backend.num_devices=2", "memory.budget=48GiB")
    assert two["devices"] == 2 and len(two["per_device"]) == 2 and two["fits"] is True
    assert sum(d["bytes"]["weights"] for d in two["per_device"]) == two["bytes"]["weights"]
    table = planner.format_table(two)
    assert "gpu 0" in table and "gpu 1" in table and "per device (GiB)" in table


def test_train_mode_plans_the_device_it_will_use(tmp_path: Path) -> None:
    # the governor's plan before loading is for where the run goes: CPU here
    p = _plan(tmp_path, "backend=cuda", "optim=paged_adamw_8bit", "method=full")
    assert p["device"] == "cpu"


def test_plan_cli_prints_the_target_table(tmp_path: Path) -> None:
    r = warm_cli.run([sys.executable, "-m", "finetune", "mode=plan", "backend=cuda", "optim=paged_adamw_8bit",
                        "model=llama2-7b", "method=full", "backend.device_map=auto", "backend.num_devices=2",
                        "memory.budget=48GiB", f"hydra.run.dir={tmp_path / 'plan'}"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "(cuda x2)" in out and "gpu 1" in out and "fits: yes" in out
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["devices"] == 2 and plan["budget_bytes"] == 48 * GiB


@needs_torch
def test_tiny_trains_in_fp32_by_default_on_cuda_backend(tmp_path: Path) -> None:
    from finetune.run.loop import train

    s = train(resolve(make_cfg(tmp_path / "run", "backend=cuda", "train.steps=2", "train.eval_every=0", "train.progress=false")))
    assert s["precision"] == "auto" and s["dtype"] == "float32"


# ---- MLX: default dtype, pre-quantized checkpoints, the cache limit -------------------------

@pytest.fixture(scope="module")
def quantized_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model quantized by mlx-lm's own converter (4-bit, group 64), as the
    mlx-community repos are made."""
    pytest.importorskip("mlx_lm")
    from mlx_lm import convert

    from finetune.model.source import resolve_model_dir

    src = resolve_model_dir(make_cfg(tmp_path_factory.mktemp("c"), "model=tiny").model)
    out = tmp_path_factory.mktemp("q") / "tiny-4bit"
    convert(str(src), str(out), quantize=True, q_group_size=64, q_bits=4)
    return out


@needs_mlx
def test_prequantized_checkpoint_trains_lora_and_plans_its_bytes(quantized_tiny: Path, tmp_path: Path) -> None:
    from finetune.run.loop import train

    cfg = json.loads((quantized_tiny / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
    over = ("backend=mlx", "method=lora", f"model.path={quantized_tiny}", "train.steps=4", "train.eval_every=0",
            "train.progress=false", "optim.lr=1e-2", "train.warmup_steps=0")
    s = train(resolve(make_cfg(tmp_path / "run", *over)))
    assert s["last_step_loss"] < s["first_loss"]
    census = s["memory"]["census_first_optimizer"]
    plan = planner.plan(make_spec(tmp_path / "p", *over), recommend=False)
    assert plan["dtypes"]["quantized"] == "int4/affine/group64 (pre-quantized)"
    held = census["frozen_weights_bytes"] + census["quant_buffers_bytes"] + census["trainable_weights_bytes"]
    # the planner's usual accuracy on weights is exact; allow 1% for mlx's packing of odd shapes
    assert abs(plan["bytes"]["weights"] - held) <= 0.01 * held, (plan["bytes"]["weights"], held)
    fp = planner.plan(make_spec(tmp_path / "p2", "backend=mlx", "method=lora"), recommend=False)
    assert plan["bytes"]["weights"] < 0.4 * fp["bytes"]["weights"]  # 4-bit base, not fp32
    adapter = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert adapter["pre_quantized"] is True and adapter["quantization"] == {"bits": 4, "group_size": 64}


@needs_mlx
def test_prequantized_checkpoint_is_refused_by_cuda_in_one_line(quantized_tiny: Path, tmp_path: Path) -> None:
    r = warm_cli.run([sys.executable, "-m", "finetune", "backend=cuda", f"model.path={quantized_tiny}",
                        "mode=plan", f"hydra.run.dir={tmp_path / 'x'}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "MLX-quantized" in r.stderr and "use backend=mlx" in r.stderr


@needs_mlx
def test_mlx_cache_limit_follows_the_measured_step(tmp_path: Path) -> None:
    import mlx.core as mx

    from finetune.run.loop import train

    # a cache limit other than the one the step asks for, so that setting it is a change (a
    # limit set to the size it already has is no event: tests/test_first_hour.py)
    mx.set_cache_limit(1 << 30)
    s = train(resolve(make_cfg(tmp_path / "run", "backend=mlx", "train.steps=3", "train.eval_every=0", "train.progress=false",
                       "train.batch_size=8", "train.seq_len=128")))
    assert s["precision"] == "auto" and s["dtype"] == "float32"  # tiny is stored in fp32
    ev = [e for e in s["adaptations"] if e["action"] == "set_mlx_cache_limit"]
    assert len(ev) == 1 and ev[0]["step"] == 1 and ev[0]["trigger"] == "measured_step_peak"
    b = ev[0]["before"]
    from finetune.backends import capabilities

    floor = capabilities("mlx").min_cache_limit_bytes
    assert ev[0]["after"]["cache_limit"] == max(floor, b["step_peak_allocated"] - b["allocated"])
    # far below the old rule (a quarter of the budget, here the machine's RAM)
    assert ev[0]["after"]["cache_limit"] < s["budget_bytes"] // 16
    assert s["memory"]["last"]["mlx_cache_limit_bytes"] == ev[0]["after"]["cache_limit"]
    # a fixed size is applied at load; null leaves MLX's own
    fixed = train(resolve(make_cfg(tmp_path / "r2", "backend=mlx", "train.steps=1", "train.eval_every=0",
                           "train.progress=false", "memory.cache_limit=64MiB")))
    ev2 = [e for e in fixed["adaptations"] if e["action"] == "set_mlx_cache_limit"]
    assert [(e["step"], e["after"]["cache_limit"]) for e in ev2] == [(0, 64 << 20)]
    assert fixed["memory"]["last"]["mlx_cache_limit_bytes"] == 64 << 20
    mx.set_cache_limit(32 << 20)  # leave MLX's default for the tests after this one


def test_padding_to_a_multiple_keeps_the_math() -> None:
    import numpy as np
    from finetune.backends.base import padded_length

    from finetune.data.batches import collate

    assert [padded_length(t, 32) for t in (1, 2, 33, 34, 65)] == [1, 33, 33, 65, 65]
    assert padded_length(300, 32, max_len=256) == 300 and padded_length(200, 32, max_len=210) == 210
    ids = [np.arange(1, 11, dtype=np.int32), np.arange(1, 41, dtype=np.int32)]
    masks = [np.ones(10, np.int8), np.ones(40, np.int8)]
    b = collate(ids, masks, np.arange(2), pad_id=0, pad_multiple=32, max_len=256)
    assert b.input_ids.shape == (2, 65) and b.tokens == 50 and b.label_tokens == 48  # pads count nowhere
    one, two = b.split(1)
    assert one.input_ids.shape == (1, 33) and two.input_ids.shape == (1, 65)
    assert int(one.loss_mask.sum()) == 10 and int(two.loss_mask.sum()) == 40
