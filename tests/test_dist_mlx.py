"""backend=mlx under ``mlx.launch -n 2 --backend ring`` on this machine's CPU (localhost): the
collectives of MlxComm, the gradient summed over ranks, rank 0's initial weights on every
rank, saves on rank 0 only, and a two-rank run of the CLI whose losses equal one process of
the same effective batch. Real processes, the tiny model, no mocks.

mlx.launch exits 0 even when a rank fails (it only prints "[WARN] Node with rank R exited
with code C"), so every launch here is judged by its output and the files the ranks wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from finetune.backends.base import Comm
from finetune.backends.mlx.distributed import launcher_backend
from finetune.backends.mlx.runtime import MlxBackend
from finetune.config import ModelConfig
from finetune.model.tiny import build_tiny

from conftest import REPO, finetune_cmd, make_cfg
import warm_cli

pytestmark = pytest.mark.mlx

SCRIPT = REPO / "tests" / "dist_scripts" / "mlx_comm.py"
LAUNCH_TIMEOUT_S = 600  # MLX on a shared 2-core CPU: a launch that needs ~20 s may take minutes
_LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE")


# A few steps (MLX on CPU is slow); lr high enough that the weights move between steps.
E2E = ("backend=mlx", "model=tiny", "train.steps=3", "train.progress=false", "data.num_samples=64",
       "train.eval_every=0", "train.warmup_steps=1", "optim.lr=1e-2")
LOSS_TOL = 1e-5  # per-step mean loss, nats/token: measured differences are below 1e-6


def mlx_launch() -> list[str]:
    """This interpreter's ``mlx.launch`` console script, else its entry point through -c."""
    script = Path(sysconfig.get_path("scripts")) / "mlx.launch"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]


def free_ports(n: int = 2) -> int:
    """A first port of ``n`` consecutive free ones on 127.0.0.1 (the ring listens on port + rank):
    mlx.launch's default 32323 would collide with anyone else's launch on this machine."""
    for _ in range(100):
        first = random.randrange(20000, 60000)
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def launch(n: int, command: list[str], log_dir: Path) -> str:
    """Run ``command`` on ``n`` local ranks under mlx.launch's ring; return the combined output
    after checking that every rank exited 0. stdin is a pipe that stays open: on a closed or
    /dev/null stdin mlx.launch's select loop spins a core."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    with open(log_dir / "out.log", "wb") as out, open(log_dir / "err.log", "wb") as err:
        p = subprocess.Popen([*mlx_launch(), "-n", str(n), "--backend", "ring", "-p", str(free_ports(n)), *command],
                             stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=REPO, env=env)
        try:
            p.wait(timeout=LAUNCH_TIMEOUT_S)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdin.close()
    text = (log_dir / "out.log").read_text(errors="replace") + (log_dir / "err.log").read_text(errors="replace")
    assert p.returncode == 0 and "[WARN]" not in text, text[-4000:]
    return text


def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in _LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    # built before any launch: two ranks building the cached tiny model at once would race
    return build_tiny(ModelConfig())


def test_launcher_backend_reads_the_environment(tmp_path: Path) -> None:
    two, one = tmp_path / "two.json", tmp_path / "one.json"
    two.write_text('[["127.0.0.1:5000"], ["127.0.0.1:5001"]]\n')
    one.write_text("\n")  # mlx.launch -n 1 writes an empty hostfile
    assert launcher_backend({}) is None
    assert launcher_backend({"MLX_RANK": "0", "MLX_HOSTFILE": str(two)}) == "ring"
    assert launcher_backend({"MLX_RANK": "0", "MLX_HOSTFILE": str(one)}) is None
    assert launcher_backend({"MLX_RANK": "1", "MLX_HOSTFILE": str(tmp_path / "gone")}) == "ring"  # init says why
    assert launcher_backend({"MLX_RANK": "0", "MLX_IBV_DEVICES": "/tmp/x", "MLX_JACCL_COORDINATOR": "a:1"}) == "jaccl"
    assert launcher_backend({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert launcher_backend({"OMPI_COMM_WORLD_SIZE": "1"}) is None


def test_no_launcher_is_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_launcher(monkeypatch)
    comm = MlxBackend().connect(None)
    assert type(comm) is Comm and comm.world_size == 1 and comm.rank == 0


def test_broken_launch_fails_in_one_line(tmp_path: Path) -> None:
    """A ring port someone else holds: rank 0 cannot listen, and the CLI says what to change in
    one line (exit 2, no traceback, no run dir left)."""
    port = free_ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    run = tmp_path / "run"
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    try:
        r = warm_cli.run([*finetune_cmd(), *E2E, f"hydra.run.dir={run}"], capture_output=True, text=True,
                           timeout=LAUNCH_TIMEOUT_S, cwd=tmp_path,
                           env={**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)})
    finally:
        held.close()
    assert r.returncode == 2, r.stderr
    msg = r.stderr.strip()
    assert "\n" not in msg and "Traceback" not in msg, msg
    assert "mx.distributed.init(backend=ring) failed" in msg and "Address already in use" in msg, msg
    assert "mlx.launch -p PORT" in msg and not run.exists(), msg


def test_comm_and_summed_gradient_under_mlx_launch(model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks: exact float64 reductions, objects of different sizes gathered, rank 0's LoRA
    init on rank 1 (which seeded another), one optimizer step on half the batch each equal to
    one process's step on the whole batch, and only rank 0 writing. The one-process reference
    runs the script's main in this process (no launcher: world size 1), sparing a start-up."""
    one, two = tmp_path / "one", tmp_path / "two"
    _no_launcher(monkeypatch)
    spec = importlib.util.spec_from_file_location("mlx_comm", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for d in ("adapter", "state"):
        (one / d).mkdir(parents=True)
    script.main(one, model_dir)
    launch(2, [sys.executable, str(SCRIPT), str(two), str(model_dir)], tmp_path / "logs")
    ref = json.loads((one / "rank0.json").read_text())
    r0, r1 = (json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1))

    assert ref["world_size"] == 1 and ref["description"] == "one process"
    assert (r0["rank"], r1["rank"], r0["world_size"], r1["world_size"]) == (0, 1, 2, 2)
    assert (r0["local_rank"], r1["local_rank"]) == (0, 1)  # both on this host
    assert r0["description"] == "mx.distributed ring: 2 processes on 1 host(s)"
    for r in (r0, r1):
        assert r["sum"] == [2.0 + 2.0**-40, 30.0, -2.0]  # 2**-40 survives: float64, not float32
        assert r["max"] == [1.0, 0.0, 3.5] and r["empty"] == []
        assert r["gathered"] == [{"rank": 0, "blob": "x", "t": [0, None]},
                                 {"rank": 1, "blob": "x" * 1001, "t": [1, None]}]
        # rank 1 seeded 1001, rank 0 (and the one process) 1000: the broadcast won
        assert r["init_digest"] == ref["init_digest"]
        assert r["loss_sum"] == pytest.approx(ref["loss_sum"], rel=1e-6)
        # summed, not averaged: the norm of the one-process gradient (clipped at 0.1 after)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5) and r["grad_norm"] > 0.1
    assert r0["grad_norm"] == r1["grad_norm"] and r0["step_digest"] == r1["step_digest"]  # bit for bit
    assert r0["weights"].keys() == ref["weights"].keys()
    for k, v in ref["weights"].items():
        assert r0["weights"][k] == pytest.approx(v, abs=1e-7), k
    for d in ("adapter", "state"):  # rank 1 was given None: it wrote nothing, rank 0 all of it
        assert sorted(p.name for p in (two / d).iterdir()) == sorted(p.name for p in (one / d).iterdir())


