"""CudaBackend on the tiny model, on the CPU: real torch/transformers/PEFT/bitsandbytes.

Exact assertions where the math is exact (parameter counts, state bytes), tolerances where
floating point is involved. Allocator figures need CUDA: those tests are marked and skipped.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from conftest import make_spec
from finetune.resolver import resolve
from finetune.backends.base import Batch, OutOfMemory
from finetune.backends.cuda.runtime import CudaBackend
from finetune.config import Config
from finetune.errors import UserError
from finetune.synthetic import generate
from finetune.model.tiny import build_tiny

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# tiny: hidden 64, 4 heads x head_dim 16 (q: 64 -> 64), 2 kv heads (k, v: 64 -> 32), mlp 128,
# vocab 512 (tied), 2 layers, q/k/v bias.
H, KV, FF, V, LAYERS = 64, 32, 128, 512, 2
PER_LAYER = H * H + 2 * H * KV + H * H + (H + 2 * KV) + 3 * H * FF + 2 * H
BASE_PARAMS = V * H + LAYERS * PER_LAYER + H  # + final norm
LINEAR_SHAPES = [(H, H), (KV, H), (KV, H), (H, H), (FF, H), (FF, H), (H, FF)]  # (out, in) per layer


@pytest.fixture(scope="module")
def tiny_dir():
    return build_tiny(Config(run_dir="unused").model)


@pytest.fixture(scope="module")
def batch(tiny_dir) -> Batch:
    """Four synthetic samples, right-padded, loss on the completion tokens only."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    rows = []
    for r in generate(4, seed=3):
        p, c = tok(r["prompt"])["input_ids"], tok(r["completion"])["input_ids"]
        rows.append((p + c, [0] * len(p) + [1] * len(c)))
    t = max(len(ids) for ids, _ in rows)
    ids = np.full((4, t), tok.pad_token_id, np.int32)
    mask = np.zeros((4, t), np.int8)
    for i, (x, m) in enumerate(rows):
        ids[i, : len(x)], mask[i, : len(m)] = x, m
    return Batch(ids, mask, np.array([len(x) for x, _ in rows], np.int32), np.arange(4))


def make(tiny_dir, method="lora", optim="adamw", precision="32-true", lr=1e-2, device="cpu",
         **lora):
    cfg = Config(run_dir="unused")
    cfg.backend.name, cfg.backend.device = "cuda", device
    cfg.method.name, cfg.optim.name, cfg.precision.name, cfg.optim.lr = method, optim, precision, lr
    for k, v in lora.items():
        setattr(cfg.method.lora, k, v)
    be = CudaBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: "paged optimizers fall back on CPU"
        info = be.setup(resolve(cfg), tiny_dir)
    return be, info


def train(be: CudaBackend, batch: Batch, steps: int) -> list[float]:
    """Loss per label token of each optimizer step on the same batch."""
    out = []
    for _ in range(steps):
        out.append(be.forward_backward(batch, 1.0 / batch.label_tokens) / batch.label_tokens)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            be.optimizer_step(be.spec.optim.lr)
    return out


@pytest.mark.parametrize("method,optim", [
    ("lora", "adamw"), ("dora", "adamw"), ("qlora", "adamw"),
    ("full", "adamw_8bit"), ("full", "paged_adamw_8bit"),
])
def test_method_trains(tiny_dir, batch, method, optim):
    be, info = make(tiny_dir, method, optim, lr=3e-2)
    losses = train(be, batch, 15)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.95 * losses[0], losses
    assert info.dtype == ("nf4" if method == "qlora" else "float32")
    assert info.device == "cpu" and info.model_path == str(tiny_dir.resolve())


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-mixed"])
def test_precisions_train(tiny_dir, batch, precision):
    be, info = make(tiny_dir, "lora", "adamw", precision)
    losses = train(be, batch, 10)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert info.dtype == ("bfloat16" if precision == "bf16-true" else "float32")
    assert info.extra["grad_scaler"] == (precision == "16-mixed")


