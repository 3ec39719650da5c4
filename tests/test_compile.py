"""train.compile: the compiled step trains to the same losses as the plain one, on each backend.

The tiny real model, a few steps of real batches from the data pipeline (two micro-batches of
different lengths per step, so gradients accumulate across calls and MLX traces more than one
shape). Equal within float tolerance: a compiler may fuse and reorder float operations.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import HAS_TORCH, finetune_cmd, needs_mlx
import warm_cli
from omegaconf import OmegaConf

from finetune.config import Config
from finetune.errors import UserError
from finetune.resolver import resolve
from finetune.model.tiny import build_tiny

STEPS = 4


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return build_tiny(Config(run_dir="unused").model)


def _spec(backend: str, compile_: bool, **over: Any) -> Any:
    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.backend.name = backend
    if backend == "cuda":
        cfg.backend.device = "cpu"
    cfg.train.compile = compile_
    cfg.train.batch_size, cfg.train.grad_accum = 2, 2  # two micro-batches of 2 per step
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return resolve(cfg)


def _batches(cfg: Any, tiny_dir: Path, n: int) -> list[Any]:
    from transformers import AutoTokenizer

    from finetune import data as data_mod

    src, _ = data_mod.build(cfg, AutoTokenizer.from_pretrained(str(tiny_dir)))
    return [src.train_batch(j) for j in range(n)]


def _train(backend: Any, cfg: Any, batches: list[Any], toggle_ckpt_at: int | None = None) -> list[tuple]:
    """(loss per label token, grad norm) of each step, as the loop computes them."""
    out = []
    for j, batch in enumerate(batches):
        if j == toggle_ckpt_at:
            backend.set_grad_checkpointing(True)  # as the governor may, mid-run
        scale = 1.0 / batch.label_tokens
        loss = sum(backend.forward_backward(m, scale) for m in batch.split(cfg.train.batch_size))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            norm = backend.optimizer_step(cfg.optim.lr)
        out.append((loss / batch.label_tokens, norm))
    return out


def _assert_close(got: list[tuple], want: list[tuple], rel: float) -> None:
    assert len(got) == len(want) == STEPS
    for (gl, gn), (wl, wn) in zip(got, want):
        assert math.isfinite(gl) and gl == pytest.approx(wl, rel=rel), (got, want)
        assert gn == pytest.approx(wn, rel=rel * 10), (got, want)


# ---- mlx ----------------------------------------------------------------------------------------

def _mlx(tiny_dir: Path, compile_: bool, **over: Any) -> tuple[Any, Any]:
    from finetune.backends.mlx.runtime import MlxBackend

    cfg = _spec("mlx", compile_, **over)
    b = MlxBackend()
    b.setup(cfg, tiny_dir)
    return b, cfg


@needs_mlx
@pytest.mark.mlx
@pytest.mark.parametrize("over", [{}, {"method.lora.dropout": 0.1, "train.pad_multiple": 32}],
                         ids=["plain", "dropout"])
def test_mlx_compiled_equals_plain(tiny_dir: Path, over: dict) -> None:
    plain, cfg = _mlx(tiny_dir, False, **over)
    batches = _batches(cfg, tiny_dir, STEPS)
    shapes = [m.input_ids.shape for b in batches for m in b.split(2)]
    assert len(set(shapes)) > 1  # several shapes traced
    if over:  # a shape met again runs its old trace: its masks must come from this call's key
        assert len(set(shapes)) < len(shapes)
    want = _train(plain, cfg, batches)
    compiled, _ = _mlx(tiny_dir, True, **over)
    # dropout: the same masks only if the traced step reads the key _reseed sets each micro-batch
    _assert_close(_train(compiled, cfg, batches), want, rel=1e-5)


@needs_mlx
@pytest.mark.mlx
def test_mlx_compiled_follows_checkpointing_and_resume(tiny_dir: Path, tmp_path: Path) -> None:
    """A trace keeps what it traced: switching gradient checkpointing on mid-run and loading a
    checkpoint (a new optimizer state tree) must reach the compiled step."""
    plain, cfg = _mlx(tiny_dir, False)
    batches = _batches(cfg, tiny_dir, STEPS)
    want = _train(plain, cfg, batches, toggle_ckpt_at=2)
    compiled, _ = _mlx(tiny_dir, True)
    got = _train(compiled, cfg, batches[:2])
    traced = compiled._compiled["vg"]
    got += _train(compiled, cfg, batches[2:], toggle_ckpt_at=0)
    _assert_close(got, want, rel=1e-5)  # checkpointing changes no number: the trace must be new
    assert compiled.grad_checkpointing and compiled._compiled["vg"] is not traced

    first, _ = _mlx(tiny_dir, True)
    _train(first, cfg, batches[:2])
    first.save_state(tmp_path)
    resumed, _ = _mlx(tiny_dir, True)
    _train(resumed, cfg, batches[3:])  # traced against its own state, then replaced by the checkpoint's
    resumed.load_state(tmp_path)
    plain2, _ = _mlx(tiny_dir, False)
    want2 = _train(plain2, cfg, batches)
    got2 = _train(resumed, cfg, batches[2:])
    for (gl, gn), (wl, wn) in zip(got2, want2[2:]):
        assert gl == pytest.approx(wl, rel=1e-5) and gn == pytest.approx(wn, rel=1e-4)


# ---- cuda (torch.compile, on the CPU here) ------------------------------------------------------
def _inductor_cannot_run() -> str | None:
    """Why torch.compile cannot build CPU kernels here, or None."""
    if not HAS_TORCH:
        return "torch not installed"
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        cpp_builder.get_cpp_compiler()
    except InvalidCxxCompiler as e:
        return f"torch.compile needs a C++ compiler on the CPU: {e}"
    return None


@pytest.mark.skipif(_inductor_cannot_run() is not None, reason=str(_inductor_cannot_run()))
def test_cuda_compiled_equals_plain(tiny_dir: Path) -> None:
    """torch.compile (inductor, C++ kernels on the CPU) of the loss: forward and, through
    AOTAutograd, backward. Compiles twice (a static shape, then a dynamic one): ~1 min here."""
    from finetune.backends.cuda.runtime import CudaBackend

    cfg = _spec("cuda", False)
    batches = _batches(cfg, tiny_dir, STEPS)
    runs = []
    for compile_ in (False, True):
        b = CudaBackend()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            b.setup(_spec("cuda", compile_), tiny_dir)
        assert (b._compiled_loss is not None) == compile_
        runs.append(_train(b, cfg, batches))
    _assert_close(runs[1], runs[0], rel=1e-5)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_cuda_compile_refusals_are_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """Without a C++ compiler the key is one line naming the fix (exit 2, no traceback); so
    is a combination it does not run."""
    from finetune.backends.cuda.runtime import CudaBackend

    spec = _spec("cuda", True, **{"train.loss_chunk": 64})  # the backend refuses it, not the resolver
    with pytest.raises(UserError, match="loss_chunk"):
        CudaBackend().setup(spec, tiny_dir)
    env = dict(os.environ, CXX="no-such-c++-compiler")  # inductor's compiler (torch._inductor.config.cpp.cxx)
    r = warm_cli.run([*finetune_cmd(), "backend=cuda", "train.compile=true", "train.steps=1",
                        f"hydra.run.dir={tmp_path}/r"], check=False, capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if "train.compile" in ln)
    assert "C++ compiler" in line and "g++" in line and "train.compile=false" in line, line
