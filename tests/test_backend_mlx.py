"""MlxBackend on Linux CPU with the tiny real Qwen2: training, exact counts, allocator figures,
resume, the loss-scale convention and mlx-lm adapter round trips. No mocks."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx import nn
from mlx.utils import tree_flatten
from omegaconf import OmegaConf

from finetune.backends.base import Backend, Batch, ModelInfo
from finetune.backends.mlx.runtime import MlxBackend
from finetune.config import Config, ModelConfig
from finetune.errors import UserError
from finetune.resolver import resolve
from finetune.synthetic import generate
from finetune.model.tiny import build_tiny

pytestmark = pytest.mark.mlx

# tiny: hidden 64, 2 layers; q_proj 64->64, v_proj 64->32 (2 kv heads x 16)
LAYERS, RANK = 2, 8
LORA_PER_LAYER = RANK * (64 + 64) + RANK * (64 + 32)  # r * (in + out) for q_proj and v_proj


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny(ModelConfig())


@pytest.fixture(scope="module")
def batch(model_dir: Path) -> Batch:
    """Four built-in samples, tokenized by the tiny tokenizer, prompt masked, right-padded."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rows, masks = [], []
    for r in generate(4, seed=0):
        p, c = tok.encode(r["prompt"]).ids, tok.encode(r["completion"]).ids + [0]  # 0 = <|endoftext|>
        ids = (p + c)[-40:]  # keep the completion: short rows keep MLX-on-CPU fast
        rows.append(ids)
        masks.append(([0] * len(p) + [1] * len(c))[-40:])
    t = max(map(len, rows))
    ids = np.zeros((4, t), np.int32)
    mask = np.zeros((4, t), np.int8)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)], mask[i, : len(m)] = r, m
    return Batch(ids, mask, np.array([len(r) for r in rows], np.int32))


def make_cfg(method: str = "lora", **over: Any) -> Any:
    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.backend.name, cfg.method.name = "mlx", method
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def backend(model_dir: Path, method: str = "lora", **over: Any) -> tuple[MlxBackend, ModelInfo]:
    b = MlxBackend()
    return b, b.setup(resolve(make_cfg(method, **over)), model_dir)


def train(b: MlxBackend, batch: Batch, steps: int, lr: float) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(b.forward_backward(batch, 1.0 / batch.label_tokens) / batch.label_tokens)
        b.optimizer_step(lr)
    return losses


def leaves(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(tree)}


# Drops measured over 15 steps at lr 1e-2 (nats per target token, from ln(512) ~ 6.2): lora
# ~0.27, full ~3.5. Rank-8 q/v adapters move a random-init model slowly; the cuda backend on
# the same model and batch gives the same curve to 2 decimals.
@pytest.mark.parametrize("method,drop", [("lora", 0.15), ("dora", 0.15), ("qlora", 0.15), ("full", 2.0)])
def test_training_lowers_loss(model_dir: Path, batch: Batch, method: str, drop: float) -> None:
    b, info = backend(model_dir, method)
    losses = train(b, batch, 15, 1e-2)
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - drop, losses
    assert info.device == "mlx:cpu"


