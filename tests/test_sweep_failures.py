"""Sweeps finish (issue 20): a job that fails is recorded in its own directory (failed.json:
its error line, exit code and the file holding its output), the sweep goes on to the next job,
the report lists it as failed beside the others, and ``finetune -m`` exits 1 naming it in its
last line; ``fail_fast=true`` stops at the first failure instead, report still written."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
from pathlib import Path

from conftest import finetune_cmd, needs_torch
import warm_cli

from finetune.sweep import _error_line, failed_jobs, job_dirname

COMMON = ("backend=cuda", "data=jsonl", "train.steps=2", "train.eval_every=0", "train.progress=false")


def _jsonl(path: Path, n: int = 24) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) + "\n" for i in range(n)))
    return path


def _sweep(tmp: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "sweep"
    r = warm_cli.run([*finetune_cmd(), "-m", *COMMON, *overrides, f"hydra.sweep.dir={out}"], cwd=tmp,
                       capture_output=True, text=True, timeout=300)
    return r, out


def _last_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stderr.strip().splitlines()[-1]


@needs_torch
def test_a_broken_middle_job_is_listed_and_the_sweep_goes_on(tmp_path: Path) -> None:
    a, b, broken = _jsonl(tmp_path / "a.jsonl"), _jsonl(tmp_path / "b.jsonl"), tmp_path / "broken.jsonl"
    r, out = _sweep(tmp_path, f"data.path={a},{broken},{b}")
    assert r.returncode == 1, r.stderr[-3000:]
    last = _last_line(r)
    assert last.startswith("error: 1 sweep job failed: #1 (") and f"data.path={broken}" in last, last
    jobs = {p.name.split("_", 1)[0]: p for p in out.iterdir() if p.is_dir()}
    assert sorted(jobs) == ["0", "1", "2"]  # the job after the failure ran
    assert (jobs["0"] / "summary.json").is_file() and (jobs["2"] / "summary.json").is_file()
    failed = json.loads((jobs["1"] / "failed.json").read_text())
    assert failed["exit_code"] == 2 and failed["job"] == 1 and "does not exist" in failed["error"]
    log = Path(failed["log"])
    assert log.parent == jobs["1"] and failed["error"] in log.read_text()  # the log is where the error points
    assert f"[sweep] job 1 failed (exit 2): {failed['error']}; log: {log}" in r.stderr
    rows = {r_["job"]: r_ for r_ in csv.DictReader((out / "sweep_summary.csv").open())}
    assert {k: v["status"] for k, v in rows.items()} == {
        f"data.path={a}": "ran", f"data.path={broken}": "failed (exit 2)", f"data.path={b}": "ran"}
    assert rows[f"data.path={broken}"]["error"] == failed["error"] and rows[f"data.path={broken}"]["log"] == str(log)
    md = (out / "sweep_summary.md").read_text()
    assert "| failed (exit 2) |" in md and f"failed: 1 job(s) (data.path={broken}: {failed['error']}" in md
    assert [f["job"] for f in failed_jobs(out)] == [1]


@needs_torch
def test_fail_fast_stops_at_the_first_failure_and_still_reports(tmp_path: Path) -> None:
    a, broken = _jsonl(tmp_path / "a.jsonl"), tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": \n')  # a malformed line 2
    r, out = _sweep(tmp_path, f"data.path={broken},{a}", "fail_fast=true")
    assert r.returncode == 1, r.stderr[-3000:]
    last = _last_line(r)
    assert last.startswith("error: 1 sweep job failed: #0 (") and "broken.jsonl:2 is not valid JSON" in last, last
    assert "fail_fast=true: stopped after job 0 failed" in r.stderr
    assert [p.name.split("_", 1)[0] for p in out.iterdir() if p.is_dir()] == ["0"]  # job 1 never started
    rows = list(csv.DictReader((out / "sweep_summary.csv").open()))
    assert [x["status"] for x in rows] == ["failed (exit 2)"]


@needs_torch
def test_a_job_failing_in_process_is_recorded_with_its_traceback_in_the_job_log(tmp_path: Path) -> None:
    """isolate_jobs=false: the job runs in the sweep's own process; its error is still one line
    and failed.json, and the traceback goes to the job's Hydra log."""
    r, out = _sweep(tmp_path, "isolate_jobs=false", f"data.path={tmp_path / 'missing.jsonl'}")
    assert r.returncode == 1, r.stderr[-3000:]
    assert _last_line(r).startswith("error: 1 sweep job failed: #0")
    (rec,) = failed_jobs(out)
    assert rec["exit_code"] == 2 and Path(rec["log"]).name.endswith(".log")
    assert "Traceback" in Path(rec["log"]).read_text() and "does not exist" in rec["error"]


def test_job_dirname_keeps_the_number_and_the_plain_overrides() -> None:
    assert job_dirname(3, ["optim=sgd", "+extra.api_key=sk-abcdef", "hydra.launcher.n_jobs=2", "backend=cuda",
                           "data.path=/data/x.jsonl", "+extra.hf_token=abc"]) \
        == "3_backend=cuda,data.path=_data_x.jsonl,optim=sgd"  # sorted, as Hydra's override_dirname
    assert job_dirname(0, []) == "0" and job_dirname(1, ["+extra.password=hunter22"]) == "1"
    assert job_dirname(2, ["model.pad_token=<pad>"]) == "2_model.pad_token=<pad>"  # vocabulary, not a secret
    assert len(job_dirname(7, [f"k{i}=" + "v" * 40 for i in range(20)]).encode()) == 200


def test_error_line_names_why_a_job_process_ended() -> None:
    assert _error_line("loading\nerror: data.path=x does not exist\n", 2) == "data.path=x does not exist"
    assert _error_line("Traceback (most recent call last):\n  ...\nRuntimeError: boom\n", 1) == "RuntimeError: boom"
    assert _error_line("", -signal.SIGKILL).startswith("killed by SIGKILL")
    assert _error_line("", 3) == "exited 3 without a message"


def test_failed_jobs_are_listed_by_job_number(tmp_path: Path) -> None:
    for num in (10, 2):
        (tmp_path / f"{num}_x").mkdir()
        (tmp_path / f"{num}_x" / "failed.json").write_text(json.dumps({"job": num, "error": "e"}))
    assert [f["job"] for f in failed_jobs(tmp_path)] == [2, 10]
