"""Packed micro-batches (train.packing) on both backends, on the built-in tiny Qwen2 (hidden 64,
2 layers, vocab 512).

Asserted:
- ``pack`` keeps the samples and their order, restarts positions per sample, computes no pad
  and keeps the label tokens (so the loop's scale, 1 / label tokens of the step, is unchanged);
  ``fit_to_micro`` truncates or splits a sample longer than tokens_per_micro, split keeping
  every target exactly once.
- packed equals unpacked: the loss sum and every trained parameter's gradient of one step,
  through each backend's own ``forward_backward``, packed into one row or into several
  micro-batches, with the whole and the chunked loss (and, on mlx, gradient checkpointing,
  whose backward recomputes the packed forward).
- no attention crosses a sample boundary: changing every token of a sample without targets
  leaves the loss of the samples packed after it unchanged, while the same row run as one
  sequence (a planted dependency: positions 0..N-1, plain causal attention) changes it.
- the governor's lever under packing: a planted OOM for packed rows above 160 tokens lowers
  tokens_per_micro; the run trains the same samples in the same order to the same losses as a
  run packed small from the start, and as the unpacked run.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import cuda_backend_with_oom, needs_mlx, needs_torch
import warm_cli
from finetune.backends.base import Batch, pack

from finetune.run import loop as loop_mod
from finetune.config import Config, ModelConfig
from finetune.data import Tokenized
from finetune.data.batches import fit_to_micro, packed_widths
from finetune.run.loop import train
from finetune.resolver import resolve
from finetune.model.tiny import build_tiny

LENGTHS = (57, 40, 23, 9)  # real tokens per sample: 129 in all


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny(ModelConfig())


def make_batch(seed: int = 3) -> Batch:
    """Four samples, right-padded to 57: a 5-token prompt out of the loss in the first two,
    every token a target in the others."""
    rng = np.random.default_rng(seed)
    t = max(LENGTHS)
    ids = np.zeros((len(LENGTHS), t), np.int32)
    mask = np.zeros((len(LENGTHS), t), np.int8)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = rng.integers(1, 512, n)
        mask[i, 5 if i < 2 else 0 : n] = 1
    return Batch(ids, mask, np.array(LENGTHS, np.int32), np.arange(len(LENGTHS)))


def assert_grads_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys() and want
    for name, w in want.items():
        scale = float(np.abs(w).max()) or 1.0
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


# ---- the packer -------------------------------------------------------------------------------
def test_pack_keeps_samples_order_and_label_tokens() -> None:
    batch = make_batch()
    for tokens, want_rows in ((1000, [[0, 1, 2, 3]]), (100, [[0, 1], [2, 3]]), (60, [[0], [1], [2, 3]]),
                              (30, [[0], [1], [2], [3]])):
        parts = pack(batch, tokens)
        assert [list(p.indices) for p in parts] == want_rows, tokens
        assert sum(p.label_tokens for p in parts) == batch.label_tokens  # the loop's scale is unchanged
        assert sum(p.tokens for p in parts) == batch.tokens == sum(LENGTHS)  # no pad
        assert sum(p.samples for p in parts) == len(LENGTHS)
        for k, p in enumerate(parts):
            # every micro-batch but the step's last is filled to `tokens` with pads (a lone
            # longer sample is its own width); the last holds what is left
            width = p.tokens if k == len(parts) - 1 else max(tokens, p.tokens)
            assert p.input_ids.shape == p.position_ids.shape == p.loss_mask.shape == (1, width)
            starts = np.flatnonzero(p.position_ids[0, : p.tokens] == 0)
            assert list(np.diff(np.r_[starts, p.tokens])) == [LENGTHS[i] for i in p.indices]
            assert not p.loss_mask[0, starts].any()  # a sample's first token is no target
            # the pads: a segment of their own (positions from 0), out of the loss
            assert list(p.position_ids[0, p.tokens:]) == list(range(width - p.tokens))
            assert not p.loss_mask[0, p.tokens:].any() and not p.input_ids[0, p.tokens:].any()
        assert list(packed_widths(np.array(LENGTHS), tokens)) == [p.input_ids.shape[1] for p in parts]
    one = pack(batch, 1000)[0]
    np.testing.assert_array_equal(one.input_ids[0], np.concatenate([batch.input_ids[i, :n] for i, n in enumerate(LENGTHS)]))


def test_fit_to_micro_truncates_or_splits_once() -> None:
    ids = [np.arange(1, 26, dtype=np.int32), np.arange(1, 8, dtype=np.int32)]
    masks = [np.r_[np.zeros(3, np.int8), np.ones(22, np.int8)], np.ones(7, np.int8)]
    tok = Tokenized(ids, masks, 0, 0, 25, 2)
    cut, n = fit_to_micro(tok, 10, "truncate")
    assert n == 1 and [len(x) for x in cut.ids] == [10, 7]
    split, n = fit_to_micro(tok, 10, "split")
    assert n == 1 and [len(x) for x in split.ids] == [10, 10, 7, 7]
    # every target of the long sample is trained once: a piece's first token is its context only
    targets = [int(t) for x, m in zip(split.ids[:3], split.masks[:3]) for t, w in zip(x[1:], m[1:]) if w]
    assert targets == list(range(4, 26))
    assert fit_to_micro(tok, 25, "split")[0] is tok


# ---- torch (backend=cuda, on the CPU here) ----------------------------------------------------
def torch_backend(model_dir: Path, chunk: int = 0) -> Any:
    from finetune.backends.cuda.runtime import CudaBackend
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.backend.name, cfg.backend.device = "cuda", "cpu"
    cfg.method.name, cfg.precision.name = "full", "32-true"
    cfg.train.loss_chunk = chunk
    be = CudaBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        be.setup(resolve(cfg), model_dir)
    return be


def torch_step(be: Any, parts: list[Batch]) -> tuple[float, dict[str, np.ndarray]]:
    be.zero_grad()
    loss = sum(be.forward_backward(p, 1.0) for p in parts)
    grads = {n: p.grad.detach().numpy().copy() for n, p in be.model.named_parameters() if p.grad is not None}
    be.zero_grad()
    return loss, grads


@needs_torch
@pytest.mark.parametrize("chunk", [0, 16])
def test_torch_packed_equals_unpacked(model_dir: Path, chunk: int) -> None:
    be = torch_backend(model_dir, chunk)
    batch = make_batch()
    want_loss, want = torch_step(be, [batch])
    for tokens in (1000, 60):
        loss, grads = torch_step(be, pack(batch, tokens))
        assert loss == pytest.approx(want_loss, rel=1e-5), tokens
        assert_grads_equal(grads, want)
    assert be.eval_loss(pack(batch, 1000)[0]) == pytest.approx(want_loss, rel=1e-5)


def _no_targets_first(batch: Batch, seed: int) -> Batch:
    """``batch`` with sample 0's tokens redrawn and out of the loss: only what follows it counts."""
    ids, mask = batch.input_ids.copy(), batch.loss_mask.copy()
    ids[0, : LENGTHS[0]] = np.random.default_rng(seed).integers(1, 512, LENGTHS[0])
    mask[0] = 0
    return Batch(ids, mask, batch.lengths, batch.indices)