def test_param_counts_exact(tiny_dir):
    lora_per_layer = 8 * (H + H) + 8 * (H + KV)  # r * (in + out): q_proj, v_proj
    _, info = make(tiny_dir, "lora")
    assert info.params_trainable == LAYERS * lora_per_layer == 3584
    assert info.params_total == BASE_PARAMS + info.params_trainable
    _, top1 = make(tiny_dir, "lora", num_layers=1)  # adapters on the top layer only
    assert top1.params_trainable == lora_per_layer
    _, dora = make(tiny_dir, "dora")  # + one magnitude per output feature of each adapted Linear
    assert dora.params_trainable == LAYERS * (lora_per_layer + H + KV)
    _, q = make(tiny_dir, "qlora")  # 4-bit weights counted by logical element, not packed byte
    assert (q.params_total, q.params_trainable) == (info.params_total, info.params_trainable)
    _, full = make(tiny_dir, "full", "sgd")
    assert full.params_total == full.params_trainable == BASE_PARAMS


def test_census_adamw_exact(tiny_dir, batch):
    be, info = make(tiny_dir, "full", "adamw")
    n, tensors = info.params_trainable, len(be.optimizer.param_groups[0]["params"])
    c = be.census()
    assert c["trainable_weights"] == 4 * n and c["frozen_weights"] == 0
    assert c["grads"] == 0 and c["optimizer_state"] == 0  # AdamW creates its state at step 1
    be.forward_backward(batch, 1.0 / batch.label_tokens)
    assert be.census()["grads"] == 4 * n
    be.optimizer_step(1e-3)
    c = be.census()
    # exp_avg + exp_avg_sq (fp32) per element, plus one fp32 `step` scalar per tensor
    assert c["optimizer_state"] == 8 * n + 4 * tensors
    assert c["grads"] == 0 and c["optimizer_state_paged"] == 0 and c["quant_buffers"] == 0


@pytest.mark.parametrize("optim", ["adamw_8bit", "paged_adamw_8bit"])
def test_census_8bit_rule_exact(tiny_dir, batch, optim):
    be, _ = make(tiny_dir, "full", optim)
    train(be, batch, 1)
    expected = 0
    for p in be.model.parameters():
        n = p.numel()
        if n >= 4096:  # bitsandbytes min_8bit_size: uint8 m and v + fp32 absmax per 256-block each
            expected += 2 * n + 2 * 4 * math.ceil(n / 256)
        else:  # smaller tensors keep fp32 m and v
            expected += 8 * n
    expected += 2 * 256 * 4  # the signed/unsigned quantile maps, shared by every parameter
    c = be.census()
    # On CPU bitsandbytes does not page: the paged optimizer's state is ordinary memory.
    assert (c["optimizer_state"], c["optimizer_state_paged"]) == (expected, 0)


def test_census_qlora_exact(tiny_dir, batch):
    be, info = make(tiny_dir, "qlora")
    train(be, batch, 1)
    c = be.census()
    quant = [o * i for o, i in LINEAR_SHAPES] * LAYERS
    dense = BASE_PARAMS - sum(quant)  # embeddings, norms, biases stay fp32 under 32-true
    assert c["frozen_weights"] == 4 * dense + sum(quant) // 2  # NF4: two weights per byte
    # per weight: uint8 absmax per 64-block (double quant), 16-entry fp32 NF4 code, fp32 offset,
    # fp32 absmax of the absmax per 256-block and its 256-entry fp32 code
    per_weight = [n // 64 + 64 + 4 + 4 * math.ceil(n / 64 / 256) + 1024 for n in quant]
    assert c["quant_buffers"] == sum(per_weight)
    assert c["trainable_weights"] == 4 * info.params_trainable


def test_memory_unknown_on_cpu(tiny_dir):
    be, _ = make(tiny_dir, "lora")
    mem = be.memory()
    for k in ("allocated", "reserved", "peak_allocated", "peak_reserved", "device_total",
              "inactive_split", "alloc_retries", "num_ooms", "devices"):
        assert mem[k] is None, k
    be.reset_peak()
    be.release_cache()
    assert be.set_memory_limits(1 << 30) == {}


@pytest.mark.parametrize("method,optim,dropout",
                         [("lora", "adamw", 0.1), ("full", "adamw_8bit", 0.0)])
def test_resume_matches_uninterrupted(tiny_dir, batch, tmp_path, method, optim, dropout):
    straight, _ = make(tiny_dir, method, optim, dropout=dropout)
    expected = train(straight, batch, 6)
    first, _ = make(tiny_dir, method, optim, dropout=dropout)
    got = train(first, batch, 3)
    first.save_state(tmp_path)
    del first
    second, _ = make(tiny_dir, method, optim, dropout=dropout)
    second.load_state(tmp_path)
    got += train(second, batch, 3)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)


