"""The planner prices train.loss_chunk: one chunk's logits instead of the whole [B, T, V], plus
the hidden states' gradient kept from forward, on both backends; and suggests it as a lever."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_spec
from finetune.resolver import resolve
from finetune import planner
from tests.conftest import make_cfg


@pytest.mark.parametrize("backend", ["cuda", "mlx"])
def test_chunked_loss_replaces_the_whole_logits_by_one_chunk(tmp_path: Path, backend: str) -> None:
    base = ("mode=plan", f"backend={backend}", "model=qwen2-0.5b", "train.batch_size=4", "train.seq_len=2048",
            "memory.budget=80GiB")
    whole = planner.plan(make_spec(tmp_path, *base), recommend=False)
    chunked = planner.plan(make_spec(tmp_path, *base, "train.loss_chunk=1024"), recommend=False)
    arch, s = planner.resolve(make_spec(tmp_path, *base))
    n = whole["logits_tokens"] if "logits_tokens" in whole else s.batch * (s.seq_len - (1 if backend == "mlx" else 0))
    per_tok = whole["bytes"]["logits"] / (n * arch.vocab)  # bytes per (token, vocab entry) of the whole logits
    if backend == "mlx":  # the whole head on gathered target rows measured lower than the chunks' calibration
        from finetune.backends.mlx.memory import MLX_TARGET_HEAD_SAVING_NV

        per_tok += MLX_TARGET_HEAD_SAVING_NV
    assert per_tok in (12, 16, 20)
    assert chunked["bytes"]["logits"] == per_tok * 1024 * arch.vocab + 4 * n * arch.hidden
    # everything else is the same plan
    assert {k: v for k, v in chunked["bytes"].items() if k != "logits"} == \
        {k: v for k, v in whole["bytes"].items() if k != "logits"}
    saved = whole["bytes"]["logits"] - chunked["bytes"]["logits"]
    assert whole["peak_bytes"] - chunked["peak_bytes"] == saved > 0


def test_the_lever_is_suggested_where_it_makes_the_run_fit(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, "mode=plan", "backend=cuda", "model=qwen2-0.5b", "train.batch_size=4",
                   "train.seq_len=2048", "memory.budget=16GiB")
    res = planner.fit_to_budget(resolve(cfg), 16 << 30)
    p = planner.plan(resolve(cfg))
    levers = [lv["change"] for lv in p["recommendation"]["levers"]] if p.get("recommendation") else []
    assert "train.loss_chunk=1024" in levers or "train.loss_chunk=1024" in res.suggestions
