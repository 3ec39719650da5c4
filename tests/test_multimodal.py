"""A multimodal checkpoint (Gemma 3 from 4B up, as the shipped ``model=gemma3-12b`` preset points
at, and Mistral Small 3.1: a text model beside a vision tower) fine-tunes its language model on
both backends, and its adapters cross between them.

Asserted on tiny real ones (tests/families.py ``build_multimodal``: gemma3, and mistral3, whose
outer config ties the head over an untied text config): each backend loads the
language model alone (the plan's count, which leaves the vision tower out, equals what was
loaded and trained), with the checkpoint's own weights: the loss each backend computes on fixed
rows equals the full multimodal model's own loss in transformers; an all-linear adapter trained
on either backend, exported to the other format, gives the logits it gave where it was trained.
"""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HAS_MLX, HAS_TORCH, make_cfg
from families import MULTIMODAL, VOCAB, build_multimodal, reference_loss

from finetune import planner
from finetune.resolver import resolve

pytestmark = pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both torch+peft and mlx-lm")

FAST = ("train.steps=2", "train.warmup_steps=0", "train.eval_every=0", "train.progress=false",
        "data.num_samples=16", "train.batch_size=2", "train.grad_accum=1", "train.seq_len=128", "precision=32-true",
        "memory.sample_every=0", "optim.lr=1e-2", "method.lora.keys=all-linear")
IDS = [3, 17, 45, 101, 7, 250, 12, 9]  # inside the tiny text model's 8-token sliding window


@pytest.fixture(scope="module", params=MULTIMODAL)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _cfg(kind: str, run_dir: Path, backend: str, *extra: str) -> Any:
    return make_cfg(run_dir, f"model.path={build_multimodal(kind)}", f"backend={backend}", *FAST, *extra)