def test_loss_scale_convention(tiny_dir, batch):
    """Grads of one batch of 4 equal those accumulated over two micro-batches of 2 when every
    call scales by 1 / label tokens of the whole step."""
    scale = 1.0 / batch.label_tokens
    whole, _ = make(tiny_dir, "lora")
    loss_whole = whole.forward_backward(batch, scale)
    parts, _ = make(tiny_dir, "lora")
    loss_parts = sum(parts.forward_backward(b, scale) for b in batch.split(2))
    assert loss_parts == pytest.approx(loss_whole, rel=1e-5)
    for (n, a), b in zip(whole.model.named_parameters(), parts.model.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7, msg=n)


def test_grad_norm_is_pre_clip(tiny_dir, batch):
    norms = []
    for max_norm in (None, 1e-3):
        be, _ = make(tiny_dir, "lora")
        be._max_norm = max_norm  # what setup read from optim.max_grad_norm
        be.forward_backward(batch, 1.0 / batch.label_tokens)
        grads = [p.grad.clone() for p in be.model.parameters() if p.grad is not None]
        norms.append(be.optimizer_step(1e-2))
        flat = torch.cat([g.flatten() for g in grads])
        assert norms[-1] == pytest.approx(float(torch.linalg.vector_norm(flat)), rel=1e-5)
    assert norms[0] == pytest.approx(norms[1], rel=1e-6) and norms[0] > 1e-3