def _metrics(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in ln[:9]]


def test_two_ranks_train_as_one_process(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mlx.launch -n 2 --backend ring finetune backend=mlx ...`` (micro-batch 2, grad_accum 2 per
    rank) trains the samples of one process with micro-batch 2 and grad_accum 4 to the same
    losses and grad norms; summary.json lists both ranks; a checkpoint both ranks resume from
    gives the same last step. The one-process reference trains in this process."""
    from finetune.run import files as checkpoints
    from finetune.run.loop import train
    from finetune.resolver import resolve

    one, two = tmp_path / "one", tmp_path / "two"
    _no_launcher(monkeypatch)
    train(resolve(make_cfg(one, *E2E, "train.batch_size=2", "train.grad_accum=4")))
    ranked = [*finetune_cmd(), *E2E, "train.batch_size=2", "train.grad_accum=2", "train.save_every=2",
              f"hydra.run.dir={two}"]
    launch(2, ranked, tmp_path / "logs")

    ref, got = _metrics(one), _metrics(two)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got):
        assert (b["samples"], b["tokens"]) == (a["samples"], a["tokens"]) == (8, a["tokens"])
        assert abs(b["loss"] - a["loss"]) < LOSS_TOL, (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    s = json.loads((two / "summary.json").read_text())
    assert s["world_size"] == 2 and [r["rank"] for r in s["ranks"]] == [0, 1]
    assert all(r["device"] == "mlx:cpu" and r["peak_allocated"] > 0 for r in s["ranks"])
    assert (two / "adapter" / "adapters.safetensors").is_file()

    # resume both ranks from step 2 (rank 0 wrote it, both load it): step 3 as before
    ckpts = checkpoints.list_checkpoints(two)
    assert [c.name for c in ckpts][-1] == checkpoints.checkpoint_path(two, 3).name
    import shutil

    shutil.rmtree(ckpts[-1])
    launch(2, [*ranked, "train.resume=true"], tmp_path / "logs_resume")
    again = _metrics(two)
    assert [r["step"] for r in again] == [1, 2, 3]
    assert abs(again[2]["loss"] - got[2]["loss"]) < 1e-6 and again[2]["grad_norm"] == pytest.approx(got[2]["grad_norm"], rel=1e-6)