@pytest.fixture(scope="module")
def runs(kind: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each backend's all-linear LoRA run on the multimodal checkpoint: (run dir, summary)."""
    from finetune.run.loop import train

    root = tmp_path_factory.mktemp(f"multimodal-{kind}")
    return {b: (root / b, train(resolve(_cfg(kind, root / b, b)))) for b in ("cuda", "mlx")}


def _full_model(kind: str) -> Any:
    """The whole multimodal model, vision tower and all, as transformers loads the checkpoint."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(build_multimodal(kind)), dtype=torch.float32)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    return model.eval()


def _rows() -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(4).integers(8, VOCAB, (2, 8)).astype(np.int64)
    mask = np.ones((2, 8), np.float32)
    mask[:, :3] = 0
    return ids, mask


def test_both_backends_train_the_language_model_alone(kind: str, runs: dict[str, tuple[Path, dict[str, Any]]],
                                                      tmp_path: Path) -> None:
    full = sum(p.numel() for p in _full_model(kind).parameters())
    for backend, (_, s) in runs.items():
        p = planner.plan(resolve(_cfg(kind, tmp_path / backend, backend)), recommend=False)
        assert (s["params_total"], s["params_trainable"]) == (p["params_total"], p["params_trainable"]), backend
        assert s["params_total"] - s["params_trainable"] < full  # the vision tower was not loaded
        assert s["steps"] == 2 and math.isfinite(s["final_train_loss"])
    # the same weights, data and LoRA init: the two backends' first losses agree
    assert runs["mlx"][1]["first_loss"] == pytest.approx(runs["cuda"][1]["first_loss"], rel=1e-4)


def test_the_loss_is_the_multimodal_models_own(kind: str, tmp_path: Path) -> None:
    import mlx.core as mx
    import torch
    from finetune.backends.cuda import loss as cuda_loss
    from finetune.backends.cuda.runtime import CudaBackend
    from finetune.backends.mlx import loss as mlx_loss
    from finetune.backends.mlx.runtime import MlxBackend

    ids, mask = _rows()
    with torch.no_grad():
        want = reference_loss(_full_model(kind)(input_ids=torch.from_numpy(ids)).logits.float().numpy(), ids, mask)
    cuda = CudaBackend()
    cuda.setup(resolve(_cfg(kind, tmp_path / "c", "cuda")), build_multimodal(kind))
    with torch.no_grad():
        got = float(cuda_loss.token_loss_sum(cuda.model, torch.from_numpy(ids), None, torch.from_numpy(mask), 0,
                                             cuda._autocast))
    assert got == pytest.approx(want, rel=1e-5)
    mlx = MlxBackend()
    mlx.setup(resolve(_cfg(kind, tmp_path / "m", "mlx")), build_multimodal(kind))
    got = float(mlx_loss.token_loss_sum(mlx.model, mx.array(ids.astype(np.int32)), mx.array(mask), 0, grad=False))
    assert got == pytest.approx(want, rel=1e-4)


def _torch_logits(kind: str, adapter: Path | None) -> np.ndarray:
    import torch
    from finetune.model.source import load_causal_lm

    model = load_causal_lm(build_multimodal(kind), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(torch.tensor([IDS])).logits[0].float().numpy()


def _mlx_logits(kind: str, adapter: Path | None, base_dir: Path | None = None) -> np.ndarray:
    import mlx.core as mx
    from finetune.backends.mlx.hfconfig import model_config
    from mlx_lm.utils import load

    base = base_dir or build_multimodal(kind)
    model, _ = load(str(base), adapter_path=str(adapter) if adapter else None,
                    model_config=model_config(base, seq_len=len(IDS)))
    model.eval()
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


def _export(*args: Any) -> None:
    from finetune.export import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    assert rc == 0, err.getvalue()


@pytest.mark.parametrize("trained_on, to", [("cuda", "mlx"), ("mlx", "peft")])
def test_adapters_cross_backends(kind: str, trained_on: str, to: str, runs: dict[str, tuple[Path, dict[str, Any]]],
                                 tmp_path: Path) -> None:
    from finetune.model.safetensors_io import read_safetensors

    run = runs[trained_on][0]
    _export("--to", to, run / "adapter", tmp_path / to)
    if to == "mlx":  # mlx-lm's wrapper names its text model language_model
        names, _ = read_safetensors(tmp_path / to / "adapters.safetensors")
        assert names and all(n.startswith("language_model.model.layers.") for n in names), sorted(names)[:3]
    here = _torch_logits if trained_on == "cuda" else _mlx_logits
    there = _mlx_logits if trained_on == "cuda" else _torch_logits
    want, base = here(kind, run / "adapter"), here(kind, None)
    got = there(kind, tmp_path / to)
    diff, effect = float(np.abs(want - got).max()), float(np.abs(want - base).max())
    assert diff <= 1e-4 and effect > 1e-3, (diff, effect)


def test_full_and_merged_saves_load_back_as_what_was_trained(kind: str, runs: dict[str, tuple[Path, dict[str, Any]]],
                                                             tmp_path: Path) -> None:
    """A cuda merge and a cuda full fine-tune save a text checkpoint (its config, its names) that
    loads back whole, with the trained weights; an mlx full fine-tune saves mlx-lm's wrapper."""
    import torch
    import transformers
    from finetune.run.loop import train
    from transformers import AutoModelForCausalLM

    def reload(d: Path) -> np.ndarray:
        transformers.logging.set_verbosity_error()
        model, info = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            return model.eval()(torch.tensor([IDS])).logits[0].numpy()

    _export("--merge", runs["cuda"][0] / "adapter", tmp_path / "merged")
    assert float(np.abs(reload(tmp_path / "merged") - _torch_logits(kind, runs["cuda"][0] / "adapter")).max()) < 1e-4
    base = _torch_logits(kind, None)
    for backend in ("cuda", "mlx"):
        run = tmp_path / f"full-{backend}"
        train(resolve(_cfg(kind, run, backend, "method=full")))
        got = reload(run / "adapter") if backend == "cuda" else _mlx_logits(kind, None, base_dir=run / "adapter")
        assert float(np.abs(got - base).max()) > 1e-3, backend  # the trained weights, not the base's


def test_a_language_model_transformers_cannot_load_alone_is_refused_on_cuda(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Qwen2.5-VL's language model (M-RoPE) has no text-only class in transformers: cuda refuses
    in one line naming backend=mlx, where mlx-lm builds it and it trains (as a family finetune
    prices approximately, which the run says)."""
    import logging

    from finetune.cli import run
    from finetune.errors import UserError
    from finetune.run.loop import train

    with pytest.raises(UserError) as e:
        run(_cfg("qwen2_5_vl", tmp_path / "cuda", "cuda"))
    msg = str(e.value)
    assert "\n" not in msg and "(qwen2_5_vl_text) transformers has no text-only causal LM class" in msg, msg
    assert msg.endswith("use backend=mlx (where mlx-lm builds it) or a text model's checkpoint")
    with caplog.at_level(logging.WARNING, logger="finetune"):
        s = train(resolve(_cfg("qwen2_5_vl", tmp_path / "mlx", "mlx")))
    assert s["steps"] == 2 and math.isfinite(s["final_train_loss"])
    assert any("model_type=qwen2_5_vl_text" in r.getMessage() and "(approximate)" in r.getMessage()
               for r in caplog.records)
