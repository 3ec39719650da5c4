"""train.activation_offload (backends/cuda/offload.py): the same losses and gradients as without
it, and the bytes its hooks move equal to the plan's transfer volume; mlx refuses it in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import make_cfg, make_spec, needs_torch
from finetune import planner
from finetune.errors import UserError
from finetune.resolver import resolve

B, T = 3, 40


def _step(cfg: Any, model_dir: Path, offload: bool) -> tuple[float, list[Any], int | None, Any]:
    """One forward/backward of a fixed batch: (loss, gradients, bytes the hooks moved, plan)."""
    from test_planner import _fixed_batch

    from finetune.backends.cuda.runtime import CudaBackend

    be = CudaBackend()
    be.setup(resolve(cfg), model_dir)
    loss = be.forward_backward(_fixed_batch(cfg.model.config.vocab_size if cfg.model.config else 512, B, T), 1.0)
    grads = [p.grad.detach().clone() for p in be.model.parameters() if p.grad is not None]
    moved = be.offloaded_bytes()
    p = planner.plan(resolve(cfg), seq_len=T, recommend=False)
    return loss, grads, moved, p


# (model, overrides): the tiny Qwen2 with LoRA, checkpointing and QLoRA; a Llama and an MoE (Mixtral)
CASES = [("tiny", ()), ("tiny", ("train.grad_checkpointing=true",)), ("tiny", ("method=qlora",)),
         ("llama", ()), ("mixtral", ("train.grad_checkpointing=true",))]


@needs_torch
@pytest.mark.parametrize("model,over", CASES, ids=["qwen2-lora", "qwen2-ckpt", "qwen2-qlora", "llama", "mixtral-ckpt"])
def test_offload_keeps_the_math_and_moves_what_the_plan_says(model, over, tmp_path):
    """With the offload the loss and every gradient are bit-for-bit those without it; its hooks
    moved (to the host and back) what the plan's transfer volume a micro-batch says, within the
    activation model's 3% (tests/test_planner.py: its saved tensors against torch's)."""
    import torch

    from finetune.model.source import resolve_model_dir

    if model == "tiny":
        base = ("backend=cuda", f"train.batch_size={B}", f"train.seq_len={T}", *over)
    else:
        from families import build_family

        base = ("backend=cuda", f"model.path={build_family(model)}", f"train.batch_size={B}", f"train.seq_len={T}",
                "precision=32-true", *over)
    off_cfg = make_cfg(tmp_path, *base, "train.activation_offload=true")
    model_dir = resolve_model_dir(off_cfg.model) if model == "tiny" else Path(off_cfg.model.path)
    loss0, grads0, moved0, plan0 = _step(make_cfg(tmp_path, *base), model_dir, False)
    loss1, grads1, moved1, plan1 = _step(off_cfg, model_dir, True)
    assert moved0 is None and plan0["activation_offload"] is None
    assert loss1 == loss0
    assert len(grads1) == len(grads0) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    off = plan1["activation_offload"]
    assert moved1 == pytest.approx(off["transfer_bytes_per_micro_batch"], rel=0.03), (moved1, off)
    # the device keeps less, the host holds what moved, and the step's volume is the micro-batches'
    assert off["device_saving_bytes"] > 0
    assert plan1["bytes"]["activations"] == plan0["bytes"]["activations"] - off["device_saving_bytes"]
    assert off["transfer_bytes_per_step"] == off["transfer_bytes_per_micro_batch"] * plan1["grad_accum"]
    assert plan1["phases"]["steady"]["host_bytes"] - plan0["phases"]["steady"]["host_bytes"] \
        == off["host_bytes"] - off["device_saving_bytes"]  # the CPU's host holds both: only the copy is new
    if "train.grad_checkpointing=true" in over:  # each checkpointed layer's input, and the final norm's
        arch, s = planner.resolve(resolve(off_cfg), seq_len=T)
        assert off["bytes_per_micro_batch"] == (arch.layers * B * T * arch.hidden + B * T * arch.hidden) * 4
        assert moved1 == 2 * off["bytes_per_micro_batch"]


def test_mlx_refuses_activation_offload_in_one_line(tmp_path):
    """On mlx memory is unified: no host to offload to, said in one line naming the fix."""
    pytest.importorskip("mlx.core")
    with pytest.raises(UserError) as e:
        make_spec(tmp_path, "backend=mlx", "train.activation_offload=true")
    msg = str(e.value)
    assert "\n" not in msg and "unified" in msg and "train.activation_offload=false" in msg


COMMON = ("backend=cuda", "train.progress=false", "data.num_samples=200", "train.eval_every=0", "train.steps=4",
          "train.warmup_steps=1", "train.batch_size=4")


def _run_lines(run: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


@needs_torch
def test_governor_takes_offload_after_the_cheaper_levers_with_unchanged_losses(tmp_path):
    """A budget between the plan at micro-batch 1 with checkpointing and the same with activation
    offload (the data's own lengths, as the run plans them): the run lowers the micro-batch,
    turns checkpointing on, then offload, in that order, each event saying why, and trains
    the losses of the run without a budget."""
    from transformers import AutoTokenizer

    from finetune.model.source import resolve_model_dir
    from finetune.run.loop import train
    from finetune.run.state import RunState

    spec = make_spec(tmp_path / "free", *COMMON)
    _, stats = __import__("finetune.data", fromlist=["build"]).build(
        spec, AutoTokenizer.from_pretrained(str(resolve_model_dir(make_cfg(tmp_path / "free", *COMMON).model))))
    at = {"seq_len": stats["max_padded_tokens"], "head_fraction": stats.get("head_fraction"), "recommend": False}
    base = RunState("cuda", 1, 4, True)
    ckpt = planner.plan(spec, state=base, **at)["fits_bytes"]
    off = planner.plan(spec, state=base.with_(activation_offload=True), **at)["fits_bytes"]
    assert off < ckpt, (off, ckpt)
    budget = (off + ckpt) // 2
    free = train(spec)
    adapted = train(make_spec(tmp_path / "tight", *COMMON, f"memory.budget={budget}"))
    actions = [ev["action"] for ev in adapted["adaptations"]]
    assert actions[-3:] == ["lower_micro_batch", "enable_grad_checkpointing", "enable_activation_offload"], actions
    assert all(ev.get("reason") for ev in adapted["adaptations"][-3:])
    assert adapted["effective_batch"] == free["effective_batch"] == 4
    lines = _run_lines(tmp_path / "tight")
    assert all(ln["offload_moved_bytes"] > 0 for ln in lines)
    assert "offload_moved_bytes" not in _run_lines(tmp_path / "free")[0]
    assert [ln["loss"] for ln in lines] == pytest.approx([ln["loss"] for ln in _run_lines(tmp_path / "free")], abs=1e-5)