def _as_one_sequence(p: Batch) -> Batch:
    """The planted dependency: the packed row as one sample (positions 0..N-1), so each token
    attends to every earlier one, across sample boundaries; its loss mask unchanged."""
    return Batch(p.input_ids, p.loss_mask, p.lengths, p.indices,
                 position_ids=np.arange(p.tokens, dtype=np.int32)[None])


def _boundary_check(step: Any) -> None:
    a, b = (pack(_no_targets_first(make_batch(), s), 1000)[0] for s in (1, 2))
    loss = step(a)
    assert abs(step(b) - loss) <= 1e-6 * loss  # sample 0 reaches no other sample
    # a random-init tiny model's attention moves the loss little: the planted dependency
    # measured 1.2e-4 of the loss on torch, over 100 x what packing leaves
    assert abs(step(_as_one_sequence(a)) - step(_as_one_sequence(b))) > 2e-5 * loss


@needs_torch
def test_torch_no_attention_across_samples(model_dir: Path) -> None:
    be = torch_backend(model_dir)
    _boundary_check(lambda p: torch_step(be, [p])[0])


# ---- mlx ----------------------------------------------------------------------------------------
def mlx_backend(model_dir: Path, chunk: int = 0, checkpointing: bool = False) -> Any:
    from finetune.backends.mlx.runtime import MlxBackend
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.backend.name, cfg.method.name = "mlx", "full"
    cfg.train.loss_chunk, cfg.train.grad_checkpointing = chunk, checkpointing
    be = MlxBackend()
    be.setup(resolve(cfg), model_dir)
    return be


