"""Reading a user's data file where a number decides what they get: the 256 MiB a JSON array
may hold (named in the refusal, with the jq command that converts it), data.max_samples taken
exactly, an empty file refused, and a batch exactly as wide as its longest sample. Written for
survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_cfg
from finetune.data.batches import collate
from finetune.data.formats import load_records
from finetune.errors import UserError


def _jsonl_cfg(tmp_path: Path, data: Path, *overrides: str):
    return make_cfg(tmp_path / "run", "data=jsonl", f"data.path={data}", *overrides).data


def test_a_json_array_over_256_mib_is_refused_naming_the_limit_and_the_jq_command(tmp_path):
    """The array is read whole only up to 256 MiB: one byte more is refused before any of it is
    decoded. The file is sparse (an "[" line, then zeros), so it costs no disk to make."""
    data = tmp_path / "big.json"
    with open(data, "wb") as f:
        f.write(b"[\n")
        f.truncate(256 * 2**20 + 1)
    with pytest.raises(UserError) as e:
        load_records(_jsonl_cfg(tmp_path, data), seed=0)
    assert str(e.value) == (f"{data} is one JSON array of more than 256 MiB, too big to read whole; convert it to "
                            f"JSONL (one object a line): jq -c '.[]' {data} > big.jsonl")


def test_max_samples_takes_exactly_that_many_records_from_the_top(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(5)))
    got = load_records(_jsonl_cfg(tmp_path, data, "data.max_samples=3"), seed=0)
    assert [r["prompt"] for r in got] == ["q0", "q1", "q2"]
    assert len(load_records(_jsonl_cfg(tmp_path, data, "data.max_samples=1"), seed=0)) == 1


def test_an_empty_data_file_is_refused(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    with pytest.raises(UserError) as e:
        load_records(_jsonl_cfg(tmp_path, data), seed=0)
    assert str(e.value) == f"{data} holds no records; it needs one JSON object a line"


def test_collate_pads_to_the_longest_sample_unless_asked_for_a_multiple():
    ids = [np.array([5, 6, 7]), np.array([1, 2, 3, 4, 5, 6])]
    masks = [np.array([0, 1, 1]), np.array([0, 0, 1, 1, 1, 1])]
    b = collate(ids, masks, np.array([0, 1]), pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 0, 0, 0], [1, 2, 3, 4, 5, 6]]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1]]
    # pad_multiple=4: the model's input (all but the last target) 5 -> 8 tokens, plus the target
    assert collate(ids, masks, np.array([0, 1]), pad_id=0, pad_multiple=4).input_ids.shape == (2, 9)


def test_a_json_array_cut_short_is_refused_at_the_line_where_it_ends(tmp_path):
    data = tmp_path / "cut.json"
    data.write_text('[\n  {"prompt": "q", "completion": "a"}')  # the closing bracket never came
    with pytest.raises(UserError) as e:
        load_records(_jsonl_cfg(tmp_path, data), seed=0)
    assert str(e.value) == (f"{data}:2 is not valid JSON (expected ',' or ']' in the array); fix that element")


@pytest.mark.parametrize("lengths, cap, want", [
    # [3, 2] closed by the 4 that does not fit: 1 pad of its own, (9 + 4 + 1) / 6; the last row [4]
    # has no pads: 16 / 4 = 4, the most
    ([3, 2, 4], 6, 4.0),
    # the padded first row is the most: [5] + 1 pad = (25 + 1) / 6, above the last row's 16 / 4
    ([5, 4], 6, 26 / 6),
    # a sample wider than the cap is its own row, no pad: 64 / 8
    ([8, 2], 6, 8.0),
    # one row: no pads at the end
    ([2, 2, 2], 6, 2.0),
])
def test_packed_pair_span_is_the_most_pairs_per_position_of_any_row(lengths, cap, want):
    """data.packed_pair_span: each packed micro-batch's (query, key) pairs per position (its
    samples' squares, its pads a segment of their own) over the row's width, the most of any row;
    computed by hand on rows whose widths ``packed_widths`` gives."""
    from finetune.data.batches import packed_pair_span, packed_widths

    assert packed_pair_span(np.array(lengths), cap) == pytest.approx(want, rel=1e-12)
    assert int(packed_widths(np.array(lengths), cap).max()) >= max(lengths)