def test_oom_becomes_outofmemory_and_step_redoes(tiny_dir, batch):
    ref, _ = make(tiny_dir, "lora")
    expected = train(ref, batch, 2)
    be, _ = make(tiny_dir, "lora")
    calls = {"n": 0}

    def boom(module, args, output):
        calls["n"] += module.training  # not the head check's eval-mode forward (backends/cuda/loss.py)
        if calls["n"] == 2:  # the second micro-batch of the first step
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = be.hf.model.layers[1].register_forward_hook(boom)
    halves, scale = batch.split(2), 1.0 / batch.label_tokens
    be.forward_backward(halves[0], scale)
    with pytest.raises(OutOfMemory, match="out of memory"):
        be.forward_backward(halves[1], scale)
    assert all(p.grad is None for p in be.model.parameters())  # the step's grads are dropped
    handle.remove()
    got = [sum(be.forward_backward(b, scale) for b in halves) / batch.label_tokens]  # redo the step
    be.optimizer_step(1e-2)
    got += train(be, batch, 1)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_grad_checkpointing_same_grads_and_toggles(tiny_dir, batch):
    plain, _ = make(tiny_dir, "lora")
    ckpt, _ = make(tiny_dir, "lora")
    ckpt.set_grad_checkpointing(True)
    assert ckpt.hf.model.layers[0].gradient_checkpointing
    scale = 1.0 / batch.label_tokens
    expected = plain.forward_backward(batch, scale)
    assert ckpt.forward_backward(batch, scale) == pytest.approx(expected, rel=1e-6)
    for a, b in zip(plain.model.parameters(), ckpt.model.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    ckpt.set_grad_checkpointing(False)
    assert not ckpt.hf.model.layers[0].gradient_checkpointing


def test_save_adapter_reloads(tiny_dir, batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    be, _ = make(tiny_dir, "lora")
    train(be, batch, 3)
    be.save_adapter(tmp_path / "lora")
    written = {p.name for p in (tmp_path / "lora").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= written
    base = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "lora"))
    ref = CudaBackend()  # evaluate the reloaded model through the same loss code
    ref.model, ref.device = reloaded, torch.device("cpu")
    assert ref.eval_loss(batch) == pytest.approx(be.eval_loss(batch), rel=1e-6)

    full, _ = make(tiny_dir, "full", "sgd", lr=0.5)
    train(full, batch, 2)
    full.save_adapter(tmp_path / "full")
    assert (tmp_path / "full" / "tokenizer.json").is_file()
    ref.model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full"), dtype=torch.float32)
    assert ref.eval_loss(batch) == pytest.approx(full.eval_loss(batch), rel=1e-6)


def test_unsupported_choices_are_user_errors(tiny_dir):
    with pytest.raises(UserError, match="adamw_8bit"):
        make(tiny_dir, "lora", "lion")
    with pytest.raises(UserError, match="qlora"):
        make(tiny_dir, "prefix")
    with pytest.raises(UserError, match="q_proj"):
        make(tiny_dir, "lora", keys=["no_such_layer"])


def test_cuda_context_measure_without_nvml_is_unknown():
    """No driver, no NVML: the context size is unknown (None), never 0, and CUDA is not touched."""
    import torch

    from finetune.backends.cuda.load import measure_cuda_contexts

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: test_cuda_memory_figures covers the measurement")
    assert measure_cuda_contexts([0]) == {0: None}
    assert not torch.cuda.is_initialized()


@cuda
@needs_cuda
def test_cuda_memory_figures(tiny_dir, batch):
    be, info = make(tiny_dir, "lora", device="cuda:0")
    assert info.device == "cuda:0"
    be.reset_peak()
    train(be, batch, 2)
    mem = be.memory()
    assert mem["allocated"] > 0 and mem["peak_allocated"] >= mem["allocated"]
    assert mem["reserved"] >= mem["allocated"] and mem["device_total"] > mem["reserved"]
    assert [d["index"] for d in mem["devices"]] == [0]
    # the context was measured at setup (NVML before/after creating it) unless CUDA was already
    # initialized in this pytest process by an earlier test
    assert mem["cuda_context"] is None or 50 << 20 < mem["cuda_context"] < 4 << 30, mem["cuda_context"]
    limits = be.set_memory_limits(mem["device_total"] // 2)
    assert limits["per_process_memory_fraction"]["cuda:0"] == pytest.approx(0.5)
    be.set_memory_limits(mem["device_total"])  # undo: other tests share the process


def test_right_padded_rows_need_no_padding_mask(tiny_dir, batch, monkeypatch):
    """The batch is right-padded (rows of different lengths). The backend passes no padding
    mask, so sdpa gets no [B, 1, T, T] mask and runs causal; the loss and every gradient equal
    those computed with the mask passed explicitly, because no real token attends to a later
    pad and the pads carry loss weight 0. The planner prices the mask only where the runtime
    passes one (remote-code models)."""
    import torch.nn.functional as F

    from finetune import planner
    from tests.conftest import make_cfg

    assert len(set(batch.lengths.tolist())) > 1  # padded rows, else this proves nothing
    be, _ = make(tiny_dir)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append((k.get("attn_mask"), k.get("is_causal")))
        return sdpa(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = be.forward_backward(batch, 1.0)
    monkeypatch.undo()
    assert seen and all(m is None and causal for m, causal in seen)
    grads = {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None}
    be.zero_grad()
    ids = torch.as_tensor(batch.input_ids, dtype=torch.long)
    attn = (torch.arange(ids.shape[1])[None, :] < torch.as_tensor(batch.lengths)[:, None]).long()
    logits = be.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    want = (ce * torch.as_tensor(batch.loss_mask[:, 1:], dtype=torch.float32)).sum()
    want.backward()
    assert got == pytest.approx(float(want), rel=1e-6)
    for n, p in be.model.named_parameters():
        if p.grad is not None:
            scale = float(p.grad.abs().max()) or 1.0
            assert float((grads[n] - p.grad).abs().max()) <= 1e-5 * scale, n

    def plan(*extra: str) -> dict:
        return planner.plan(make_spec("/tmp/unused", "mode=plan", "backend=cuda", "model=qwen2-0.5b",
                                     "train.batch_size=2", "train.seq_len=512", *extra), recommend=False)

    masked, causal = plan("model.trust_remote_code=true"), plan()
    # with a mask, every layer's sdpa gets it: the bool [B, 1, T, T] once, and per layer k and v
    # repeated to every query head (transformers' use_gqa_in_sdpa: GQA only without a mask) and
    # the mask in the compute dtype (bf16 here), as measured on gemma3's masked sliding layers
    # (tests/test_family_plans.py); Qwen2-0.5B: 24 layers, 14 heads, 2 kv heads, head_dim 64
    n, a = 2 * 512, 2
    per_layer = 2 * n * (14 - 2) * 64 * a + 2 * 512 * 512 * a
    assert masked["peak_bytes"] - causal["peak_bytes"] == 2 * 512 * 512 + 24 * per_layer
