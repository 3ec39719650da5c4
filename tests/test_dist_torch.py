"""backend=cuda under torchrun on the CPU (gloo): two ranks of DDP and of FSDP train the tiny
model to the losses of one process with the same effective batch; every rank's memory
reaches rank 0's table and summary.json; a planted OOM on one rank lowers the micro-batch
on both at the same step; SIGTERM to one rank checkpoints both, and the resumed run
continues with the uninterrupted losses.

Each run is a real `torchrun --nproc-per-node 2` of `finetune` (about 20 s on two cores);
the runs are shared through module-scoped fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, make_cfg, needs_torch
import warm_cli

pytestmark = needs_torch

COMMON = ["backend=cuda", "backend.device=cpu", "model=tiny", "train.steps=4", "train.eval_every=0",
          "train.progress=false", "train.warmup_steps=1"]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("WORLD_SIZE", None)
    return env


def _run(run_dir: Path, *overrides: str, ranks: int = 2, script: str | None = None,
         fault: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd += [script] if script else ["-m", "finetune"]
    env = _env()
    if fault:
        env["FAULT"] = fault
    r = warm_cli.run([*cmd, *COMMON, *overrides, f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def _one_process(run_dir: Path, *overrides: str) -> None:
    """The one-process reference, trained in this process: what is compared is its losses and
    adapter, not the process around it (a CLI subprocess would add ~7 s of imports)."""
    from finetune.run.loop import train
    from finetune.resolver import resolve

    train(resolve(make_cfg(run_dir, *COMMON, *overrides)))


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.startswith('{"step"')]


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(ln)["event"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
            if ln.startswith('{"event"')]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _steps(run_dir)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess[str] | None]]:
    """One process at micro-batch 4, and two ranks at micro-batch 2 each (the same 4 samples
    per optimizer step) with ddp and with fsdp (fsdp checkpointing every 2 steps)."""
    base = tmp_path_factory.mktemp("dist")
    out = {}
    _one_process(base / "one", "train.batch_size=4")
    out["one"] = (base / "one", None)
    out["ddp"] = (base / "ddp", _run(base / "ddp", "train.batch_size=2", "backend.strategy=ddp"))
    out["fsdp"] = (base / "fsdp", _run(base / "fsdp", "train.batch_size=2", "backend.strategy=fsdp",
                                       "train.save_every=2"))
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_the_one_process_losses(runs, strategy: str) -> None:
    one, _ = runs["one"]
    d, r = runs[strategy]
    ref, got = _steps(one), _steps(d)
    assert [s["step"] for s in got] == [1, 2, 3, 4]
    assert [s["loss"] for s in got] == pytest.approx([s["loss"] for s in ref], rel=1e-5)
    assert [s["grad_norm"] for s in got] == pytest.approx([s["grad_norm"] for s in ref], rel=1e-4)
    assert [s["tokens"] for s in got] == [s["tokens"] for s in ref]  # the same samples, every rank's counted
    assert "2 ranks (" + strategy + ")" in r.stderr
    # the adapter rank 0 wrote holds the one-process weights (fsdp: gathered from the shards)
    from safetensors.torch import load_file

    a, b = load_file(str(one / "adapter" / "adapter_model.safetensors")), load_file(str(d / "adapter" / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_two_ranks_packed_train_the_one_process_packed_losses(runs, tmp_path: Path) -> None:
    """train.packing under two ranks: each rank packs its own slice of the step's samples; the
    loss is still 1 over the label tokens of the whole step, so the losses are the one process's
    (packed, the same 4 samples a step), which are the unpacked ones too."""
    over = ("train.packing=true", "train.tokens_per_micro=128")
    _one_process(tmp_path / "one", "train.batch_size=4", *over)
    two = _run(tmp_path / "two", "train.batch_size=2", "backend.strategy=ddp", *over)
    ref, got, unpacked = _steps(tmp_path / "one"), _steps(tmp_path / "two"), _steps(runs["one"][0])
    assert [s["loss"] for s in got] == pytest.approx([s["loss"] for s in ref], rel=1e-5)
    assert [s["loss"] for s in ref] == pytest.approx([s["loss"] for s in unpacked], rel=1e-5)
    assert [s["tokens"] for s in got] == [s["tokens"] for s in ref] == [s["tokens"] for s in unpacked]
    assert "2 ranks (ddp)" in two.stderr


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_reported_with_an_overall_row(runs, strategy: str) -> None:
    d, r = runs[strategy]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == strategy
    assert [x["rank"] for x in summary["ranks"]] == [0, 1]
    per = summary["memory"]["per_rank"]
    rss = [x["peak_rss"] for x in summary["ranks"]]
    assert all(v and v > 0 for v in rss)
    assert per["overall"]["peak_rss"]["sum"] == sum(rss)  # process figures: summed over ranks
    assert per["overall"]["peak_rss"]["max"] == max(rss)
    table = r.stderr[r.stderr.index("memory per rank (2 ranks)"):]
    rows = [ln.split()[0] for ln in table.splitlines()[3:8]]
    assert rows == ["0", "1", "Overall", "min", "max"]
    # explanations name their rank; every rank's reached rank 0
    texts = [e["text"] for e in summary["memory"]["explanations"]]
    assert any(t.startswith("rank 0:") for t in texts) and any(t.startswith("rank 1:") for t in texts)
    # rank 1 wrote nothing of its own: one run dir, one metrics.jsonl
    assert len(_steps(d)) == 4


def test_fsdp_shards_the_optimizer_state_over_the_ranks(runs) -> None:
    census = {k: json.loads((runs[k][0] / "summary.json").read_text())["memory"]["census_end"] for k in ("ddp", "fsdp")}
    f, d = census["fsdp"], census["ddp"]
    # every LoRA matrix of the tiny model has an even first dimension: each rank holds half of it
    assert f["trainable_weights_bytes"] * 2 == d["trainable_weights_bytes"] > 0
    # Adam's moments are sharded with their parameter; its step counters (a 4-byte scalar per
    # parameter) are not
    steps = 4 * 8  # 8 LoRA matrices (q_proj, v_proj x A, B x 2 layers)
    assert (f["optimizer_state_bytes"] - steps) * 2 == d["optimizer_state_bytes"] - steps > 0
    assert f["frozen_weights_bytes"] < d["frozen_weights_bytes"]


def test_fsdp_resumes_from_its_sharded_checkpoint(runs, tmp_path: Path) -> None:
    src, _ = runs["fsdp"]
    d = tmp_path / "resume"
    shutil.copytree(src, d)
    ckpt = d / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_0000002", "step_0000004"]
    assert sorted(p.name for p in (ckpt / "step_0000002" / "backend" / "dcp").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]  # one shard file per rank
    shutil.rmtree(ckpt / "step_0000004")
    r = _run(d, "train.batch_size=2", "backend.strategy=fsdp", "train.save_every=2", "train.resume=true")
    assert r.stderr.count("resumed from") == 1 and "step_0000002 at step 2" in r.stderr  # said once, by rank 0
    assert _losses(d) == pytest.approx(_losses(src), rel=1e-6)


def test_oom_on_one_rank_lowers_the_micro_batch_on_both(runs, tmp_path: Path) -> None:
    one, _ = runs["one"]
    d = tmp_path / "oom"
    r = _run(d, "train.batch_size=2", script=str(REPO / "tests" / "dist_scripts" / "torch_rank1_fault.py"), fault="oom")
    ev = _events(d)
    assert [(e["step"], e["trigger"], e["action"], e.get("ranks"), e["before"]["batch_size"], e["after"]["batch_size"])
            for e in ev] == [(2, "oom", "lower_micro_batch", [1], 2, 1)]
    assert "[governor] step 2: oom -> lower_micro_batch" in r.stderr
    summary = json.loads((d / "summary.json").read_text())
    assert summary["micro_batch"] == 1
    # both ranks went on in step (a rank that had not lowered would have split its slice
    # differently; the sums would differ or the collectives would hang) to the unadapted losses
    assert _losses(d) == pytest.approx(_losses(one), rel=1e-5)


def test_sigterm_to_one_rank_checkpoints_both_and_resume_is_exact(runs, tmp_path: Path) -> None:
    ddp, _ = runs["ddp"]
    d = tmp_path / "term"
    script = str(REPO / "tests" / "dist_scripts" / "torch_rank1_fault.py")
    r = _run(d, "train.batch_size=2", "train.save_every=100", script=script, fault="sigterm", check=False)
    assert r.returncode != 0
    assert "stopped by a signal to another rank after step 2" in r.stderr or "stopped by SIGTERM after step 2" in r.stderr
    assert [p.name for p in (d / "checkpoints").iterdir()] == ["step_0000002"]
    assert len(_steps(d)) == 2
    r = _run(d, "train.batch_size=2", "train.save_every=100", "train.resume=true")
    assert _losses(d) == pytest.approx(_losses(ddp), rel=1e-6)
