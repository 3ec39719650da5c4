"""Each logger's output, opened the way its user opens it: the CSV as a table, TensorBoard's
event reader, MLflow's client on the local file store, W&B's offline run directory.

One real CLI run (mlx on CPU under memory.budget=24MiB: its governor sets MLX's memory limit to
the budget before loading, and after step 1 caps the cache at the budget, below MLX's own 32 MiB,
so the run has events from before and during training; without a budget the step-1 cache limit
would equal the one MLX has and, being no change, is no event) feeds the
assertions for all four loggers; metrics.jsonl is the reference each is compared with.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import HAS_MLX, IN_CI, make_cfg
import warm_cli

from finetune.resolver import resolve

STEPS = 3
ARGS = ["backend=mlx", f"train.steps={STEPS}", "train.eval_every=2", "train.warmup_steps=1", "train.progress=false",
        "data.num_samples=200", "memory.budget=24MiB"]
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
pytestmark = pytest.mark.skipif(not HAS_MLX, reason="mlx not installed (pip install '.[mlx]')")


def _have(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(PACKAGES[name]) is not None


def _needs(name: str) -> None:
    """Skip where the logger's package is absent; in CI (which installs finetune[dev], and
    with it the loggers) a missing one is a broken setup, not a smaller machine."""
    if not _have(name):
        msg = f"{PACKAGES[name]} not installed (pip install 'finetune[loggers]')"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def _jsonl(run: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "step" in r], [r["event"] for r in lines if "event" in r]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """`finetune ... logger=[csv,tensorboard,wandb,mlflow] logger.wandb.mode=offline`, from
    the console entry, as a user types it (the list override goes through the CLI's own
    group check and Hydra's composition)."""
    run_dir = tmp_path_factory.mktemp("loggers") / "run"
    chosen = ["csv"] + [n for n in ("tensorboard", "wandb", "mlflow") if _have(n)]
    env = {**os.environ, "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)  # offline by the config key alone
    r = warm_cli.run([sys.executable, "-m", "finetune.cli", *ARGS, f"logger=[{','.join(chosen)}]",
                        "logger.wandb.mode=offline", f"hydra.run.dir={run_dir}"],
                       check=False, capture_output=True, text=True, timeout=300, env=env, cwd=run_dir.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    steps, events = _jsonl(run_dir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    # one event decided before loading (held until the run log began) and one while training
    assert events and events[0]["step"] == 0 and any(e["step"] >= 1 for e in events), events
    return run_dir


def test_csv_has_one_row_per_step_with_the_jsonl_values(run):
    steps, _ = _jsonl(run)
    with (run / "metrics.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = reader.fieldnames
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    # the columns: every key of the step records in order of first appearance; val_loss first
    # appears at step 2 (eval_every=2), after the memory fields of step 1
    order: list[str] = []
    for s in steps:
        order += [k for k in s if k not in order]
    assert header == order and header.index("val_loss") > header.index("rss_bytes")
    for row, rec in zip(rows, steps):
        assert float(row["loss"]) == rec["loss"] and int(row["rss_bytes"]) == rec["rss_bytes"]
        assert int(row["allocated_bytes"]) == rec["allocated_bytes"]
        assert row["val_loss"] == ("" if "val_loss" not in rec else repr(rec["val_loss"]))
    assert rows[0]["val_loss"] == "" and float(rows[1]["val_loss"]) == steps[1]["val_loss"]


def test_tensorboard_event_reader_finds_loss_memory_and_events(run):
    _needs("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    steps, events = _jsonl(run)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    # TensorBoard keeps a scalar as float32: 7 significant digits
    assert [e.value for e in loss] == pytest.approx([s["loss"] for s in steps], rel=1e-6)
    for tag, key in (("memory/allocated_bytes", "allocated_bytes"), ("memory/rss_bytes", "rss_bytes"),
                     ("train/tokens_per_sec", "tokens_per_sec"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")):
        assert [e.value for e in acc.Scalars(tag)] == pytest.approx([s[key] for s in steps], rel=1e-6), tag
    assert [e.step for e in acc.Scalars("train/val_loss")] == [2, 3]
    # a figure the backend cannot measure is absent, never a 0 (mlx has no NVML)
    assert "memory/device_used_bytes" not in acc.Tags()["scalars"]
    texts = [(e.step, make_ndarray(e.tensor_proto)[0].decode()) for e in acc.Tensors("events")]
    assert [t[0] for t in texts] == [e["step"] for e in events]
    assert texts[0][1].startswith(f"step 0: {events[0]['trigger']} -> {events[0]['action']} (")


def test_mlflow_client_lists_the_runs_metrics(run, monkeypatch):
    _needs("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's switch for file stores
    client = MlflowClient(tracking_uri=f"file:{run / 'mlruns'}")
    exp = client.get_experiment_by_name("finetune")
    (found,) = client.search_runs([exp.experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == run.name
    steps, events = _jsonl(run)
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(s["step"], s["loss"]) for s in steps]
    metrics = found.data.metrics
    assert metrics["memory/rss_bytes"] == steps[-1]["rss_bytes"]
    assert metrics["memory/peak_allocated_bytes"] == steps[-1]["peak_allocated_bytes"]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_sec", "summary/final_train_loss"} <= set(metrics)
    assert found.data.params["train.steps"] == str(STEPS) and found.data.params["backend.name"] == "mlx"
    assert [found.data.tags[f"event.{i + 1}"].split(":")[0] for i in range(len(events))] == \
        [f"step {e['step']}" for e in events]
    assert {a.path for a in client.list_artifacts(found.info.run_id)} >= {"events.jsonl", "summary.json"}


def _wandb_records(path: Path):
    """The records of a W&B run file (what `wandb sync` uploads): a 7-byte header, then
    LevelDB-log chunks (crc32c, length, type) in 32 KiB blocks; each record a protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def test_wandb_offline_run_directory_has_its_history(run):
    _needs("wandb")
    run_id = (run / ".wandb_run_id").read_text().strip()
    (offline,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    records = list(_wandb_records(offline / f"run-{run_id}.wandb"))
    history, event_steps = {}, []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: i.value_json for i in r.history.item}
            if "train/loss" in items:
                history[int(items["_step"])] = items
            if any(k.startswith("events") for k in items):  # the events table, logged at each event's step
                event_steps.append(int(items["_step"]))
    steps, events = _jsonl(run)
    assert sorted(history) == [1, 2, 3]
    assert sorted(set(event_steps)) == sorted({e["step"] for e in events})
    for s in steps:
        h = history[s["step"]]
        assert json.loads(h["train/loss"]) == pytest.approx(s["loss"], rel=1e-12)
        assert json.loads(h["memory/rss_bytes"]) == s["rss_bytes"]
    (run_rec,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run_rec.config.update}
    assert config["train"]["steps"] == STEPS and config["backend"]["name"] == "mlx"  # the composed config
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({"/".join(i.nested_key) or i.key: i.value_json for i in r.summary.update})
    expected = json.loads((run / "summary.json").read_text())
    assert json.loads(summary["final_train_loss"]) == expected["final_train_loss"]
    assert json.loads(summary["peak/rss_bytes"]) == expected["memory"]["peaks"]["rss_bytes"]
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [0]


def test_a_missing_logger_package_is_one_line_naming_the_extra(tmp_path):
    """`logger=tensorboard` without the package: exit 2 and one line, before any weight is
    loaded (the import is tried when the run log is built)."""
    code = ("import sys; sys.modules['tensorboard'] = None; "
            "from finetune.cli import main; sys.argv = ['finetune'] + sys.argv[1:]; main()")
    r = warm_cli.run([sys.executable, "-c", code, "logger=[csv,tensorboard]", "train.progress=false",
                        f"hydra.run.dir={tmp_path / 'run'}"], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert err == [err[0]] and "logger=tensorboard needs the tensorboard package" in err[0]
    assert "pip install 'finetune[loggers]'" in err[0]
    assert "Traceback" not in r.stderr and "Loading weights" not in r.stderr


def test_an_unknown_logger_is_refused_with_the_options(tmp_path):
    r = warm_cli.run([sys.executable, "-m", "finetune.cli", "logger=[tensorbord]", f"hydra.run.dir={tmp_path}"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "logger=tensorbord is not an option; choose one of: csv, jsonl, mlflow, tensorboard, wandb" in r.stderr


def test_resume_keeps_each_logger_one_point_per_step(tmp_path):
    """A run checkpointed at step 2 and 4, its step-4 checkpoint lost, resumed: the CSV has
    steps 1-4 once each, and TensorBoard's reader shows one loss per step (the points of the
    abandoned steps 3-4 are purged), equal to metrics.jsonl's."""
    _needs("tensorboard")
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from finetune.run.loop import train

    run = tmp_path / "r"
    args = ["backend=mlx", "train.steps=4", "train.save_every=2", "train.eval_every=0", "train.warmup_steps=1",
            "train.progress=false", "data.num_samples=200", "logger=[csv,tensorboard]"]
    train(resolve(make_cfg(run, *args)))
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    train(resolve(make_cfg(run, *args, "train.resume=true")))
    steps, _ = _jsonl(run)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    with (run / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["loss"])) for r in rows] == [(s["step"], s["loss"]) for s in steps]
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([s["loss"] for s in steps], rel=1e-6)
