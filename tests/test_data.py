"""Data pipeline: formats, loss masks, truncation, and a step -> samples order fixed by the
effective batch alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_spec
from transformers import AutoTokenizer

from finetune import data as data_mod
from finetune.config import ModelConfig
from finetune.errors import UserError
from finetune.model.tiny import build_tiny


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
    cfg = make_spec(tmp_path, "data=jsonl", f"data.path={bad}")
    with pytest.raises(UserError, match=r"bad.jsonl:2 is not valid JSON"):
        data_mod.load_records(cfg.data, 0)


def test_order_depends_on_effective_batch_only(tok, tmp_path):
    """micro 4 x accum 1 and micro 1 x accum 4 see the same samples at every step."""
    a, _ = data_mod.build(make_spec(tmp_path, "train.batch_size=4", "train.grad_accum=1"), tok)
    b, _ = data_mod.build(make_spec(tmp_path, "train.batch_size=1", "train.grad_accum=4"), tok)
    for s in (0, 1, 7, a.steps_per_epoch + 3):  # across an epoch boundary too
        ba, bb = a.train_batch(s), b.train_batch(s)
        assert np.array_equal(ba.indices, bb.indices)
        assert np.array_equal(ba.input_ids, bb.input_ids)
    # micro-batches are trimmed to their own longest sample: no all-pad columns computed
    for m in a.train_batch(0).split(2):
        assert m.input_ids.shape[1] == m.lengths.max()
    assert set(a.val_idx).isdisjoint(a.train_idx)


def test_length_grouping_reduces_padding(tok, tmp_path):
    src, _ = data_mod.build(make_spec(tmp_path, "train.batch_size=8"), tok)
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
    cfg = make_spec(tmp_path, "data=jsonl", f"data.path={gsm8k}", "data.max_samples=500", "train.seq_len=128")
    src, stats = data_mod.build(cfg, tok)
    assert stats["records"] == 500 and stats["truncated"] > 0
    first = json.loads(gsm8k.read_text().splitlines()[0])
    assert first["answer"].split("####")[-1].strip() == "72"


def _tok(lengths: list[int]) -> data_mod.Tokenized:
    """Token ids 1..n per sample with every token a target: what DataSource needs, no tokenizer."""
    ids = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    return data_mod.Tokenized(ids, [np.ones(n, np.int8) for n in lengths], 0, 0, max(lengths))


def test_validation_split_sizes():
    lengths = list(range(8, 48))  # 40 samples
    assert len(data_mod.DataSource(_tok(lengths), 0, 4, 0, 0.0, 64).val_idx) == 0  # val_fraction=0: none
    assert len(data_mod.DataSource(_tok(lengths), 0, 4, 0, 0.1, 64).val_idx) == 4
    assert len(data_mod.DataSource(_tok(lengths), 0, 4, 0, 0.1, 3).val_idx) == 3  # max_val_samples caps it
    # a fraction that rounds to no sample still keeps one to validate on ...
    assert len(data_mod.DataSource(_tok(lengths), 0, 4, 0, 0.01, 64).val_idx) == 1
    two = data_mod.DataSource(_tok([8, 9]), 0, 1, 0, 0.05, 64)  # ... down to two samples
    assert (len(two.val_idx), len(two.train_idx)) == (1, 1)
    assert len(data_mod.DataSource(_tok([8]), 0, 1, 0, 0.05, 64).val_idx) == 0  # one sample: it trains


def test_an_epoch_is_every_kept_sample_once_in_full_batches():
    lengths = [int(x) for x in np.random.default_rng(1).integers(8, 64, 150)]
    src = data_mod.DataSource(_tok(lengths), 0, 4, 0, 0.05, 64)
    eff = 4
    assert src.steps_per_epoch == len(src.train_idx) // eff  # the ragged tail is dropped
    seen = [i for s in range(src.steps_per_epoch) for i in src.train_batch(s).indices.tolist()]
    assert all(len(src.train_batch(s).lengths) == eff for s in range(src.steps_per_epoch))
    assert len(seen) == len(set(seen)) == src.steps_per_epoch * eff and set(seen) <= set(src.train_idx.tolist())
    nxt = [i for s in range(src.steps_per_epoch, 2 * src.steps_per_epoch) for i in src.train_batch(s).indices.tolist()]
    assert nxt != seen and len(set(nxt)) == len(nxt)  # the next epoch: a new order, again each once


def test_val_batches_cover_every_val_sample_unless_capped():
    src = data_mod.DataSource(_tok(list(range(8, 108))), 0, 4, 0, 0.1, 64)  # 10 validation samples
    every = src.val_batches(3, 0)  # 0: no cap
    assert [len(b.lengths) for b in every] == [3, 3, 3, 1]
    assert sorted(i for b in every for i in b.indices.tolist()) == sorted(src.val_idx.tolist())
    assert [len(b.lengths) for b in src.val_batches(3, 2)] == [3, 3]
