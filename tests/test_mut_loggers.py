"""What the loggers hand to their stores, read back from the store itself. Written for
survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

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
