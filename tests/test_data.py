"""Data pipeline: formats, loss masks, truncation, and a step -> samples order fixed by the
effective batch alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from finetune import data as data_mod
from finetune.config import ModelConfig, UserError
from finetune.tiny import build_tiny

from conftest import make_cfg


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(build_tiny(ModelConfig())))


def _decode_masked(tok, ids, mask):
    return tok.decode([int(i) for i, m in zip(ids, mask) if m])


def test_prompt_completion_masks_prompt(tok):
    t = data_mod.tokenize([{"prompt": "Question: 2 + 2?\nAnswer: ", "completion": "4 apples."}], tok, 256, True)
    text = _decode_masked(tok, t.ids[0], t.masks[0])
    assert text.startswith("4") and "Question" not in text and text.endswith("<|endoftext|>")
    t2 = data_mod.tokenize([{"prompt": "Question: 2 + 2?\nAnswer: ", "completion": "4 apples."}], tok, 256, False)
    assert t2.masks[0].sum() == len(t2.ids[0])


def test_chat_messages_count_assistant_only(tok):
    rec = {"messages": [{"role": "user", "content": "How many apples?"}, {"role": "assistant", "content": "Three apples."},
                        {"role": "user", "content": "And coins?"}, {"role": "assistant", "content": "Two coins."}]}
    t = data_mod.tokenize([rec], tok, 256, True)
    text = _decode_masked(tok, t.ids[0], t.masks[0])
    assert "Three apples." in text and "Two coins." in text
    assert "How many" not in text and "And coins" not in text


def test_text_and_question_answer_formats(tok):
    t = data_mod.tokenize([{"text": "Ava has 3 apples."}, {"question": "Ava has 3 apples?", "answer": "#### 3"}], tok, 256, True)
    assert t.masks[0].sum() == len(t.ids[0])
    assert _decode_masked(tok, t.ids[1], t.masks[1]).startswith("#### 3")


def test_truncation_is_counted(tok):
    recs = [{"text": "apples " * 200}, {"text": "coins"}]
    t = data_mod.tokenize(recs, tok, 32, True)
    assert t.truncated == 1 and len(t.ids[0]) == 32 and t.longest > 32


def test_unknown_format_and_bad_jsonl_are_user_errors(tok, tmp_path):
    with pytest.raises(UserError, match="no known format"):
        data_mod.tokenize([{"foo": 1}], tok, 64, True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    cfg = make_cfg(tmp_path, "data=jsonl", f"data.path={bad}")
    with pytest.raises(UserError, match=r"bad.jsonl:2 is not valid JSON"):
        data_mod.load_records(cfg.data, 0)


def test_order_depends_on_effective_batch_only(tok, tmp_path):
    """micro 4 x accum 1 and micro 1 x accum 4 see the same samples at every step."""
    a, _ = data_mod.build(make_cfg(tmp_path, "train.batch_size=4", "train.grad_accum=1"), tok)
    b, _ = data_mod.build(make_cfg(tmp_path, "train.batch_size=1", "train.grad_accum=4"), tok)
    for s in (0, 1, 7, a.steps_per_epoch + 3):  # across an epoch boundary too
        ba, bb = a.train_batch(s), b.train_batch(s)
        assert np.array_equal(ba.indices, bb.indices)
        assert np.array_equal(ba.input_ids, bb.input_ids)
    # micro-batches are trimmed to their own longest sample: no all-pad columns computed
    for m in a.train_batch(0).split(2):
        assert m.input_ids.shape[1] == m.lengths.max()
    assert set(a.val_idx).isdisjoint(a.train_idx)


def test_length_grouping_reduces_padding(tok, tmp_path):
    src, _ = data_mod.build(make_cfg(tmp_path, "train.batch_size=8"), tok)
    real = padded = 0
    for s in range(src.steps_per_epoch):
        b = src.train_batch(s)
        real += b.tokens
        padded += b.input_ids.size
    rng = np.random.default_rng(0)
    lens = np.array([len(x) for x in src.tok.ids])[src.train_idx]
    rand = sum(len(c) * c.max() for c in np.array_split(rng.permutation(lens), len(lens) // 8))
    assert padded / real < 0.5 * (rand / lens.sum()) + 0.5  # well below random batching's waste
    assert padded / real < 1.15


def test_gsm8k_real_text(tok, tmp_path, gsm8k):
    cfg = make_cfg(tmp_path, "data=jsonl", f"data.path={gsm8k}", "data.max_samples=500", "train.seq_len=128")
    src, stats = data_mod.build(cfg, tok)
    assert stats["records"] == 500 and stats["truncated"] > 0
    first = json.loads(gsm8k.read_text().splitlines()[0])
    assert first["answer"].split("####")[-1].strip() == "72"
