"""What the loggers hand to their stores, read back from the store itself. Written for
survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from finetune.loggers import MlflowLogger, event_text


def test_an_event_longer_than_the_tag_cap_is_stored_cut_at_5000_characters(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    lg = MlflowLogger({"log_params": False})
    lg.open(tmp_path, 0, {})
    short = {"step": 3, "trigger": "oom", "action": "lower_micro_batch", "before": {"micro": 4}, "after": {"micro": 2}}
    long = {**short, "step": 4, "before": {"note": "x" * 9000}}
    lg.log_event(short)
    lg.log_event(long)
    tags = MlflowClient(tracking_uri=lg.uri).get_run(lg.run_id).data.tags
    assert tags["event.1"] == 'step 3: oom -> lower_micro_batch ({"micro": 4} -> {"micro": 2})' == event_text(short)
    assert len(tags["event.2"]) == 5000 and tags["event.2"] == event_text(long)[:5000]


def _wandb_exit_codes(path: Path) -> list[int]:
    """The exit records of a W&B offline run file: a 7-byte header, then LevelDB-log chunks
    (crc32c, length, type) in 32 KiB blocks, each record a protobuf (as tests/test_loggers.py
    reads the whole history)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf, out = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "exit":
                out.append(rec.exit.exit_code)
            buf = b""
    return out


def test_a_failed_run_is_marked_failed_on_wandb(tmp_path: Path, monkeypatch) -> None:
    """W&B shows a run whose exit code is not 0 as failed: a training that raised (the run
    log closes its loggers with status "failed") must not appear there as a finished one."""
    pytest.importorskip("wandb")
    from finetune.loggers import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    lg = WandbLogger({"mode": "offline"})
    lg.open(tmp_path, 0, {})
    lg.close("failed")
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30  # W&B's service process may write the last records after finish() returns
    while not _wandb_exit_codes(run_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _wandb_exit_codes(run_file) == [1]
