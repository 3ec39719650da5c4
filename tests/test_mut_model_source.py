"""A sharded checkpoint with shards missing, as an interrupted download leaves it: the message
names the first missing shard, how many of how many are gone and the fix. Written for survivors
of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from finetune.config import UserError, compose
from finetune.model_source import check_weights


def test_missing_shards_named_first_with_the_count(tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    save_file({"w": np.zeros((2, 2), np.float32)}, str(d / shards[0]))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": shards[0], "b": shards[1], "c": shards[2]}}))
    cfg = compose(tmp_path / "run", "backend=cuda", f"model.path={d}").model
    with pytest.raises(UserError) as e:
        check_weights(d, cfg)
    assert str(e.value) == (f"{d / shards[1]} is missing (2 of 3 shards that model.safetensors.index.json names); "
                            f"download it again (huggingface-cli download <repo> --local-dir {d}) or copy it whole")
