"""Loggers beside metrics.jsonl: csv, tensorboard, wandb, mlflow.

Each option of the ``logger`` config group (``finetune logger=[tensorboard,mlflow]``) names
one class here; its YAML's keys arrive as ``settings``. The run log (finetune/run/log.py) owns
them: it builds them before any weight is loaded (a missing package stops the run there, in
one line naming the extra), opens them when the loop knows its first step, hands each one
every step record and event, and closes them at the end or on an error.

A step record is the metrics.jsonl line as it is (``step, loss, lr, grad_norm, tokens_per_sec,
...`` and every memory figure the backend measured, ``*_bytes`` ints or None). Loggers with
a scalar per tag get the numeric fields under ``train/<key>`` (the loop's own figures) or
``memory/<key>`` (the accountant's), so a tag carries its unit the way the key does
(``memory/peak_allocated_bytes``, ``train/tokens_per_sec``); a None (not measured) is not
logged, never logged as 0. Events (governor actions, the supervisor's restarts) go as text.

Nothing here imports torch or mlx, and no logger's package is imported before it is chosen.
"""

from __future__ import annotations

import csv
import io
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.io import atomic_write_text
from finetune.redact import redact_overrides, redact_text, redact_tree

EXTRA = "pip install 'finetune[loggers]'"

# The loop's own per-step fields; every other numeric field of a record is the accountant's.
LOOP_KEYS = frozenset({"loss", "lr", "grad_norm", "tokens", "samples", "micro_batch", "step_seconds",
                       "tokens_per_sec", "val_loss"})

_TAGS: dict[str, str] = {}


def tag(key: str) -> str:
    """The scalar tag of a metrics.jsonl key: ``train/loss``, ``memory/allocated_bytes``."""
    t = _TAGS.get(key)
    if t is None:
        t = _TAGS[key] = f"{'train' if key in LOOP_KEYS else 'memory'}/{key}"
    return t


def scalars(rec: Mapping[str, Any]) -> dict[str, float]:
    """The record's numeric fields by tag; None, bools and strings left out."""
    return {tag(k): v for k, v in rec.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def summary_scalars(summary: Mapping[str, Any]) -> dict[str, float]:
    """The numeric top-level figures of summary.json (``final_train_loss``, ``tokens_per_sec``,
    ``wall_s``, ...) and its memory peaks as ``peak/<key>`` (``peak/rss_bytes``)."""
    def num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    out = {k: v for k, v in summary.items() if num(v)}
    peaks = (summary.get("memory") or {}).get("peaks") or {}
    out.update({f"peak/{k}": v for k, v in peaks.items() if num(v)})
    return out


def event_text(ev: Mapping[str, Any]) -> str:
    """One line for an event: ``step 3: oom -> lower_micro_batch ({...} -> {...})``."""
    return (f"step {ev.get('step')}: {ev.get('trigger')} -> {ev.get('action')} "
            f"({json.dumps(ev.get('before'))} -> {json.dumps(ev.get('after'))})")


def _require(module: str, logger: str) -> Any:
    """Import a logger's package, or stop with the one line that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"logger={logger} needs the {module.split('.')[0]} package ({e}); "
                        f"install it: {EXTRA}") from None


def _saved_id(run_dir: Path, name: str, make: Callable[[], str]) -> tuple[str, bool]:
    """An id kept in the run dir, so a resumed run continues the same logger run; returns
    (id, whether it was already there)."""
    path = run_dir / f".{name}_run_id"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip(), True
    rid = make()
    atomic_write_text(path, rid + "\n")
    return rid, False


class Logger:
    """What the run log asks of a logger. Subclasses import their package in __init__."""

    name = "logger"

    def __init__(self, settings: Mapping[str, Any]):
        self.settings = dict(settings or {})

    def open(self, run_dir: Path, start_step: int, config: dict[str, Any]) -> None:
        """Start writing; ``start_step`` > 0 when the run resumed after that step."""

    def log_step(self, rec: dict[str, Any], values: dict[str, float]) -> None:
        """One step: ``rec`` the metrics.jsonl record, ``values`` its ``scalars(rec)``."""
        raise NotImplementedError

    def log_event(self, ev: dict[str, Any]) -> None:
        pass

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The run's summary.json content, once, after the last step."""

    def close(self, status: str) -> None:
        """``status``: "finished", "failed" or "killed" (stopped by a signal)."""


class CsvLogger(Logger):
    """``metrics.csv``: one row per step; the columns are every key seen, in order of first
    appearance. A key that first appears later (``val_loss`` at the first evaluation, memory
    figures at the first sample) rewrites the file once with the wider header, so the file is
    always one valid table (earlier rows have the new column empty)."""

    name = "csv"

    def open(self, run_dir: Path, start_step: int, config: dict[str, Any]) -> None:
        self.path = Path(self.settings.get("path") or run_dir / "metrics.csv")
        self.columns: list[str] = []
        self._known: set[str] = set()
        rows: list[dict[str, str]] = []
        if start_step > 0 and self.path.is_file():  # resumed: keep the rows up to the checkpoint
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or [])
                rows = [r for r in reader if r.get("step") and int(r["step"]) <= start_step]
        self._known = set(self.columns)
        self._rewrite(rows)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.columns, lineterminator="\n")
        if self.columns:
            w.writeheader()
        w.writerows(rows)
        atomic_write_text(self.path, buf.getvalue())
        self._file = self.path.open("a", newline="", buffering=1)
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns, lineterminator="\n")

    def log_step(self, rec: dict[str, Any], values: dict[str, float]) -> None:
        if not self._known.issuperset(rec):
            self._file.close()
            with self.path.open(newline="") as f:
                rows = list(csv.DictReader(f))
            self.columns += [k for k in rec if k not in self._known]
            self._known = set(self.columns)
            self._rewrite(rows)
        self._writer.writerow(rec)

    def close(self, status: str) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            f.close()