def test_params_trainable_exact(model_dir: Path) -> None:
    base = sum(v.size for v in mx.load(str(model_dir / "model.safetensors")).values())
    b, lora = backend(model_dir, "lora")
    assert isinstance(b, Backend)
    assert lora.params_trainable == LAYERS * LORA_PER_LAYER == 3584
    assert lora.params_total == base + lora.params_trainable
    assert lora.extra["lora"]["keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
    assert lora.extra["lora"]["scale"] == 16.0 / RANK
    _, dora = backend(model_dir, "dora")  # + one magnitude per output feature
    assert dora.params_trainable == LAYERS * (LORA_PER_LAYER + 64 + 32)
    _, top = backend(model_dir, "lora", **{"method.lora.num_layers": 1})
    assert top.params_trainable == LORA_PER_LAYER
    _, q = backend(model_dir, "qlora")  # logical elements: a packed uint32 holds 8 int4 weights
    assert (q.params_total, q.params_trainable, q.dtype) == (lora.params_total, 3584, "int4")
    _, full = backend(model_dir, "full")
    assert full.params_trainable == full.params_total == base
    plain = OmegaConf.to_object(make_cfg("lora"))  # the dataclass Config resolves as well
    assert MlxBackend().setup(resolve(plain), model_dir).params_trainable == 3584


def test_census_exact(model_dir: Path, batch: Batch) -> None:
    b, info = backend(model_dir, "lora")
    n = info.params_trainable
    c0 = b.census()
    assert c0["trainable_weights"] == 4 * n
    assert c0["frozen_weights"] == 4 * (info.params_total - n)
    assert c0["grads"] == c0["optimizer_state"] == c0["optimizer_state_paged"] == c0["quant_buffers"] == 0
    b.forward_backward(batch, 1.0)
    assert b.census()["grads"] == 4 * n
    assert b.census()["optimizer_state"] == 0  # mlx creates AdamW moments at the first update
    b.zero_grad()  # the loop's OOM path: grads dropped
    assert b.census()["grads"] == 0 and b.optimizer_step(1e-3) is None
    b.forward_backward(batch, 1.0)
    b.optimizer_step(1e-3)
    c1 = b.census()
    # m and v in float32; the optimizer's "step"/"learning_rate" scalars (12 bytes) are not counted
    assert (c1["optimizer_state"], c1["grads"]) == (8 * n, 0)


@pytest.mark.parametrize("optim,per_param", [("adam", 8), ("sgd", 4), ("adafactor", None)])
def test_optimizer_state_bytes(model_dir: Path, batch: Batch, optim: str, per_param: int | None) -> None:
    b, info = backend(model_dir, "lora", **{"optim.name": optim})
    b.forward_backward(batch, 1.0 / batch.label_tokens)
    b.optimizer_step(1e-3)
    if per_param is not None:  # mlx SGD keeps its "v" buffer even at momentum 0
        assert b.census()["optimizer_state"] == per_param * info.params_trainable
    else:  # factored second moment: rows + cols floats per matrix
        shapes = [v.shape for _, v in tree_flatten(b.model.trainable_parameters())]
        assert b.census()["optimizer_state"] == sum(4 * (s[0] + s[1]) for s in shapes)


def test_qlora_quant_buffers_exact(model_dir: Path) -> None:
    b, _ = backend(model_dir, "qlora")
    g = 64  # quant_group_size: one float32 scale and one bias per 64 weights
    shapes = [(512, 64)] + LAYERS * [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)]
    assert b.census()["quant_buffers"] == sum(2 * 4 * o * i // g for o, i in shapes)
    packed = sum(o * i // 2 for o, i in shapes)  # 4 bits per weight
    assert b.census()["frozen_weights"] >= packed


def test_memory_counters_are_real(model_dir: Path, batch: Batch) -> None:
    b, _ = backend(model_dir, "lora")
    train(b, batch, 2, 1e-3)
    b.forward_backward(batch, 1.0)  # hold grads too
    gc.collect()
    m, c = b.memory(), b.census()
    for k in ("allocated", "reserved", "peak_allocated", "mlx_active", "mlx_cache", "mlx_peak",
              "mlx_memory_limit", "mlx_cache_limit"):
        assert isinstance(m[k], int) and m[k] >= 0, k
    # Linux CPU: no device total, no wired memory, no recommended working set, no reserved peak
    assert m["device_total"] is m["peak_reserved"] is m["mlx_wired_limit"] is m["mlx_recommended_working_set"] is None
    # Every counted array is live and materialized, so the allocator holds at least the census.
    # Above it (measured: under 1 KiB) sit other live arrays: scalars, the RNG key, anything
    # another test left alive; 1 MiB of tolerance.
    counted = sum(c.values())
    assert counted <= m["allocated"] <= counted + (1 << 20), (counted, m)
    assert m["reserved"] == m["allocated"] + m["mlx_cache"]
    assert m["peak_allocated"] >= m["allocated"]
    extra = mx.zeros((1 << 18,), mx.float32)  # 1 MiB
    mx.eval(extra)
    assert b.memory()["allocated"] - m["allocated"] == 1 << 20
    b.reset_peak()  # MLX zeroes its peak; ours never reads below what is held
    assert b.memory()["mlx_peak"] < b.memory()["peak_allocated"] == b.memory()["allocated"]
    b.forward_backward(batch, 1.0)
    assert b.memory()["peak_allocated"] > b.memory()["allocated"]  # the step's activations


def test_set_memory_limits(model_dir: Path) -> None:
    b, _ = backend(model_dir, "lora")
    cache_before = b.memory()["mlx_cache_limit"]
    got = b.set_memory_limits(8 << 30)
    try:
        assert got["memory_limit"] == 8 << 30
        assert got["wired_limit"] is None  # wired memory is a Metal notion
        assert "cache_limit" not in got  # the budget no longer sizes the cache (see set_cache_limit)
        m = b.memory()
        assert (m["mlx_memory_limit"], m["mlx_cache_limit"]) == (8 << 30, cache_before)
    finally:
        mx.set_memory_limit(got["memory_limit_prev"])


def test_set_cache_limit_releases_what_is_above_it(model_dir: Path, batch: Batch) -> None:
    b, _ = backend(model_dir, "lora")
    prev = b.set_cache_limit(1 << 30)
    try:
        x = mx.zeros((1 << 22,), mx.float32)  # 16 MiB, then freed into the cache
        mx.eval(x)
        del x
        assert b.memory()["mlx_cache"] >= 16 << 20
        assert b.set_cache_limit(1 << 20) == 1 << 30  # returns the previous cap
        m = b.memory()
        assert m["mlx_cache_limit"] == 1 << 20 and m["mlx_cache"] <= 1 << 20  # released now, not at the next free
    finally:
        b.set_cache_limit(prev)


def test_resume_equals_uninterrupted(model_dir: Path, batch: Batch, tmp_path: Path) -> None:
    over = {"method.lora.dropout": 0.1}  # dropout draws from the RNG: resume must redraw the same masks
    straight, _ = backend(model_dir, "lora", **over)
    ref = train(straight, batch, 6, 1e-2)
    first, _ = backend(model_dir, "lora", **over)
    got = train(first, batch, 3, 1e-2)
    first.save_state(tmp_path)
    del first
    second, _ = backend(model_dir, "lora", **{**over, "train.seed": 7})  # seed comes from the state
    second.load_state(tmp_path)
    got += train(second, batch, 3, 1e-2)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    a, b = leaves(straight.model.trainable_parameters()), leaves(second.model.trainable_parameters())
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-6)


def test_loss_scale_convention(model_dir: Path, batch: Batch) -> None:
    """Grads of one batch of 4 == grads accumulated over two micro-batches of 2."""
    scale = 1.0 / batch.label_tokens
    one, _ = backend(model_dir, "full")
    whole = one.forward_backward(batch, scale)
    two, _ = backend(model_dir, "full")
    halves = sum(two.forward_backward(m, scale) for m in batch.split(2))
    assert whole == pytest.approx(halves, rel=1e-5)
    assert whole == pytest.approx(one.eval_loss(batch), rel=1e-6)  # unscaled sum, no dropout
    a, b = leaves(one._grads), leaves(two._grads)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-7)