def mlx_step(be: Any, parts: list[Batch]) -> tuple[float, dict[str, np.ndarray]]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    be.zero_grad()
    loss = sum(be.forward_backward(p, 1.0) for p in parts)
    grads = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(be._grads)}
    be.zero_grad()
    return loss, grads


@needs_mlx
@pytest.mark.parametrize("chunk,checkpointing", [(0, False), (16, False), (0, True)])
def test_mlx_packed_equals_unpacked(model_dir: Path, chunk: int, checkpointing: bool) -> None:
    be = mlx_backend(model_dir, chunk, checkpointing)
    batch = make_batch()
    want_loss, want = mlx_step(be, [batch])
    for tokens in (1000, 60):
        loss, grads = mlx_step(be, pack(batch, tokens))
        assert loss == pytest.approx(want_loss, rel=1e-5), tokens
        assert_grads_equal(grads, want)
    assert be.eval_loss(pack(batch, 1000)[0]) == pytest.approx(want_loss, rel=1e-5)
    assert not any("rope" in vars(m) for _, m in be.model.named_modules())  # the RoPE wrappers are gone again


@needs_mlx
def test_mlx_no_attention_across_samples(model_dir: Path) -> None:
    be = mlx_backend(model_dir)
    _boundary_check(lambda p: mlx_step(be, [p])[0])


# ---- the governor's lever under packing --------------------------------------------------------
COMMON = ("backend=cuda", "train.progress=false", "data.num_samples=120", "train.eval_every=0", "train.steps=5",
          "train.warmup_steps=1", "train.batch_size=8", "train.seq_len=64", "train.packing=true")


