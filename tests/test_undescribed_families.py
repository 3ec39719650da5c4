"""Families finetune does not describe exactly (tests/families.py ``UNDESCRIBED``): each one
either trains correctly, priced as a Llama-style decoder and saying so, or is refused in one
line naming the fix, on both backends. Never a traceback, never a wrong loss.

- cohere (Llama-like names, logits scaled after the head) and phi-2 (q/k/v/dense, fc1/fc2,
  LayerNorm, partial rotary): the run says at its start that the plan is approximate; the loss
  the backend trains on equals the framework's own model's loss on the same rows, with the head on
  target rows and chunked too (cohere's logit scale applied to them); the plan's
  LoRA count equals the backend's.
- the weights: held against the checkpoint's safetensors headers. gemma4_text's per-layer input
  embeddings, which the Llama-style layout leaves out, are priced from them (the plan's total is
  the checkpoint's), and a multimodal Qwen3.5's hybrid language model alone (its vision tower
  left out, as the run leaves it); where the layout lists more (phi-2, cohere) the note says by
  how much; with no weights to read (config.json alone) nothing changes.
- gpt_neox (a fused query_key_value where a Llama has q_proj/v_proj), gpt2 (sizes named n_embd,
  n_layer), granitemoe (an MoE the planner cannot price): one line naming the family and the fix,
  nothing written that looks like a result.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HAS_MLX, HAS_TORCH, make_cfg
from families import VOCAB, build_family, reference_loss

from finetune import planner
from finetune.cli import run
from finetune.errors import UserError
from finetune.resolver import resolve

pytestmark = pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both torch+peft and mlx-lm")

FAST = ("train.steps=2", "train.warmup_steps=0", "train.eval_every=0", "train.progress=false",
        "data.num_samples=16", "train.batch_size=2", "train.grad_accum=1", "train.seq_len=128", "precision=32-true",
        "memory.sample_every=0")
APPROX = "is not a family finetune describes exactly"


def _cfg(run_dir: Path, name: str, backend: str, *extra: str) -> Any:
    return make_cfg(run_dir, f"model.path={build_family(name)}", f"backend={backend}", *FAST, *extra)


def _rows() -> tuple[np.ndarray, np.ndarray]:
    """Two rows of 24 tokens, the first 8 of each a prompt (out of the loss)."""
    ids = np.random.default_rng(3).integers(1, VOCAB, (2, 24)).astype(np.int64)
    mask = np.ones((2, 24), np.float32)
    mask[:, :8] = 0
    return ids, mask


# ---- the ones that train ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cuda", "mlx"])
@pytest.mark.parametrize("name", ["cohere", "phi"])
def test_undescribed_family_trains_and_says_the_plan_is_approximate(name: str, backend: str, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from finetune.run.loop import train

    with caplog.at_level(logging.WARNING, logger="finetune"):
        out = train(resolve(_cfg(tmp_path / "run", name, backend)))
    said = [r.getMessage() for r in caplog.records if APPROX in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"plan: model_type={name} ") and "(approximate)" in said[0], said
    unchecked = [r.getMessage() for r in caplog.records if "has not checked that it computes" in r.getMessage()]
    assert len(unchecked) == (backend == "mlx"), unchecked  # mlx-lm's module, unverified against transformers
    assert math.isfinite(out["final_train_loss"]) and out["steps"] == 2
    p = planner.plan(resolve(_cfg(tmp_path / "unused", name, backend)), recommend=False)
    assert any(APPROX in n for n in p["notes"])
    assert out["params_trainable"] == p["params_trainable"]  # q_proj/v_proj priced as the Llama's, which they are


@pytest.mark.parametrize("name", ["cohere", "phi"])
def test_undescribed_family_loss_is_the_models_own_torch(name: str, tmp_path: Path) -> None:
    import torch
    from finetune.backends.cuda import loss as loss_mod
    from finetune.backends.cuda.runtime import CudaBackend

    be = CudaBackend()
    be.setup(resolve(_cfg(tmp_path, name, "cuda")), build_family(name))
    ids, mask = _rows()
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.no_grad():
        want = reference_loss(be.model(input_ids=t_ids).logits.float().numpy(), ids, mask)
        got = float(loss_mod.token_loss_sum(be.model, t_ids, None, t_mask, 0, be._autocast))
    assert got == pytest.approx(want, rel=1e-5)
    # phi-2's logits are its head on its body's output, cohere's that times logit_scale: the head
    # on target rows (applying the scale), chunked too
    assert loss_mod.head_fallback(be.model) is None
    assert loss_mod.post_head(be.model) == (("logit_scale", 0.25) if name == "cohere" else None)
    with torch.no_grad():
        chunked = float(loss_mod.token_loss_sum(be.model, t_ids, None, t_mask, 7, be._autocast))
    assert chunked == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", ["cohere", "phi"])
def test_undescribed_family_loss_is_the_models_own_mlx(name: str, tmp_path: Path) -> None:
    import mlx.core as mx
    from finetune.backends.mlx import loss as loss_mod
    from finetune.backends.mlx.runtime import MlxBackend

    be = MlxBackend()
    be.setup(resolve(_cfg(tmp_path, name, "mlx")), build_family(name))
    ids, mask = _rows()
    m_ids, m_mask = mx.array(ids.astype(np.int32)), mx.array(mask)
    be.model.eval()
    logits = np.array(be.model(m_ids).astype(mx.float32))
    want = reference_loss(logits, ids, mask)
    # and mlx-lm's module computes what transformers does for these two (the run's warning says
    # this is unchecked in general; here it is checked)
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(build_family(name)), dtype=torch.float32).eval()
    with torch.no_grad():
        assert float(np.abs(hf(torch.from_numpy(ids)).logits.numpy() - logits).max()) < 1e-5
    got = float(loss_mod.token_loss_sum(be.model, m_ids, m_mask, 0))
    assert got == pytest.approx(want, rel=1e-5)
    assert loss_mod.head_fallback(be.model) is None
    assert loss_mod.post_head(be.model) == (("logit_scale", 0.25) if name == "cohere" else None)
    assert float(loss_mod.token_loss_sum(be.model, m_ids, m_mask, 7, grad=False)) == pytest.approx(want, rel=1e-5)


# ---- the ones refused -------------------------------------------------------------------------
REFUSED = [
    ("gpt_neox", "cuda", (), ["model_type=gpt_neox is not a family finetune describes exactly",
                              "q_proj, v_proj", "query_key_value", "use a model of a described family"]),
    ("gpt_neox", "mlx", (), ["mlx-lm", "cannot load model_type=gpt_neox", "ModelArgs", "use backend=cuda, or a "
                             "model of a described family"]),
    ("gpt2", "cuda", (), ["model_type=gpt2 is not a family finetune can describe", "no hidden_size",
                          "use a model of a described family"]),
    ("gpt2", "mlx", ("mode=plan",), ["model_type=gpt2 is not a family finetune can describe"]),
    ("granitemoe", "cuda", (), ["model_type=granitemoe is a mixture of experts", "use a model of a described family"]),
    ("granitemoe", "mlx", ("mode=plan",), ["model_type=granitemoe is a mixture of experts"]),
]


@pytest.mark.parametrize("name, backend, extra, needles", REFUSED,
                         ids=[f"{n}-{b}{'-plan' if e else ''}" for n, b, e, _ in REFUSED])
def test_undescribed_layout_is_refused_in_one_line(name: str, backend: str, extra: tuple[str, ...],
                                                   needles: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(UserError) as e:
        run(_cfg(run_dir, name, backend, *extra))
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    assert "without a plan" not in msg  # the old MoE message named a fix that did not exist
    names = {p.name for p in run_dir.rglob("*")} if run_dir.exists() else set()
    assert not names & {"summary.json", "adapter", "checkpoints", "plan.json"}, sorted(names)


# ---- the weights, against the checkpoint ------------------------------------------------------
def _plan(run_dir: Path, model_dir: Path, backend: str = "cuda") -> dict[str, Any]:
    return planner.plan(resolve(make_cfg(run_dir, f"model.path={model_dir}", f"backend={backend}", "method=full",
                                         "mode=plan")), recommend=False)


def _checkpoint_elements(model_dir: Path) -> int:
    """What transformers saves of the model: every parameter and persistent buffer, a tied
    weight once."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return sum(t.numel() for t in {v.data_ptr(): v for v in m.state_dict().values()}.values())