def test_grad_checkpointing_same_math_and_reversible(model_dir: Path, batch: Batch) -> None:
    plain, _ = backend(model_dir, "lora")
    ckpt, _ = backend(model_dir, "lora", **{"train.grad_checkpointing": True})
    base_cls = type(plain.model.layers[0])
    assert type(ckpt.model.layers[0]) is not base_cls and isinstance(ckpt.model.layers[0], base_cls)
    assert base_cls.__call__ is type(plain.model.layers[0]).__call__  # other models untouched
    la, lb = plain.forward_backward(batch, 1.0), ckpt.forward_backward(batch, 1.0)
    assert la == pytest.approx(lb, rel=1e-6)
    a, b = leaves(plain._grads), leaves(ckpt._grads)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7)
    ckpt.set_grad_checkpointing(False)
    assert type(ckpt.model.layers[0]) is base_cls
    ckpt.set_grad_checkpointing(True)
    assert type(ckpt.model.layers[0]) is not base_cls


def test_grad_checkpointing_lowers_peak(model_dir: Path) -> None:
    """On a longer batch (attention scores 2 x 4 heads x 256^2 floats = 2 MiB per layer) the
    blocks' activations are recomputed instead of kept: the step's peak above the resting
    bytes falls (measured at T=512: 100 MB -> 76 MB)."""
    ids = np.random.default_rng(0).integers(1, 500, (2, 256)).astype(np.int32)
    long = Batch(ids, np.ones_like(ids, np.int8), np.full(2, 256, np.int32))
    rise = {}
    for on in (False, True):
        b, _ = backend(model_dir, "lora", **{"train.grad_checkpointing": on})
        gc.collect()
        b.release_cache()
        b.reset_peak()
        b.forward_backward(long, 1.0)
        rise[on] = b.memory()["peak_allocated"] - b.memory()["allocated"]
        del b
    assert rise[True] < 0.9 * rise[False], rise


