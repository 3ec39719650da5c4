"""The runtimes' numbers and files where a user reads them: the adapter_config.json an mlx run
writes (was the base itself quantized?), the parameter count that goes into summary.json, and
how mlx's gradient all-reduce cuts the gradients into messages. The tiny model, real mlx and
mlx-lm, on the CPU. Written for survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny() -> Path:
    from finetune.config import ModelConfig
    from finetune.model.tiny import build_tiny

    return build_tiny(ModelConfig())


def _mlx_spec(method: str) -> Any:
    from omegaconf import OmegaConf

    from finetune.config import Config
    from finetune.resolver import resolve

    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.backend.name, cfg.method.name = "mlx", method
    return resolve(cfg)


def _stored_params(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "numpy") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())


def test_mlx_qlora_on_a_plain_base_writes_pre_quantized_false_and_an_integer_parameter_count(tiny, tmp_path):
    """qlora quantizes the base in memory: the adapter says it trained on a 4-bit base made
    from an unquantized checkpoint (pre_quantized false), and the parameter count (logical
    elements: a packed uint32 holds 8 int4 weights) is the whole number summary.json shows."""
    pytest.importorskip("mlx_lm")
    from finetune.backends.mlx.runtime import MlxBackend

    b = MlxBackend()
    info = b.setup(_mlx_spec("qlora"), tiny)
    assert json.dumps(info.params_total) == str(_stored_params(tiny) + 3584)  # + rank-8 q/v adapters, 2 layers
    b.save_adapter(tmp_path)
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    assert conf["pre_quantized"] is False and conf["fine_tune_type"] == "lora"  # qlora is lora to mlx-lm
    assert conf["quantization"] == {"bits": 4, "group_size": 64}


def test_mlx_lora_on_an_mlx_quantized_checkpoint_writes_pre_quantized_true(tiny, tmp_path):
    pytest.importorskip("mlx_lm")
    from finetune.backends.mlx.runtime import MlxBackend
    from mlx_lm import convert

    q = tmp_path / "q4"
    convert(str(tiny), str(q), quantize=True, q_group_size=64, q_bits=4)
    b = MlxBackend()
    info = b.setup(_mlx_spec("lora"), q)
    assert info.dtype == "int4"
    (tmp_path / "adapter").mkdir()
    b.save_adapter(tmp_path / "adapter")
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["pre_quantized"] is True
    assert conf["quantization"] == {"bits": 4, "group_size": 64}


def test_mlx_dora_adapter_says_dora_to_mlx_lm(tiny, tmp_path):
    """mlx-lm's load_adapters builds DoRA layers only when fine_tune_type says dora: a dora
    adapter written as lora would load its magnitudes into nothing."""
    pytest.importorskip("mlx_lm")
    from finetune.backends.mlx.runtime import MlxBackend

    b = MlxBackend()
    b.setup(_mlx_spec("dora"), tiny)
    b.save_adapter(tmp_path)
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (conf["fine_tune_type"], conf["pre_quantized"], conf["quantization"]) == ("dora", False, None)


def test_mlx_all_reduce_sends_one_message_per_run_of_one_dtype_up_to_chunk_bytes(monkeypatch):
    """sum_over_ranks packs consecutive gradients of one dtype into messages of at most
    chunk_bytes (one larger gradient alone): the sizes of the all_sum calls are the memory the
    step's all-reduce holds at once. One process: the sum is the tree itself, names kept."""
    mx = pytest.importorskip("mlx.core")
    from finetune.backends.mlx.runtime import sum_over_ranks
    from mlx.utils import tree_flatten

    sent: list[tuple[int, str]] = []
    real = mx.distributed.all_sum

    def spy(x, *args, **kwargs):  # mlx's own all_sum, its message sizes recorded
        sent.append((x.size, str(x.dtype)))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(mx.distributed, "all_sum", spy)
    tree = {"a": mx.arange(4, dtype=mx.float32),  # 16 bytes
            "b": mx.ones((2, 3), dtype=mx.float32),  # 24: a + b = 40 fits one message
            "c": mx.arange(8, dtype=mx.float32),  # 32: would make 72, so a message of its own
            "d": mx.full((4,), 2.0, dtype=mx.float16)}  # another dtype: another message
    out = sum_over_ranks(tree, mx.distributed.init(), chunk_bytes=40)
    assert sent == [(10, "mlx.core.float32"), (8, "mlx.core.float32"), (4, "mlx.core.float16")]
    got = dict(tree_flatten(out))
    assert list(got) == ["a", "b", "c", "d"]
    for k, v in tree.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype
        np.testing.assert_array_equal(np.array(got[k]), np.array(v))


