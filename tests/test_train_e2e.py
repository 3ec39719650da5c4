"""End to end: the one loop trains the tiny model on both real backends and writes the run dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import HAS_TORCH, finetune_cmd, needs_mlx, needs_torch
import warm_cli

from finetune.run.loop import train
from finetune.resolver import resolve

FAST = ("train.steps=30", "train.eval_every=15", "train.progress=false", "data.num_samples=400",
        "train.warmup_steps=2", "optim.lr=1e-2")


def _metrics(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in ln[:9]]


def _check_run_dir(run: Path, summary: dict, backend: str) -> None:
    assert summary["backend"] == backend
    s = json.loads((run / "summary.json").read_text())
    for key in ("backend", "device", "model_path", "params_total", "params_trainable", "steps", "samples", "tokens",
                "tokens_per_sec", "wall_s", "final_train_loss", "final_val_loss", "memory"):
        assert key in s, key
    assert Path(s["model_path"], "config.json").is_file()
    assert s["tokens"] > 0 and s["tokens_per_sec"] > 0 and 0 < s["params_trainable"] <= s["params_total"]
    m = _metrics(run)
    assert [r["step"] for r in m] == list(range(1, s["steps"] + 1))
    assert all(r["tokens"] > 0 and r["tokens_per_sec"] > 0 for r in m)
    assert any(run.joinpath("adapter").iterdir())
    assert not list(run.glob(".*.tmp")), "a temporary file was left behind"


# Drop of the mean loss over the first 5 steps to the last 5 of FAST (nats per token), as
# measured on both backends (cuda on CPU | mlx on CPU): lora 0.193 | 0.183, dora 0.159 | 0.152,
# qlora 0.193, lora+adafactor 0.221, lora+bf16-mixed 0.193, full+8-bit adamw 2.647 | 2.643.
# Each bar is ~70% of the smaller measurement: a random-init model's adapters learn slowly,
# the full model fast, so one bar for all would say nothing about full.
DROP = {"lora": 0.13, "dora": 0.11, "qlora": 0.13, "full": 1.9}


def _loss_fell(run: Path, by: float) -> None:
    m = _metrics(run)
    first = sum(r["loss"] for r in m[:5]) / 5
    last = sum(r["loss"] for r in m[-5:]) / 5
    assert last < first - by, (first, last, by)


@needs_torch
@pytest.mark.parametrize("overrides", [
    ("method=lora",), ("method=dora",), ("method=full", "optim=adamw_8bit"), ("method=full", "optim=paged_adamw_8bit"),
    ("method=qlora",), ("method=lora", "optim=adafactor"), ("method=lora", "precision=bf16-mixed"),
], ids=lambda o: "+".join(x.split("=")[1] for x in o))
def test_cuda_backend_trains_tiny_on_cpu(cfg_factory, tmp_path, overrides):
    cfg = cfg_factory("backend=cuda", *FAST, *overrides)
    summary = train(resolve(cfg))
    run = Path(cfg.run_dir)
    _check_run_dir(run, summary, "cuda")
    _loss_fell(run, DROP[cfg.method.name])
    if "method=full" not in overrides:
        assert (run / "adapter" / "adapter_config.json").is_file()  # PEFT format


@needs_mlx
@pytest.mark.parametrize("method", ["lora", "dora", "full"])
def test_mlx_backend_trains_tiny(cfg_factory, method):
    cfg = cfg_factory("backend=mlx", f"method={method}", *FAST)
    summary = train(resolve(cfg))
    run = Path(cfg.run_dir)
    _check_run_dir(run, summary, "mlx")
    _loss_fell(run, DROP[method])
    if method != "full":
        assert (run / "adapter" / "adapters.safetensors").is_file()  # mlx-lm format


@needs_torch
def test_cuda_trains_on_real_text(cfg_factory, gsm8k):
    cfg = cfg_factory("backend=cuda", "data=jsonl", f"data.path={gsm8k}", "data.max_samples=600",
                      "train.seq_len=192", *(f for f in FAST[1:] if not f.startswith("data.num_samples=")),
                      "train.steps=60",
                      "method.lora.keys=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]")
    summary = train(resolve(cfg))
    assert summary["data"]["records"] == 600 and summary["data"]["truncated"] > 0
    _loss_fell(Path(cfg.run_dir), by=0.07)  # real text is harder than the built-in arithmetic: measured 0.097


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs_torch), pytest.param("mlx", marks=needs_mlx)])
def test_resume_equals_uninterrupted(cfg_factory, tmp_path, backend):
    common = ("train.progress=false", "data.num_samples=200", "train.eval_every=0", "method.lora.dropout=0.1",
              f"backend={backend}", "train.steps=8", "train.save_every=4")
    straight = train(resolve(cfg_factory(*common, run_dir=tmp_path / "a")))
    # The same job, then rewound to its step-4 checkpoint as if killed after step 4; the resumed
    # run rebuilds the backend from scratch and loads only what the checkpoint holds.
    train(resolve(cfg_factory(*common, run_dir=tmp_path / "b")))
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_0000008")
    resumed = train(resolve(cfg_factory(*common, "train.resume=true", run_dir=tmp_path / "b")))
    assert resumed["steps_this_run"] == 4
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 9))
    tol = 1e-5 if backend == "cuda" else 1e-4
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=tol), (ra["step"], ra["loss"], rb["loss"])
    assert resumed["tokens"] == straight["tokens"] and resumed["samples"] == straight["samples"]


@needs_torch
def test_resume_needs_the_same_effective_batch_not_the_same_split(cfg_factory, tmp_path):
    """A checkpoint of micro-batch 4 x 1 resumes as 2 x 2 (the same 4 samples a step); as 2 x 1
    it is refused, naming the rule."""
    from finetune.errors import UserError

    common = ("backend=cuda", "train.progress=false", "data.num_samples=100", "train.eval_every=0",
              "train.save_every=1")
    run = tmp_path / "r"
    train(resolve(cfg_factory(*common, "train.steps=1", "train.batch_size=4", "train.grad_accum=1", run_dir=run)))
    with pytest.raises(UserError, match=r"effective batch 4, this run has 2; keep train.batch_size \* train.grad_accum"):
        train(resolve(cfg_factory(*common, "train.steps=2", "train.batch_size=2", "train.grad_accum=1", "train.resume=true",
                          run_dir=run)))
    resumed = train(resolve(cfg_factory(*common, "train.steps=2", "train.batch_size=2", "train.grad_accum=2",
                                "train.resume=true", run_dir=run)))
    assert resumed["steps_this_run"] == 1 and resumed["samples"] == 8


def test_cli_default_job_end_to_end(tmp_path):
    """`finetune` with no group overrides, as a newcomer types it (steps shortened for the suite):
    it trains and writes its run dir; where torch is installed, it prints only our own lines
    (tests/test_quiet.py: the known third-party lines are filtered by name), progress bar included."""
    from test_quiet import OURS

    r = warm_cli.run([*finetune_cmd(), "train.steps=2", f"hydra.run.dir={tmp_path}/run"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "backend=auto chose" in r.stderr
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["steps"] == 2 and (tmp_path / "run" / ".hydra" / "config.yaml").is_file()
    assert (tmp_path / "run" / "adapter").is_dir() and (tmp_path / "run" / "memory.png").is_file()
    if not HAS_TORCH:
        return
    lines = [ln for ln in (r.stdout + r.stderr).replace("\r", "\n").splitlines() if ln.strip()]
    foreign = [ln for ln in lines if not ln.startswith(OURS)]
    assert not foreign, foreign
    assert any(ln.startswith("Memory at the end") for ln in lines)