@pytest.mark.parametrize("method", ["lora", "dora", "qlora"])
def test_adapter_loads_in_mlx_lm(model_dir: Path, batch: Batch, tmp_path: Path, method: str) -> None:
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    b, _ = backend(model_dir, method)
    train(b, batch, 3, 1e-2)
    b.save_adapter(tmp_path)
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    assert conf["fine_tune_type"] == ("dora" if method == "dora" else "lora")
    model, _ = load(str(model_dir))
    if conf["quantization"]:  # the adapter was trained on this quantized base
        q = conf["quantization"]
        nn.quantize(model, q["group_size"], q["bits"])
    load_adapters(model, str(tmp_path))
    model.eval()
    b.model.eval()
    ids = mx.array(batch.input_ids)
    np.testing.assert_allclose(np.array(model(ids)), np.array(b.model(ids)), atol=1e-5)


def test_full_saves_an_mlx_lm_model(model_dir: Path, batch: Batch, tmp_path: Path) -> None:
    from mlx_lm.utils import load

    b, _ = backend(model_dir, "full")
    train(b, batch, 2, 1e-2)
    b.save_adapter(tmp_path)
    model, _ = load(str(tmp_path))
    b.model.eval()
    ids = mx.array(batch.input_ids)
    np.testing.assert_allclose(np.array(model(ids)), np.array(b.model(ids)), atol=1e-5)


def test_bf16_true_trains(model_dir: Path, batch: Batch) -> None:
    b, info = backend(model_dir, "lora", **{"precision.name": "bf16-true"})
    assert info.dtype == "bfloat16"
    assert {v.dtype for _, v in tree_flatten(b.model.parameters())} == {mx.bfloat16}
    assert b.census()["trainable_weights"] == 2 * info.params_trainable
    losses = train(b, batch, 8, 1e-2)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("over,words", [
    ({"precision.name": "bf16-mixed"}, ["32-true", "bf16-true"]),
    ({"precision.name": "16-mixed"}, ["autocast"]),
    ({"optim.name": "adamw_8bit"}, ["optim=adamw_8bit needs backend=cuda", "adafactor"]),
    ({"optim.name": "paged_adamw"}, ["bitsandbytes"]),
    ({"method.lora.keys": ["qq_proj"]}, ["q_proj", "gate_proj"]),
])
def test_user_errors_name_the_choices(model_dir: Path, over: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(UserError) as e:
        backend(model_dir, "lora", **over)
    assert all(w in str(e.value) for w in words), str(e.value)