def test_cuda_fsdp_with_device_map_auto_is_refused_before_joining_the_ranks(monkeypatch):
    """Under a launcher (rank 0 of 2), fsdp shards over the ranks and device_map=auto splits
    one process's model over GPUs: the two cannot both hold, said before any process group
    is joined (no MASTER_ADDR here: joining would fail with torch's own message instead)."""
    pytest.importorskip("torch")
    from dataclasses import replace

    from finetune.backends.cuda.runtime import CudaBackend
    from omegaconf import OmegaConf

    from finetune.config import Config
    from finetune.errors import UserError
    from finetune.resolver import resolve

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.backend.name, cfg.backend.device = "cuda", "cpu"
    spec = resolve(cfg)
    # the resolver refuses the pair too (the planner's ranks), when it can read the model: the
    # spec here is one that got past it
    spec = replace(spec, backend=replace(spec.backend, strategy="fsdp", device_map="auto"))
    with pytest.raises(UserError) as e:
        CudaBackend().connect(spec)
    assert str(e.value) == ("backend.strategy=fsdp shards the model over the ranks; drop backend.device_map=auto "
                            "(it splits one process's model over GPUs)")



def _cuda(tiny: Path, precision: str = "32-true", keys: list[str] | None = None):
    pytest.importorskip("peft")
    import warnings

    from finetune.backends.cuda.runtime import CudaBackend

    from finetune.config import Config
    from finetune.resolver import resolve

    cfg = Config(run_dir="unused")
    cfg.backend.name, cfg.backend.device, cfg.precision.name = "cuda", "cpu", precision
    if keys is not None:
        cfg.method.lora.keys = keys
    b = CudaBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = b.setup(resolve(cfg), tiny)
    return b, info


def test_cuda_fp16_resume_keeps_the_loss_scale_and_fp32_has_no_scaler(tiny, tmp_path):
    """precision=16-mixed scales the loss (GradScaler); a resumed run goes on with the scale
    the overflows had lowered it to, not a fresh 65536. fp32 has nothing to scale."""
    pytest.importorskip("torch")
    _, fp32 = _cuda(tiny)
    assert fp32.extra["grad_scaler"] is False
    b, info = _cuda(tiny, "16-mixed")
    assert info.extra["grad_scaler"] is True
    from finetune.backends.base import Batch

    ids = np.arange(3, 19, dtype=np.int32).reshape(2, 8)
    mask = np.zeros((2, 8), np.int8)
    mask[:, 4:] = 1
    b.forward_backward(Batch(ids, mask, np.array([8, 8], np.int32), np.arange(2)), 1.0 / 8)
    b.optimizer_step(1e-3)  # the scaler's first step: its scale lives from here on
    b.scaler.update(new_scale=1024.0)  # as after six halvings by overflowing steps
    b.save_state(tmp_path)
    again, _ = _cuda(tiny, "16-mixed")
    assert again.scaler.get_scale() == 65536.0  # a fresh run's
    again.load_state(tmp_path)
    assert again.scaler.get_scale() == 1024.0


def test_cuda_checkpoint_with_adapters_this_run_lacks_is_refused_naming_one(tiny, tmp_path):
    """Saved with LoRA on q_proj and v_proj, resumed with q_proj only: nothing is missing, one
    tensor is extra, and the refusal names it."""
    pytest.importorskip("torch")
    b, _ = _cuda(tiny)  # keys q_proj, v_proj
    b.save_state(tmp_path)
    q_only, _ = _cuda(tiny, keys=["q_proj"])
    from finetune.errors import UserError

    with pytest.raises(UserError) as e:
        q_only.load_state(tmp_path)
    assert str(e.value) == (f"checkpoint {tmp_path} does not match this model/method "
                            "(e.g. base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight)")


