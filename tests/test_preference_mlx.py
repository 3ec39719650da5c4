"""Preference objectives on backend=mlx (backends/mlx/preference.py): the cuda backend's step
losses and TRL-named metrics from the same adapter weights (converted with finetune-export) and
the same pairs; ln 2 at step 1; a step split by whole pairs keeps loss and gradients; the
reference is the base with the adapters off (LoRA, DoRA, an MoE's expert adapters); DPO equals
mlx-lm-lora's DPO loss and gradients."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_spec, needs_mlx, needs_torch

pytestmark = [needs_mlx, needs_torch, pytest.mark.mlx]

TOL = 1e-4  # fp32 on both backends; measured: losses within 2.4e-5 (ipo, loss ~22), metrics 2.3e-5
STEPS = 3
PAIRS_A_STEP = 4


def _pairs(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i} + {i}?\nAnswer:\n", "chosen": f"{i} + {i} = {2 * i}\n#### {2 * i}",
             "rejected": f"{i} + {i} = {2 * i}\n#### -{2 * i + 1}"} for i in range(1, n + 1)]


def _source(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    from finetune.data.pairs import PairSource
    from finetune.data.tokens import tokenize

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return PairSource(tokenize(_pairs(2 * PAIRS_A_STEP), tok, 128, True, pairs=True), tok.pad_token_id,
                      PAIRS_A_STEP, 0, 0.0, 0)


@pytest.fixture(scope="module")
def qwen2() -> Path:
    from finetune.config import Config
    from finetune.model.tiny import build_tiny

    return build_tiny(Config(run_dir="unused").model)  # the default tiny model: Qwen2


def _mlx(tmp: Path, model_dir: Path, *overrides: str) -> Any:
    from finetune.backends.mlx.runtime import MlxBackend

    be = MlxBackend()
    be.setup(make_spec(tmp, "backend=mlx", "precision=32-true", f"model.path={model_dir}", *overrides), model_dir)
    return be


def _cuda_and_mlx(tmp: Path, model_dir: Path, overrides: tuple[str, ...]) -> tuple[Any, Any]:
    """Both backends on ``model_dir``; the mlx one holding the cuda one's adapter, converted."""
    import mlx.core as mx
    from finetune.backends.cuda.runtime import CudaBackend

    from finetune.export import convert

    cb = CudaBackend()
    cb.setup(make_spec(tmp, "backend=cuda", "backend.device=cpu", "precision=32-true", f"model.path={model_dir}",
                       *overrides), model_dir)
    mb = _mlx(tmp, model_dir, *overrides)
    if "method=full" not in overrides:  # full: both start from the checkpoint itself
        cb.save_adapter(tmp / "peft")
        convert(tmp / "peft", tmp / "mlx", "mlx")
        mb.model.load_weights(str(tmp / "mlx" / "adapters.safetensors"), strict=False)
        mx.eval(mb.model.parameters())
    return cb, mb


def _steps(be: Any, src: Any, lr: float, micro_pairs: int = 2) -> list[Any]:
    """STEPS optimizer steps as the loop runs them (finetune/run/loop.py ``_pair_step``): each
    step's pairs in micro-batches of ``micro_pairs`` whole pairs; the step's PairSums."""
    from finetune.data.pairs import pair_counts
    from finetune.objectives import PairSums

    be.precompute_reference(src.all_batches(PAIRS_A_STEP), len(src.samples.ids))  # method=full only
    out = []
    for step in range(STEPS):
        batch = src.train_batch(step)
        pairs, chosen = pair_counts(batch)
        sums = PairSums()
        for micro in batch.split(2 * micro_pairs):
            sums = sums.add(be.forward_backward_pairs(micro, 1 / pairs, 1 / chosen))
        be.optimizer_step(lr)
        out.append(sums)
    return out


