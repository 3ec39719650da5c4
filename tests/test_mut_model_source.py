"""A sharded checkpoint with shards missing, as an interrupted download leaves it: the message
names the first missing shard, how many of how many are gone and the fix. Written for survivors
of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from finetune.config import compose
from finetune.errors import UserError
from finetune.model.source import check_weights
from finetune.model.safetensors_io import damage as safetensors_damage


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
                            f"download it again (hf download <repo> --local-dir {d}) or copy it whole")


def _st(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def test_safetensors_layout_edges(tmp_path: Path) -> None:
    # a tensor whose byte range is shorter than its dtype x shape: damaged, with the numbers
    short = _st(tmp_path / "short.safetensors", {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}},
                bytes(12))
    assert safetensors_damage(short) == "tensor w holds 12 bytes, not F32[2, 2]"
    longer = _st(tmp_path / "long.safetensors", {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 20]}},
                 bytes(20))
    assert safetensors_damage(longer) == "tensor w holds 20 bytes, not F32[2, 2]"
    # whole files: one exact tensor; only metadata and no tensor bytes (as safetensors writes an empty dict)
    whole = _st(tmp_path / "whole.safetensors", {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}},
                bytes(16))
    assert safetensors_damage(whole) is None
    empty = _st(tmp_path / "empty.safetensors", {"__metadata__": {"format": "pt"}}, b"")
    assert safetensors_damage(empty) is None
    trailing = _st(tmp_path / "trailing.safetensors", {"__metadata__": {"format": "pt"}}, bytes(3))
    assert safetensors_damage(trailing) == "3 bytes after its last tensor"


def _http_error(cls, status: int, message: str):
    import httpx

    req = httpx.Request("GET", "https://huggingface.co/org/model/resolve/main/config.json")
    return cls(message, response=httpx.Response(status, request=req))


def test_each_hub_failure_online_is_worded_for_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants, errors

    from finetune.model import source as model_source

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    said = {cls.__name__: model_source._hub_failure(_http_error(cls, status, "refused"), "v2")
            for cls, status in ((errors.GatedRepoError, 403), (errors.RevisionNotFoundError, 404),
                                (errors.RepositoryNotFoundError, 404), (errors.RemoteEntryNotFoundError, 404))}
    assert said == {
        "GatedRepoError": "the repository is gated (accept its licence on the hub and set HF_TOKEN)",
        "RevisionNotFoundError": "the hub has no revision v2",
        "RepositoryNotFoundError": "the hub has no such repository (or it is private: set HF_TOKEN)",
        "RemoteEntryNotFoundError": "the repository has no config.json",
    }
    assert model_source._hub_failure(ConnectionError("Name or service not known\nmore"), None) == (
        "the hub is unreachable (Name or service not known)")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert model_source._hub_failure(ConnectionError("x"), None) == "the hub is unreachable (offline: HF_HUB_OFFLINE=1)"


def test_a_weights_file_that_cannot_be_read_is_named_unreadable(tmp_path: Path) -> None:
    d = tmp_path / "model.safetensors"
    d.mkdir()  # a directory where the file should be: opening it fails with an OSError
    assert safetensors_damage(d) == "unreadable: Is a directory"