def test_cuda_qlora_on_the_cpu_trains_on_after_an_evaluation(tiny):
    """bitsandbytes repacks 4-bit weights for its CPU inference kernel at the first eval-mode
    forward; a training step after an evaluation (train.eval_every) must still run and learn."""
    import warnings

    pytest.importorskip("bitsandbytes")
    from finetune.backends.base import Batch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from finetune.backends.cuda.runtime import CudaBackend

        from finetune.config import Config
        from finetune.resolver import resolve

        cfg = Config(run_dir="unused")
        cfg.backend.name, cfg.backend.device, cfg.precision.name, cfg.method.name = "cuda", "cpu", "32-true", "qlora"
        b = CudaBackend()
        b.setup(resolve(cfg), tiny)
        ids = np.arange(3, 19, dtype=np.int32).reshape(2, 8)
        mask = np.zeros((2, 8), np.int8)
        mask[:, 4:] = 1
        batch = Batch(ids, mask, np.array([8, 8], np.int32), np.arange(2))
        first = b.forward_backward(batch, 1.0 / 8)
        b.optimizer_step(1e-2)
        evaluated = b.eval_loss(batch)
        second = b.forward_backward(batch, 1.0 / 8)
    assert np.isfinite(evaluated) and second < first


def test_cuda_compile_on_a_cuda_device_without_triton_is_refused_naming_the_install() -> None:
    """train.compile on a CUDA device needs Triton for inductor's GPU kernels: without it the
    run stops before loading, in one line, instead of failing at the first compiled step. The
    check reads the device's type only, so it is exercised here with a CUDA device object on a
    machine that has no GPU."""
    import importlib.util

    torch = pytest.importorskip("torch")
    if importlib.util.find_spec("triton") is not None:
        pytest.skip("triton is installed here: the refusal cannot be seen")
    from finetune.backends.cuda.loss import compile_loss

    from finetune.errors import UserError

    with pytest.raises(UserError, match=r"^train.compile on a CUDA device needs Triton \(inductor's GPU kernels\): "
                                        r"pip install triton, or set train.compile=false$"):
        compile_loss(torch.device("cuda"), 0, None)


def test_cuda_on_the_cpu_hands_back_the_host_memory_a_step_freed(tiny):
    """On the CPU a step's activations and gradients are host memory that glibc keeps mapped
    once freed; the runtime hands those pages back after a step that left 32 MiB or more
    (probes.HostHeapTrim), so the RSS between steps is what is live, as the plan prices it. A
    micro-batch of 8 x 1024 tokens on the tiny model frees ~90 MiB a step (measured: the RSS grew
    89-92 MiB over such a step without the trim, -90 to -1 MiB with it)."""
    from finetune.backends.base import Batch
    from finetune.backends.cuda.runtime import CudaBackend

    from finetune.accounting.probes import SystemProbe
    from finetune.config import Config
    from finetune.resolver import resolve

    cfg = Config(run_dir="unused")
    cfg.backend.name, cfg.backend.device, cfg.train.seq_len = "cuda", "cpu", 1024
    b = CudaBackend()
    b.setup(resolve(cfg), tiny)
    B, T = 8, 1024
    ids = np.random.default_rng(0).integers(1, 200, (B, T)).astype(np.int32)
    batch = Batch(ids, np.ones((B, T), np.int8), np.full(B, T, np.int32))

    def step() -> int:
        before = SystemProbe().read()["rss"]
        b.forward_backward(batch, 1.0)
        b.optimizer_step(1e-3)
        return SystemProbe().read()["rss"] - before

    step()  # the first step's lasting allocations: optimizer state, the libraries' first use
    grown = step()
    assert b.host_trim is not None and b.host_trim.trims >= 1
    assert grown < 32 << 20, grown  # ~90 MiB without the trim
