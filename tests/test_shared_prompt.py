"""The mlx pair step's shared-prompt row (backends/mlx/shared_prompt.py): on two families, with
trained-looking (non-zero) LoRA adapters, it runs fewer positions than the padded rows, each
pair's prompt once, and gives the padded rows' log-probabilities and a DPO loss's gradients;
gradient checkpointing (a layer's forward run again in the backward) included. The planner's
bound (finetune/data/pairs.py ``pair_positions``) holds for every micro-batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_spec, needs_mlx, needs_torch

pytestmark = [needs_mlx, needs_torch, pytest.mark.mlx]

PAIRS = 4


def _pairs(n: int) -> list[dict]:
    """Prompts and completions of different lengths, the rejected longer in some pairs."""
    return [{"prompt": f"Question {i}:" + " how much is it" * (i % 3) + f" {i} + {i}?\nAnswer:\n",
             "chosen": f"{i} + {i} = {2 * i}" + " so" * (i % 2) + f"\n#### {2 * i}",
             "rejected": f"It is {2 * i + 1}" + " surely" * (i % 4)} for i in range(1, PAIRS + 1)]


@pytest.fixture(scope="module", params=["qwen2", "llama"])  # qwen2: the default tiny model
def case(request: Any, tmp_path_factory: Any) -> tuple[Any, Any, Any]:
    """(the mlx backend under LoRA with random adapters, a batch of PAIRS interleaved pairs, the tokens)."""
    import mlx.core as mx
    from families import build_family
    from finetune.backends.mlx.runtime import MlxBackend
    from mlx.utils import tree_map
    from transformers import AutoTokenizer

    from finetune.data.pairs import PairSource
    from finetune.data.tokens import tokenize

    from finetune.config import Config
    from finetune.model.tiny import build_tiny

    d = build_tiny(Config(run_dir="unused").model) if request.param == "qwen2" else build_family(request.param)
    tok = AutoTokenizer.from_pretrained(str(d))
    toks = tokenize(_pairs(PAIRS), tok, 128, True, pairs=True)
    batch = PairSource(toks, tok.pad_token_id or 0, PAIRS, 0, 0.0, 0).train_batch(0)
    be = MlxBackend()
    be.setup(make_spec(tmp_path_factory.mktemp(request.param), "backend=mlx", "precision=32-true", f"model.path={d}",
                       "objective=dpo", "method.lora.dropout=0"), d)
    mx.random.seed(1)  # LoRA's B starts at 0: the policy would be its base
    be.model.update(tree_map(lambda p: 0.05 * mx.random.normal(p.shape), be.model.trainable_parameters()))
    return be, batch, toks


def _grads(be: Any, batch: Any, shared: bool) -> tuple[Any, dict]:
    """(the rows' log-probs, the gradients of a DPO-like loss over them), the shared-prompt row or the padded rows."""
    import mlx.core as mx
    from finetune.backends.mlx.preference import row_logps
    from finetune.backends.mlx.shared_prompt import shared_rows
    from mlx import nn
    from mlx.utils import tree_flatten

    def run(logps: Any) -> tuple[Any, dict]:
        def loss() -> mx.array:
            lp = logps()
            return -nn.log_sigmoid(0.1 * (lp[0::2] - lp[1::2])).sum()

        value = logps()
        _, g = nn.value_and_grad(be.model, loss)()
        mx.eval(value, g)  # inside the block: a checkpointed layer's backward runs its forward again
        return np.array(value), {k: np.array(v) for k, v in tree_flatten(g)}

    if not shared:
        ids, mask = be._arrays(batch)
        return run(lambda: row_logps(be.model, ids, mask)[0])
    with shared_rows(be.model, batch.input_ids, batch.loss_mask) as logps:
        assert logps is not None  # the model takes the shared-prompt row
        return run(logps)


def test_shared_prompt_row_equals_the_padded_rows(case: tuple[Any, Any, Any]) -> None:
    from finetune.backends.mlx.shared_prompt import Layout

    from finetune.data.pairs import pair_positions

    be, batch, toks = case
    lay = Layout(batch.input_ids, batch.loss_mask)
    padded = batch.input_ids.shape[0] * (batch.input_ids.shape[1] - 1)
    assert lay.shared >= 5 * PAIRS and lay.ids.shape[1] < padded  # each prompt ran once, no pad ran
    assert lay.ids.shape[1] <= PAIRS * pair_positions(toks)  # the planner's bound
    for ckpt in (False, True):
        be.set_grad_checkpointing(ckpt)
        want, g_want = _grads(be, batch, shared=False)
        got, g_got = _grads(be, batch, shared=True)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-4), (ckpt, got, want)
        assert g_got.keys() == g_want.keys() and max(float(np.abs(v).max()) for v in g_want.values()) > 1e-3
        worst = max(float(np.abs(g_got[k] - g_want[k]).max()) for k in g_want)
        assert worst < 1e-5, (ckpt, worst)
    be.set_grad_checkpointing(False)
