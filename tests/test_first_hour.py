"""A newcomer's first hour (issue 31), through the console script as a user types it: the data a
run really trains on, advice in a plan that does not fit typed as overrides and ordered by what
it costs, a suggestion for a short key given by its full path, a fractional budget refused with
the percentage to type, no governor line for a change that changes nothing, and no cli.log.

Every child runs this checkout's code (PYTHONPATH names it first)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import HAS_MLX, HAS_TORCH, REPO, finetune_cmd, needs_mlx
import warm_cli

from finetune import planner
from finetune.config import compose
from finetune.planner.fit import LEVER_COSTS
from finetune.model.inventory import GIB
from finetune.resolver import resolve

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
       "HF_HUB_OFFLINE": "1"}
QUIET = ("train.progress=false", "train.eval_every=0", "train.warmup_steps=0", "memory.sample_every=1")


def _finetune(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return warm_cli.run([*finetune_cmd(), *args], capture_output=True, text=True, timeout=timeout, env=ENV,
                          cwd=cwd)


def _refused(r: subprocess.CompletedProcess, line: str, run_dir: Path) -> None:
    """Exit 2, the one line on stderr, no traceback, nothing written."""
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and r.stderr.strip().splitlines() == [line], r.stderr
    assert not run_dir.exists()


def _jsonl(path: Path, n: int, long_text: str | None = None) -> Path:
    rows = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(n)]
    if long_text:
        rows.append({"text": long_text})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- the data really used ------------------------------------------------------------------

@pytest.mark.skipif(not (HAS_TORCH or HAS_MLX), reason="needs torch or mlx to train")
def test_data_path_alone_trains_on_that_file_and_says_so(tmp_path: Path) -> None:
    """`finetune data.path=train.jsonl` (no data=jsonl): one line says the file chose data=jsonl,
    the run's first lines name the file, its samples and the format read, and the run trains on
    its 40 records, not the 2,000 built-in ones."""
    data = _jsonl(tmp_path / "train.jsonl", 40)
    run = tmp_path / "run"
    backend = "cuda" if HAS_TORCH else "mlx"
    r = _finetune(f"data.path={data}", f"backend={backend}", "train.steps=2", *QUIET,
                  f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    assert lines[0] == f"data.path={data}: training on that file's records, data=jsonl (type data=jsonl to say so)"
    said = next(i for i, ln in enumerate(lines) if ln.startswith("data: "))
    assert said <= 4, lines[:6]  # among the run's first lines, before any step
    assert lines[said] == (f"data: data=jsonl {data}: 40 samples (38 train, 2 validation) from 40 records; format "
                           "prompt/completion; prompts carry no loss (data.mask_prompt=true)")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"]["records"] == 40 and summary["data"]["formats"] == {"prompt/completion": 40}
    assert "data=jsonl" in (run / ".hydra" / "overrides.yaml").read_text()  # the choice, as typed for the user
    assert "synthetic" not in r.stderr


def test_a_hub_dataset_id_in_data_path_chooses_hf(tmp_path: Path) -> None:
    r = _finetune("data.path=openai/gsm8k", "--cfg", "job")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.splitlines()[0] == ("data.path=openai/gsm8k is a hub data set id, not a local file: training on "
                                        "data=hf data.hf_name=openai/gsm8k (type those to say so)")
    data = r.stdout[r.stdout.index("\ndata:\n"):]
    assert "  name: hf\n" in data and "  hf_name: openai/gsm8k\n" in data and "  path: null\n" in data


def test_a_data_key_the_chosen_group_ignores_is_refused(tmp_path: Path) -> None:
    """An explicit data group that would ignore a data.* key: one line naming the group that
    reads it, exit 2, no run dir."""
    data = _jsonl(tmp_path / "train.jsonl", 8)
    run = tmp_path / "run"
    _refused(_finetune("data=synthetic", f"data.path={data}", f"hydra.run.dir={run}"),
             f"error: data.path={data} is not read by data=synthetic, which would ignore it; choose data=jsonl, "
             "or drop data.path", run)
    _refused(_finetune("data=jsonl", f"data.path={data}", "data.num_samples=50", f"hydra.run.dir={run}"),
             "error: data.num_samples=50 is not read by data=jsonl, which would ignore it; choose data=synthetic, "
             "or drop data.num_samples (data.max_samples caps the records of a file or a hub data set)", run)


# ---- advice you can type -------------------------------------------------------------------

def _rank(change: str) -> int:
    first = change.split()[0]
    return next(i for i, (name, _) in enumerate(LEVER_COSTS) if first == name or first.split("=")[0] == name)


def _replanned(tmp_path: Path, over: tuple[str, ...], change: str) -> dict:
    return planner.plan(resolve(compose(tmp_path / "again", "mode=plan", *over, *change.split())), recommend=False)


def test_a_plan_that_does_not_fit_prints_each_lever_as_overrides_cheapest_first(tmp_path: Path) -> None:
    """Full fine-tuning of an 8B model in 48 GiB: method=lora fits (and is offered, before
    qlora), more GPUs come last; each lever, typed as printed, plans under the budget at the
    peak it names, and what it saves is the configured peak less that."""
    over = ("backend=cuda", "model=llama3-8b", "method=full", "memory.budget=48GiB")
    r = _finetune("mode=plan", *over, f"hydra.run.dir={tmp_path / 'plan'}")
    assert r.returncode == 0, r.stderr[-3000:]
    p = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert p["fits"] is False
    levers = p["recommendation"]["levers"]
    changes = [lv["change"] for lv in levers]
    assert "method=lora" in changes and changes.index("method=lora") < changes.index("method=qlora")
    assert changes[-1].startswith("backend.device_map=auto backend.num_devices=")
    assert [_rank(c) for c in changes] == sorted(_rank(c) for c in changes)  # cheapest first
    out = r.stdout.splitlines()
    head = out.index("  to fit the budget, type any one of these (cheapest first):")
    for lv, line in zip(levers, out[head + 1:]):
        assert line.startswith(f"    {lv['change']} ") and f"saves {lv['saves_bytes'] / GIB:6.2f} GiB" in line, line
        assert lv["saves_bytes"] == p["fits_bytes"] - lv["peak_bytes"] > 0
        again = _replanned(tmp_path, over, lv["change"])
        assert again["fits"] is True and again["fits_bytes"] == lv["peak_bytes"], lv["change"]
    assert "  with memory.adapt=true (the default) the governor cannot fit it" in r.stdout


def test_the_largest_micro_batch_is_typed_and_the_governor_applies_it(tmp_path: Path) -> None:
    """DoRA on an 8B model in 20 GiB: micro-batch 2 fits, printed as the overrides that keep the
    effective batch, which the governor applies itself; the micro-batch lever comes first, then
    checkpointing. Without memory.adapt the line says the run changes nothing."""
    over = ("backend=cuda", "model=llama3-8b", "method=dora", "memory.budget=20GiB")
    r = _finetune("mode=plan", *over, f"hydra.run.dir={tmp_path / 'plan'}")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "plan" / "plan.json").read_text())["recommendation"]
    assert rec["largest_micro_batch"]["change"] == "train.batch_size=2 train.grad_accum=2"
    assert rec["governor"] == {"adapt": True, "fits": True, "change": "train.batch_size=2 train.grad_accum=2",
                               "peak_bytes": rec["largest_micro_batch"]["peak_bytes"]}
    assert [lv["change"] for lv in rec["levers"]][:2] == ["train.batch_size=2 train.grad_accum=2",
                                                          "train.grad_checkpointing=true"]
    assert ("  largest micro-batch that fits: 2: train.batch_size=2 train.grad_accum=2 (the same effective batch 4)"
            in r.stdout.splitlines())
    assert ("  with memory.adapt=true (the default) the governor applies train.batch_size=2 train.grad_accum=2 "
            f"itself before loading (peak {rec['governor']['peak_bytes'] / GIB:.2f} GiB)") in r.stdout.splitlines()
    off = _finetune("mode=plan", *over, "memory.adapt=false", f"hydra.run.dir={tmp_path / 'off'}")
    assert "  memory.adapt=false: the run changes nothing itself (with memory.adapt=true the governor applies " \
           "train.batch_size=2 train.grad_accum=2" in off.stdout


def test_the_largest_micro_batch_that_fits_may_exceed_the_configured_one(tmp_path: Path) -> None:
    """A plan that fits searches above the configured micro-batch: the largest that fits,
    typed, and one more does not fit."""
    over = ("backend=cuda", "model=qwen2-7b", "memory.budget=40GiB", "train.batch_size=2", "train.grad_accum=4")
    r = _finetune("mode=plan", *over, f"hydra.run.dir={tmp_path / 'plan'}")
    assert r.returncode == 0, r.stderr[-3000:]
    big = json.loads((tmp_path / "plan" / "plan.json").read_text())["recommendation"]["largest_micro_batch"]
    b = big["batch_size"]
    assert b > 8 and big["change"] == f"train.batch_size={b} train.grad_accum=1"
    assert _replanned(tmp_path, over, big["change"])["fits"] is True
    assert _replanned(tmp_path, over, f"train.batch_size={b + 1} train.grad_accum=1")["fits"] is False
    assert (f"  largest micro-batch that fits: {b}: train.batch_size={b} train.grad_accum=1 (an effective batch of "
            f"{b}, not 8: other math; train.batch_size=8 train.grad_accum=1 keeps it; the governor lowers a "
            "micro-batch that does not fit, never raises one: type it to use it)") in r.stdout.splitlines()


# ---- the smaller things --------------------------------------------------------------------

def test_a_short_key_is_suggested_by_its_full_path(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _refused(_finetune("lr=1e-4", f"hydra.run.dir={run}"), "error: lr is not a config key; did you mean: optim.lr", run)
    _refused(_finetune("+lr=1e-4", f"hydra.run.dir={run}"), "error: lr is not a config key; did you mean: optim.lr",
             run)


def test_a_fractional_budget_is_refused_naming_the_percentage(tmp_path: Path) -> None:
    """memory.budget=0.9: refused (a bare number counts bytes; 0.99 read as 99% beside 1 as a byte
    would put a cliff at 1), naming memory.budget=90%, which plans."""
    run = tmp_path / "run"
    _refused(_finetune("mode=plan", "memory.budget=0.9", f"hydra.run.dir={run}"),
             "error: memory.budget=0.9 is a fraction, not a size; for 90% of the device write memory.budget=90%", run)
    r = _finetune("mode=plan", "memory.budget=90%", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "plan.json").read_text())["budget_source"] == "memory.budget=90%"


@pytest.fixture(scope="module")
def mlx_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """An mlx run with no budget, on data with one record longer than train.seq_len (a warning)."""
    tmp = tmp_path_factory.mktemp("mlx")
    data = _jsonl(tmp / "train.jsonl", 40, long_text="one two three " * 40)
    run = tmp / "run"
    r = _finetune("backend=mlx", "data=jsonl", f"data.path={data}", "train.steps=3", "train.seq_len=32", *QUIET,
                  f"data.cache_dir={tmp / 'cache'}", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    return r, run


@needs_mlx
def test_no_governor_line_for_a_change_that_changes_nothing(mlx_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    """memory.cache_limit=auto derives MLX's own default (32 MiB) for a tiny step: no event, no
    [governor] line; every event left changes something."""
    r, run = mlx_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["memory"]["last"]["mlx_cache_limit_bytes"] == 32 << 20  # the limit stayed MLX's default
    events = [json.loads(ln)["event"] for ln in (run / "metrics.jsonl").read_text().splitlines() if '"event"' in ln]
    assert not [e for e in events if e["action"] == "set_mlx_cache_limit"]
    for ev in events:
        assert any(ev["before"].get(k) != v for k, v in ev["after"].items()), ev
    shown = [ln for ln in r.stderr.splitlines() if "[governor]" in ln]
    assert len(shown) == len(events) and not any("set_mlx_cache_limit" in ln for ln in shown)


@needs_mlx
def test_no_cli_log_is_written_and_warnings_reach_the_console(mlx_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    """The run dir holds no cli.log (it only ever held the logging records, not what the console
    showed); a warning still reaches the console."""
    r, run = mlx_run
    assert not list(run.glob("*.log"))
    assert "1 of 41 samples were longer than train.seq_len=32 and were truncated" in r.stdout + r.stderr


# ---- the default job learns, and says so in its last line -----------------------------------

@pytest.mark.skipif(not (HAS_TORCH or HAS_MLX), reason="needs torch or mlx to train")
def test_the_default_job_visibly_learns_and_ends_with_its_done_line(tmp_path: Path) -> None:
    """`finetune` with nothing set (only the run dir placed in tmp): the loss falls well below a
    uniform guess over the tiny model's 512 tokens (ln 512 = 6.24), and the last line says so,
    with the figures summary.json holds; the README's first screen shows that line."""
    import math
    import re

    run = tmp_path / "run"
    r = _finetune("train.progress=false", f"hydra.run.dir={run}", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    uniform = math.log(512)
    assert abs(s["first_loss"] - uniform) < 0.5, s["first_loss"]  # it starts as a random model does
    assert s["final_val_loss"] < uniform - 1.0 and s["final_train_loss"] < uniform - 1.0, s
    last = r.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"done: (\d+) steps \| train loss ([\d.]+) -> ([\d.]+) \| val loss ([\d.]+) \| ([\d,]+) tokens/s"
                     r" \| peak .+", last)
    assert m, last
    assert int(m[1]) == s["steps"] == s["steps_this_run"]
    assert [float(m[i]) for i in (2, 3, 4)] == [round(s[k], 2) for k in ("first_loss", "final_train_loss",
                                                                         "final_val_loss")]
    assert int(m[5].replace(",", "")) == round(s["tokens_per_sec"])
    first_screen = "\n".join((REPO / "README.md").read_text().splitlines()[:40])
    shown = re.search(r"^done: \d+ steps \| train loss [\d.]+ -> ([\d.]+) \| val loss ([\d.]+) \| .+$", first_screen, re.M)
    assert shown, "the README's first screen shows the default job's done line"
    assert float(shown[2]) < uniform - 1.0