def _steps(run: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


@needs_torch
def test_governor_lowers_tokens_per_micro_keeping_the_math(cfg_factory, tmp_path: Path, monkeypatch) -> None:
    """Rows above 160 tokens run out of memory from step 3 on: the governor halves 512 to 256,
    then 128; the losses equal those of a run packed at 128 from the start and of the unpacked
    run (the same samples, in the same order)."""
    monkeypatch.setattr(loop_mod, "get_backend",
                        lambda name: cuda_backend_with_oom(lambda be, ids: be.steps_done >= 2 and ids.shape[1] > 160))
    adapted = train(resolve(cfg_factory(*COMMON, run_dir=tmp_path / "oom")))
    monkeypatch.undo()
    small = train(resolve(cfg_factory(*COMMON, "train.tokens_per_micro=128", run_dir=tmp_path / "small")))
    unpacked = train(resolve(cfg_factory(*COMMON[:-1], run_dir=tmp_path / "unpacked")))
    ev = [(e["step"], e["action"], e["before"], e["after"]) for e in adapted["adaptations"]]
    assert ev == [(3, "lower_tokens_per_micro", {"tokens_per_micro": 512}, {"tokens_per_micro": 256}),
                  (3, "lower_tokens_per_micro", {"tokens_per_micro": 256}, {"tokens_per_micro": 128})]
    got = [s["loss"] for s in _steps(tmp_path / "oom")]
    assert got == pytest.approx([s["loss"] for s in _steps(tmp_path / "small")], rel=1e-5)
    assert got == pytest.approx([s["loss"] for s in _steps(tmp_path / "unpacked")], rel=1e-5)
    assert adapted["tokens"] == small["tokens"] == unpacked["tokens"]


# ---- memory in tokens: the plan against MLX's measured peak, step by step -----------------------
@pytest.fixture(scope="module")
def packed_peaks(tmp_path_factory: Any) -> tuple[int, list[int], list[int]]:
    """(planned peak, measured peak of each step, widest packed micro-batch of each step) of
    eight optimizer steps of 32 samples of 12-40 tokens (a 4-token prompt out of the loss;
    ``train.seq_len=40``, the cut that bounds a packed row's longest sample) packed to 512
    tokens per micro-batch (about 20 samples each: real micro-batches hold dozens), on the tiny
    model with MLX; the plan at the widest packed micro-batch of the steps (finetune/data/batches.py
    packed_widths, what mode=train plans). Measured in a fresh process, as
    tests/test_planner.py's MLX peaks are. Attention runs per sample, so its scores follow the
    samples' squares; the plan prices the data's most per micro-batch (``pair_span``, as
    mode=train and mode=plan do)."""
    import sys

    repo = Path(__file__).resolve().parents[1]
    script = f"""
import json
import numpy as np
import mlx.core as mx
from finetune.backends.base import Batch, pack
from finetune.backends.mlx.runtime import MlxBackend
from finetune.config import compose
from finetune.data.batches import packed_pair_span, packed_widths
from finetune.model.source import resolve_model_dir
from finetune.resolver import resolve
from finetune import planner
cfg = compose({str(tmp_path_factory.mktemp("peaks"))!r}, "backend=mlx", "train.packing=true",
              "train.tokens_per_micro=512", "train.batch_size=32", "train.seq_len=40")
be = MlxBackend()
be.setup(resolve(cfg), resolve_model_dir(cfg.model))
rng = np.random.default_rng(0)
peaks, widths, spans = [], [], []
for step in range(8):
    lengths = rng.integers(12, 41, 32).astype(np.int32)
    ids = np.zeros((32, 40), np.int32); mask = np.zeros((32, 40), np.int8)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, 512, n); mask[i, 4:n] = 1
    batch = Batch(ids, mask, lengths)
    widths.append(int(packed_widths(lengths, 512).max()))
    spans.append(packed_pair_span(lengths, 512))
    mx.reset_peak_memory()
    for micro in pack(batch, 512):
        be.forward_backward(micro, 1.0 / batch.label_tokens)
    be.optimizer_step(1e-3)
    peaks.append(mx.get_peak_memory())
# the head runs on targets only: at most (n - 4) / n of a sample's tokens (the data's head_fraction)
# attention runs per sample: the data's most pairs per position (finetune/data/batches.py packed_pair_span)
p = planner.plan(resolve(cfg), seq_len=max(widths), recommend=False, head_fraction=36 / 40, pair_span=max(spans))
print(json.dumps([p["peak_allocated_bytes"], peaks, widths]))
"""
    r = warm_cli.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=repo)
    assert r.returncode == 0, r.stderr[-2000:]
    return tuple(json.loads(r.stdout.strip().splitlines()[-1]))


@needs_mlx
def test_mlx_packed_plan_bounds_every_step(packed_peaks: tuple[int, list[int], list[int]]) -> None:
    """The plan at the widest packed micro-batch is within 10% of the highest step's measured
    peak and above every step's (measured: 10.52 MB planned, 9.76-9.93 MB measured; 1.06-1.08x)."""
    planned, peaks, widths = packed_peaks
    assert planned == pytest.approx(max(peaks), rel=0.10), (planned, peaks, widths)
    assert all(peak <= planned for peak in peaks), (planned, peaks, widths)


@needs_mlx
def test_mlx_packed_peak_is_flat(packed_peaks: tuple[int, list[int], list[int]]) -> None:
    """The issue's target: every step within 10% of the plan, the steps' peaks within 5%."""
    planned, peaks, widths = packed_peaks
    assert widths == [512] * 8  # every step's widest micro-batch is filled to tokens_per_micro
    assert all(abs(planned / peak - 1) <= 0.10 for peak in peaks), (planned, peaks, widths)
    assert (max(peaks) - min(peaks)) / max(peaks) <= 0.05, (peaks, widths)
    print(f"planned {planned} B; measured per step {peaks} B; spread "
          f"{(max(peaks) - min(peaks)) / max(peaks):.2%}; plan/peak {min(planned / p for p in peaks):.3f}.."
          f"{max(planned / p for p in peaks):.3f}")