class TensorBoardLogger(Logger):
    """Event files under ``<run_dir>/tensorboard`` (``logger.tensorboard.log_dir``), written
    with the tensorboard package's own writer: no TensorFlow, no torch (a Mac runs it too).
    Scalars per tag; events as text under the ``events`` tag. ``tensorboard --logdir DIR``."""

    name = "tensorboard"

    def __init__(self, settings: Mapping[str, Any]):
        super().__init__(settings)
        self._efw = _require("tensorboard.summary.writer.event_file_writer", self.name)
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2

    def open(self, run_dir: Path, start_step: int, config: dict[str, Any]) -> None:
        self.log_dir = Path(self.settings.get("log_dir") or run_dir / "tensorboard")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = self._efw.EventFileWriter(str(self.log_dir),
                                                flush_secs=int(self.settings.get("flush_secs") or 30))
        if start_step > 0:
            # TensorBoard drops the earlier files' points from this step on (the abandoned
            # future of a resumed run), as torch's SummaryWriter(purge_step=...) asks it to
            self._add(step=start_step + 1, session_log=self._event_pb2.SessionLog(
                status=self._event_pb2.SessionLog.START))

    def _add(self, **kw: Any) -> None:
        self.writer.add_event(self._event_pb2.Event(wall_time=time.time(), **kw))

    def log_step(self, rec: dict[str, Any], values: dict[str, float]) -> None:
        S = self._summary_pb2.Summary
        self._add(step=int(rec["step"]), summary=S(value=[S.Value(tag=t, simple_value=v) for t, v in values.items()]))

    def log_event(self, ev: dict[str, Any]) -> None:
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        pb = self._summary_pb2
        meta = pb.SummaryMetadata(plugin_data=pb.SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
        tensor = TensorProto(dtype="DT_STRING", string_val=[event_text(ev).encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        value = pb.Summary.Value(tag="events", metadata=meta, tensor=tensor)
        self._add(step=int(ev.get("step") or 0), summary=pb.Summary(value=[value]))

    def close(self, status: str) -> None:
        w = getattr(self, "writer", None)
        if w is not None:
            w.close()  # flushes the queue


class WandbLogger(Logger):
    """A W&B run (``logger.wandb.project``, ``.name``, ``.dir``, ``.mode``). ``mode=offline``
    (or ``WANDB_MODE=offline``) writes ``<dir>/wandb/offline-run-*`` without network, for
    ``wandb sync`` later. Its id is kept in the run dir, so ``train.resume=true`` continues
    the same W&B run. Scalars by tag at each step; events as rows of an ``events`` table."""

    name = "wandb"

    def __init__(self, settings: Mapping[str, Any]):
        super().__init__(settings)
        self._wandb = _require("wandb", self.name)

    def open(self, run_dir: Path, start_step: int, config: dict[str, Any]) -> None:
        s, wandb = self.settings, self._wandb
        run_id = s.get("id") or _saved_id(run_dir, "wandb", lambda: secrets.token_hex(4))[0]
        self.events: list[list[Any]] = []
        argv = sys.argv
        # W&B keeps the command line (its metadata's "args"): the overrides, with secrets masked
        sys.argv = [argv[0], *redact_overrides(argv[1:])]
        try:
            self.run = wandb.init(
                project=s.get("project") or "finetune", entity=s.get("entity"), group=s.get("group"),
                name=s.get("name") or run_dir.name, dir=str(s.get("dir") or run_dir), mode=s.get("mode"),
                tags=[redact_text(str(t)) for t in s.get("tags") or []] or None, id=run_id, resume="allow",
                config=config, settings=wandb.Settings(console=str(s.get("console") or "off")))
        finally:
            sys.argv = argv

    def log_step(self, rec: dict[str, Any], values: dict[str, float]) -> None:
        self.run.log(values, step=int(rec["step"]))

    def log_event(self, ev: dict[str, Any]) -> None:
        self.events.append([ev.get("step"), ev.get("trigger"), ev.get("action"),
                            json.dumps(ev.get("before")), json.dumps(ev.get("after"))])
        table = self._wandb.Table(columns=["step", "trigger", "action", "before", "after"],
                                  data=self.events)
        self.run.log({"events": table}, step=int(ev.get("step") or 0))

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary_scalars(summary))

    def close(self, status: str) -> None:
        run = getattr(self, "run", None)
        if run is not None:
            run.finish(exit_code=0 if status == "finished" else 1)  # W&B: nonzero marks the run failed


class MlflowLogger(Logger):
    """An MLflow run: by default in a local file store under the run dir
    (``file:<run_dir>/mlruns``; ``logger.mlflow.tracking_uri`` for a server or a database),
    experiment ``logger.mlflow.experiment``. Parameters: the composed config, flattened.
    Scalars by tag at each step, handed to MLflow's asynchronous logging (the step does not
    wait on the store: a file store writes one file per metric); each event a tag
    ``event.<n>``; at the end the summary figures as ``summary/<key>`` and the artifacts
    ``events.jsonl`` and ``summary.json``."""

    name = "mlflow"

    def __init__(self, settings: Mapping[str, Any]):
        super().__init__(settings)
        self._mlflow = _require("mlflow", self.name)

    def open(self, run_dir: Path, start_step: int, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        s = self.settings
        uri = str(s.get("tracking_uri") or f"file:{(run_dir / 'mlruns').resolve()}")
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store only behind this switch (it recommends sqlite,
            # which needs the full mlflow package); a local store needs no server or database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = c = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.events: list[dict[str, Any]] = []
        exp_name = str(s.get("experiment") or "finetune")
        exp = c.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp is not None else c.create_experiment(exp_name)

        def new_run() -> str:
            return c.create_run(exp_id, run_name=s.get("run_name") or run_dir.name,
                                tags={str(k): str(v) for k, v in redact_tree(dict(s.get("tags") or {})).items()}
                                ).info.run_id

        self.run_id, existed = _saved_id(run_dir, f"mlflow_{exp_id}", new_run)
        if existed:
            c.update_run(self.run_id, status="RUNNING")
        elif s.get("log_params", True):
            params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                c.log_batch(self.run_id, params=params[i:i + 100])
        from collections import deque

        from mlflow.entities import Metric

        self._metric = Metric
        self._ops: deque[Any] = deque()  # MLflow's pending log_batch calls

    def _drain(self, keep: int = 0) -> None:
        """Wait for the asynchronous batches, all but the newest ``keep``. Anything that reads
        the store (log_dict, log_text, set_terminated read the run) drains first: a file
        store read racing MLflow's writer threads finds a metric file empty ("malformed")."""
        while len(self._ops) > keep:
            op = self._ops.popleft()
            if op is not None:
                op.wait()

    def log_step(self, rec: dict[str, Any], values: dict[str, float]) -> None:
        ts, step, M = int(time.time() * 1000), int(rec["step"]), self._metric
        metrics = [M(t, float(v), ts, step) for t, v in values.items()]
        self._ops.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))
        self._drain(keep=100)  # a bounded backlog: a store that falls 100 steps behind slows the loop

    def log_event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        self.client.set_tag(self.run_id, f"event.{len(self.events)}", event_text(ev)[:5000])

    def log_summary(self, summary: dict[str, Any]) -> None:
        ts, step, M = int(time.time() * 1000), int(summary.get("steps") or 0), self._metric
        self._drain()
        self.client.log_batch(self.run_id, metrics=[M(f"summary/{k}", float(v), ts, step)
                                                    for k, v in summary_scalars(summary).items()])
        self.client.log_dict(self.run_id, summary, "summary.json")

    def close(self, status: str) -> None:
        if getattr(self, "client", None) is None:
            return
        self._drain()
        if self.events:
            self.client.log_text(self.run_id, "".join(json.dumps(e) + "\n" for e in self.events),
                                 "events.jsonl")
        self.client.set_terminated(self.run_id, status={"finished": "FINISHED", "killed": "KILLED"}
                                   .get(status, "FAILED"))


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# The ``logger`` group's options. ``jsonl`` is metrics.jsonl itself, always written by the
# run log; choosing it (logger=[jsonl,csv]) changes nothing.
LOGGERS: dict[str, type[Logger] | None] = {
    "jsonl": None,
    "csv": CsvLogger,
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
    "mlflow": MlflowLogger,
}


def build(chosen: Mapping[str, Any] | None) -> list[Logger]:
    """The loggers ``cfg.logger`` chose, packages imported (UserError naming the extra when
    one is missing), nothing opened yet."""
    out = []
    for name, settings in (chosen or {}).items():
        if name not in LOGGERS:
            raise UserError(f"logger={name} is not a logger; choose from: {', '.join(LOGGERS)}")
        cls = LOGGERS[name]
        if cls is not None:
            out.append(cls(settings or {}))
    return out