@pytest.mark.parametrize("backend", ["cuda", "mlx"])
def test_weights_the_layout_leaves_out_are_priced_from_the_checkpoint(backend: str, tmp_path: Path) -> None:
    d = build_family("gemma4_text")
    p = _plan(tmp_path / "run", d, backend)
    real = _checkpoint_elements(d)
    assert p["params_total"] == real  # the per-layer embeddings included, to the element
    note = next(n for n in p["notes"] if "safetensors headers" in n)
    assert f"its checkpoint holds {real:,} weights" in note and "more than the Llama-style layout lists" in note
    # without weights to read (config.json alone), the layout's count and no such note
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((d / "config.json").read_bytes())
    q = _plan(tmp_path / "run2", bare, backend)
    assert q["params_total"] < real / 2 and not any("safetensors headers" in n for n in q["notes"])
    assert any(APPROX in n for n in q["notes"])


@pytest.mark.parametrize("name, share", [("phi", "12%"), ("cohere", "under 1%")])
def test_a_layout_listing_more_than_the_checkpoint_says_by_how_much(name: str, share: str, tmp_path: Path) -> None:
    d = build_family(name)
    p = _plan(tmp_path / "run", d)
    real = _checkpoint_elements(d)
    assert p["params_total"] > real  # phi-2's plain MLP, cohere's single norm: the Llama-style layout lists more
    note = next(n for n in p["notes"] if "safetensors headers" in n)
    assert f"lists {p['params_total']:,} weights, its checkpoint holds {real:,}" in note
    assert f"priced {share} high" in note  # phi-2: 139,584 listed, 124,544 held; cohere: 128 of 106,688


def test_a_multimodal_checkpoints_language_model_is_priced_from_its_own_tensors(tmp_path: Path) -> None:
    """Qwen3.5 (Qwen3_5ForConditionalGeneration): its text model (linear-attention layers beside
    full ones) priced from the checkpoint's language-model tensors, to the element of what the
    run loads (load_causal_lm), the vision tower's weights not among them."""
    from families import build_multimodal

    from finetune.model.source import load_causal_lm

    d = build_multimodal("qwen3_5")
    p = _plan(tmp_path / "run", d)
    m = load_causal_lm(d)
    loaded = sum(t.numel() for t in {v.data_ptr(): v for v in m.state_dict().values()}.values())
    assert p["params_total"] == loaded
    note = next(n for n in p["notes"] if "safetensors headers" in n)
    assert f"its checkpoint holds {loaded:,} weights ({d}, its language model" in note