# (overrides, step 1's loss where the policy is its reference: DPO's ln 2, IPO's (1 / (2 beta))^2,
# hinge's 1; None: ORPO and SimPO, which have no reference)
CASES = {
    "dpo": (("objective=dpo",), math.log(2)),
    "ipo": (("objective=dpo", "objective.loss_type=ipo"), (1 / (2 * 0.1)) ** 2),
    "hinge-llama": (("objective=dpo", "objective.loss_type=hinge"), 1.0),  # on a second family
    "cdpo": (("objective=dpo", "objective.label_smoothing=0.1"), math.log(2)),
    "orpo": (("objective=orpo",), None),
    "simpo": (("objective=simpo",), None),
    "dpo-dora": (("objective=dpo", "method=dora"), math.log(2)),
    "dpo-full": (("objective=dpo", "method=full"), math.log(2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mlx_steps_equal_cuda_steps(case: str, qwen2: Path, tmp_path: Path) -> None:
    from families import build_family

    overrides, first = CASES[case]
    model_dir = build_family("llama") if case.endswith("llama") else qwen2
    src = _source(model_dir)
    cb, mb = _cuda_and_mlx(tmp_path, model_dir, overrides)
    lr = 1e-3 if "method=full" in overrides else 1e-2  # enough to move the policy off its reference
    cuda, mlx = _steps(cb, src, lr), _steps(mb, src, lr)
    if first is not None:
        assert mlx[0].loss == pytest.approx(first, abs=1e-6) and cuda[0].loss == pytest.approx(first, abs=1e-6)
    assert mlx[-1].loss != pytest.approx(mlx[0].loss, abs=1e-3)  # it trained: later steps differ
    diffs = [abs(c.loss - m.loss) for c, m in zip(cuda, mlx)]
    print(f"{case}: max |cuda - mlx| step loss {max(diffs):.3g}")  # -s shows the figures
    assert max(diffs) < TOL, f"{case}: |cuda - mlx| per step {diffs}"
    for c, m in zip(cuda, mlx):
        assert set(m.metrics()) == {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                                    "logps/chosen", "logps/rejected"}
        assert m.metrics() == pytest.approx(c.metrics(), abs=TOL)


def _kto(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i} + {i}?\nAnswer:\n",
             "completion": f"{i} + {i} = {2 * i}\n#### {2 * i if i % 2 else 2 * i + 1}", "label": bool(i % 2)}
            for i in range(1, n + 1)]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_mlx_kto_steps_equal_cuda_steps(family: str, qwen2: Path, tmp_path: Path) -> None:
    """KTO (objective=kto, LoRA) as the loop runs it (finetune/run/loop.py ``_unpaired_step``):
    z0 once a step over the step's mismatched rows, then the step's records in micro-batches of
    2; from the same adapter, each step's loss, z0 and metrics on mlx equal cuda's; a step split
    into one record a micro-batch keeps the loss (the same z0)."""
    from families import build_family
    from transformers import AutoTokenizer

    from finetune.data.pairs import UnpairedSource
    from finetune.data.tokens import tokenize
    from finetune.objectives import PairSums

    model_dir = build_family("llama") if family == "llama" else qwen2
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    src = UnpairedSource(tokenize(_kto(12), tok, 128, True, unpaired=True), tok.pad_token_id, 4, 0, 0.0, 0, 1, 128)
    cb, mb = _cuda_and_mlx(tmp_path, model_dir, ("objective=kto",))
    out: dict[str, list[PairSums]] = {}
    for name, be in (("cuda", cb), ("mlx", mb)):
        out[name] = []
        for step in range(STEPS):
            batch = src.train_batch(step)
            records = len(batch.lengths)
            kl = be.kto_kl(src.kl_batch(batch), 2)
            sums = PairSums()
            for micro in batch.split(2):
                sums = sums.add(be.forward_backward_unpaired(micro, 1 / records, kl))
            if step == STEPS - 1:  # the last step again, one record a micro-batch: the same loss
                be.zero_grad()
                one = PairSums()
                for micro in batch.split(1):
                    one = one.add(be.forward_backward_unpaired(micro, 1 / records, be.kto_kl(src.kl_batch(batch), 1)))
                assert one.loss == pytest.approx(sums.loss, abs=1e-6), name
            be.optimizer_step(1e-2)
            out[name].append(sums)
    cuda, mlx = out["cuda"], out["mlx"]
    assert mlx[-1].loss != pytest.approx(mlx[0].loss, abs=1e-4)  # it trained
    assert max(m.kl for m in mlx) > 0  # z0 moved off 0 as the policy left the reference
    diffs = [abs(c.loss - m.loss) for c, m in zip(cuda, mlx)]
    print(f"kto {family}: max |cuda - mlx| step loss {max(diffs):.3g}")
    assert max(diffs) < TOL, diffs
    for c, m in zip(cuda, mlx):
        assert m.kl == pytest.approx(c.kl, abs=TOL)
        assert m.metrics() == pytest.approx(c.metrics(), abs=TOL, nan_ok=True)


@pytest.mark.parametrize("method, more", [("lora", ()), ("full", ()), ("qlora", ("train.grad_checkpointing=true",))])
def test_split_by_whole_pairs_keeps_loss_metrics_and_gradients(method: str, more: tuple[str, ...], qwen2: Path,
                                                               tmp_path: Path) -> None:
    """The governor's split (finetune/run/loop.py: micro-batches of whole pairs, each scaled by
    the step's 1 / pairs) gives the unsplit step on mlx; step 1 is ln 2 (QLoRA's reference: the
    quantized base)."""
    from mlx.utils import tree_flatten

    from finetune.data.pairs import pair_counts
    from finetune.objectives import PairSums

    src = _source(qwen2)
    be = _mlx(tmp_path, qwen2, "objective=dpo", f"method={method}", *more)
    be.precompute_reference(src.all_batches(PAIRS_A_STEP), len(src.samples.ids))
    batch = src.train_batch(0)
    pairs, chosen = pair_counts(batch)
    whole = be.forward_backward_pairs(batch, 1 / pairs, 1 / chosen)
    g1 = dict(tree_flatten(be._grads))
    be.zero_grad()
    split = PairSums()
    for micro in batch.split(2):  # one pair a micro-batch
        split = split.add(be.forward_backward_pairs(micro, 1 / pairs, 1 / chosen))
    g2 = dict(tree_flatten(be._grads))
    assert whole.loss == pytest.approx(math.log(2), abs=1e-6)
    assert split.loss == pytest.approx(whole.loss, abs=1e-6) and split.pairs == whole.pairs == PAIRS_A_STEP
    assert split.metrics() == pytest.approx(whole.metrics(), abs=1e-5)
    assert g1.keys() == g2.keys() and any(float(np.abs(np.array(v)).max()) > 0 for v in g1.values())
    assert all(np.allclose(np.array(g1[k]), np.array(g2[k]), atol=1e-6) for k in g1)


@pytest.mark.parametrize("family, overrides", [
    ("qwen2", ("method=dora",)),
    ("mixtral", ("method=lora", "method.lora.keys=[q_proj,v_proj,experts]")),  # LoRASwitchLinear too
])
def test_reference_is_the_base_with_adapters_off(family: str, overrides: tuple[str, ...], qwen2: Path,
                                                 tmp_path: Path) -> None:
    """adapters_off's log-probs equal the checkpoint's own (method=full, nothing added) even
    where the adapters are far from zero, and the adapters are back in place after."""
    import mlx.core as mx
    from families import build_family
    from finetune.backends.mlx.preference import adapters_off, row_logps
    from mlx.utils import tree_flatten

    model_dir = qwen2 if family == "qwen2" else build_family(family)
    batch = _source(model_dir).train_batch(0)
    be = _mlx(tmp_path, model_dir, "objective=dpo", *overrides)
    mx.random.seed(1)
    trained = [(k, mx.random.normal(v.shape) * 0.5) for k, v in tree_flatten(be.model.trainable_parameters())]
    be.model.load_weights(trained, strict=False)  # lora_a, lora_b (and DoRA's m): far from their start
    ids, mask = be._arrays(batch)
    policy = np.array(row_logps(be.model, ids, mask)[0])
    with adapters_off(be.model) as swapped:
        off = np.array(row_logps(be.model, ids, mask)[0])
    assert swapped >= 4  # two layers' q_proj and v_proj at least
    base = np.array(row_logps(_mlx(tmp_path, model_dir, "method=full").model, ids, mask)[0])
    assert np.abs(off - base).max() < 1e-4 and np.abs(policy - base).max() > 1e-2
    assert np.array_equal(np.array(row_logps(be.model, ids, mask)[0]), policy)  # put back


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_equals_mlx_lm_lora(loss_type: str, qwen2: Path, tmp_path: Path) -> None:
    """mlx-lm-lora's DPO (trainer/dpo_trainer.py: get_token_scores, compute_score, dpo_loss; its
    reference a second copy of the base, as its train.py loads one) on the same model, adapter
    and pairs: the same loss and the same gradients."""
    lora = pytest.importorskip("mlx_lm_lora.trainer.dpo_trainer")
    import mlx.core as mx
    from finetune.backends.mlx.hfconfig import model_config
    from mlx import nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from finetune.data.pairs import pair_counts

    batch = _source(qwen2).train_batch(0)
    be = _mlx(tmp_path, qwen2, "objective=dpo", f"objective.loss_type={loss_type}")
    mx.random.seed(2)
    be.model.load_weights([(k, mx.random.normal(v.shape) * 0.3) for k, v in
                           tree_flatten(be.model.trainable_parameters())], strict=False)
    pairs, chosen = pair_counts(batch)
    ours = be.forward_backward_pairs(batch, 1 / pairs, 1 / chosen)
    ref, _ = load(str(qwen2), model_config=model_config(qwen2, seq_len=128))
    ref.set_dtype(mx.float32)
    ids, mask = be._arrays(batch)
    c, r, cm, rm = ids[0::2], ids[1::2], mask[0::2], mask[1::2]

    def theirs(c: mx.array, r: mx.array, cm: mx.array, rm: mx.array) -> mx.array:
        score = lambda m, x, xm: lora.compute_score(lora.get_token_scores(m, x, xm), xm, loss_type)
        return lora.dpo_loss(score(be.model, c, cm), score(be.model, r, rm), mx.stop_gradient(score(ref, c, cm)),
                             mx.stop_gradient(score(ref, r, rm)), cm, rm, beta=0.1, delta=0.0,
                             loss_type=loss_type)[0]

    loss, grads = nn.value_and_grad(be.model, theirs)(c, r, cm, rm)
    assert abs(float(loss) - ours.loss) < TOL and float(loss) > 0
    print(f"mlx-lm-lora {loss_type}: |theirs - ours| {abs(float(loss) - ours.loss):.3g}")
    mine = dict(tree_flatten(be._grads))
    for k, g in tree_flatten(grads):
        assert np.allclose(np.array(g), np.array(mine[k]), atol=1e-5), k



def test_the_loop_trains_dpo_on_mlx_as_on_cuda(tmp_path: Path) -> None:
    """finetune's loop (finetune/run/loop.py train) on both backends, method=full (both start
    from the checkpoint; the reference a table precomputed before step 1), the same pairs file:
    metrics.jsonl's step losses and TRL-named metrics agree, and validation's; step 1 is ln 2."""
    import json

    from finetune.run.loop import train

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in _pairs(24)))
    steps, evals = {}, {}
    for backend in ("cuda", "mlx"):
        extra = ("backend.device=cpu",) if backend == "cuda" else ()
        summary = train(make_spec(tmp_path / backend, f"backend={backend}", *extra, "objective=dpo", "method=full",
                                  "precision=32-true", f"data.path={data}", "train.steps=3", "train.eval_every=3",
                                  "data.val_fraction=0.2",
                                  "train.batch_size=2", "train.grad_accum=2", "train.seq_len=64",
                                  "train.warmup_steps=0", "optim.lr=1e-4"))
        assert summary["reference_table_bytes"] == 4 * 2 * 24  # one fp32 a sample, two samples a pair
        lines = (tmp_path / backend / "metrics.jsonl").read_text().splitlines()
        steps[backend] = [r for r in map(json.loads, lines) if "loss" in r]
        evals[backend] = summary["pair_metrics"]["eval"]
    cuda, mlx = steps["cuda"], steps["mlx"]
    assert [r["step"] for r in mlx] == [1, 2, 3] and mlx[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert mlx[-1]["loss"] < mlx[0]["loss"] - 1e-3
    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")
    for c, m in zip(cuda, mlx):
        assert m["loss"] == pytest.approx(c["loss"], abs=TOL)
        assert [m[k] for k in names] == pytest.approx([c[k] for k in names], abs=TOL)
    assert set(evals["mlx"]) == {"eval_" + k for k in names}  # validation, as TRL names it
    assert all(isinstance(v, float) for v in evals["mlx"].values())
    assert evals["mlx"] == pytest.approx(evals["cuda"], abs=TOL)
