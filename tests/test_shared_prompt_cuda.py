"""The cuda pair step's shared-prompt row (backends/cuda/shared_prompt.py): on two families, with
trained-looking (non-zero) LoRA adapters, it runs fewer positions than the padded rows, each
pair's prompt once, and gives the padded rows' log-probabilities and a DPO loss's gradients,
with and without gradient checkpointing; a sliding-window model keeps the padded rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import make_spec, needs_torch
from test_shared_prompt import PAIRS, _pairs  # the same pairs as the mlx row's test

pytestmark = [needs_torch]

@pytest.fixture(scope="module", params=["qwen2", "llama"])  # qwen2: the default tiny model
def case(request: Any, tmp_path_factory: Any) -> tuple[Any, Any]:
    """(the cuda backend on CPU under LoRA with random adapters, a batch of PAIRS interleaved pairs)."""
    import torch
    from families import build_family
    from transformers import AutoTokenizer

    from finetune.backends.cuda.runtime import CudaBackend
    from finetune.config import Config
    from finetune.data.pairs import PairSource
    from finetune.data.tokens import tokenize
    from finetune.model.tiny import build_tiny

    d = build_tiny(Config(run_dir="unused").model) if request.param == "qwen2" else build_family(request.param)
    tok = AutoTokenizer.from_pretrained(str(d))
    toks = tokenize(_pairs(PAIRS), tok, 128, True, pairs=True)
    batch = PairSource(toks, tok.pad_token_id or 0, PAIRS, 0, 0.0, 0).train_batch(0)
    be = CudaBackend()
    be.setup(make_spec(tmp_path_factory.mktemp(request.param), "backend=cuda", "backend.device=cpu",
                       "precision=32-true", f"model.path={d}", "objective=dpo", "method.lora.dropout=0"), d)
    g = torch.Generator().manual_seed(1)  # LoRA's B starts at 0: the policy would be its base
    with torch.no_grad():
        for p in be.model.parameters():
            if p.requires_grad:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return be, batch


def _grads(be: Any, batch: Any, shared: bool) -> tuple[np.ndarray, dict]:
    """(the rows' log-probs, the gradients of a DPO-like loss over them), the shared-prompt row or the padded rows."""
    import torch

    be.model.zero_grad(set_to_none=True)
    lp = be._pair_logps(batch)[0] if shared else be._row_logps(batch)[0]
    (-torch.nn.functional.logsigmoid(0.1 * (lp[0::2] - lp[1::2])).sum()).backward()
    grads = {n: p.grad.detach().clone().numpy() for n, p in be.model.named_parameters() if p.grad is not None}
    be.model.zero_grad(set_to_none=True)
    return lp.detach().numpy(), grads


def test_shared_prompt_row_equals_the_padded_rows(case: tuple[Any, Any]) -> None:
    from finetune.backends.cuda import shared_prompt
    from finetune.data.pair_layout import Layout

    be, batch = case
    assert shared_prompt.applies(be.model, lambda i, m: be._logps_of(i, m)[0], be._shared_logps) is None
    lay = Layout(batch.input_ids, batch.loss_mask)
    padded = batch.input_ids.shape[0] * (batch.input_ids.shape[1] - 1)
    assert lay.shared >= 5 * PAIRS and lay.ids.shape[1] < padded  # each prompt ran once, no pad ran
    assert be._shared_logps(batch.input_ids, batch.loss_mask) is not None  # the step takes the shared rows
    for ckpt in (False, True):
        be.set_grad_checkpointing(ckpt)
        want, g_want = _grads(be, batch, shared=False)
        got, g_got = _grads(be, batch, shared=True)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-4), (ckpt, got, want)
        assert g_got.keys() == g_want.keys() and max(float(np.abs(v).max()) for v in g_want.values()) > 1e-3
        worst = max(float(np.abs(g_got[k] - g_want[k]).max()) for k in g_want)
        assert worst < 1e-5, (ckpt, worst)
    be.set_grad_checkpointing(False)


def test_a_sliding_window_keeps_the_padded_rows() -> None:
    from transformers import Qwen2Config

    from finetune.backends.cuda.shared_prompt import _refusal

    cfg = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    cfg._attn_implementation = "sdpa"

    class M:
        config = cfg

    assert "sliding" in str(_refusal(M()))
    cfg.use_sliding_window, cfg.layer_types = False, ["full_attention"] * 2
    assert _refusal(M()) is None
