"""Shared test helpers: compose real configs the way the CLI does, into a temporary run dir."""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

# One compute thread a test process (and every process it starts: the env is inherited), set
# before torch or an OpenMP runtime is imported. xdist already runs one worker a core, so each
# worker's default of a thread a core oversubscribed the box; on the tiny models tests train, the
# extra threads only synchronized. Measured on the 2-core box (tests/test_preference.py and
# test_packing.py, -n 0, 3 runs each): 1.52x less CPU time, the same results. A caller's own
# OMP_NUM_THREADS is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from omegaconf import OmegaConf

from finetune.config import compose
from finetune.resolver import resolve

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _gsm8k_path() -> Path:
    """GSM8K's train.jsonl: $FINETUNE_GSM8K (the file), else $FINETUNE_SHARED/data/gsm8k/,
    else the conventional ../shared beside the checkout (where CI puts its copy)."""
    if os.environ.get("FINETUNE_GSM8K"):
        return Path(os.environ["FINETUNE_GSM8K"]).expanduser()
    shared = Path(os.environ.get("FINETUNE_SHARED") or REPO.parent / "shared").expanduser()
    return shared / "data" / "gsm8k" / "train.jsonl"


GSM8K = _gsm8k_path()

HAS_MLX = importlib.util.find_spec("mlx") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None


# Composed configs by their overrides, this process's: Hydra reads, parses and merges every YAML
# of conf/ on each compose (~0.1 s), a copy takes ~3 ms, and a file's tests compose the same
# overrides again and again (test_families: 161 composes of 73 distinct lists).
_COMPOSED: dict[tuple[str, ...], Any] = {}


def make_cfg(run_dir: Path | str, *overrides: str) -> Any:
    """Compose conf/ with overrides, exactly as `finetune` would, with run_dir set: a copy of the
    config composed for the same overrides earlier in this process, else composed now."""
    if overrides not in _COMPOSED:
        _COMPOSED[overrides] = compose(run_dir, *overrides)
    cfg = copy.deepcopy(_COMPOSED[overrides])
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = str(run_dir)
    OmegaConf.set_struct(cfg, True)
    return cfg


def make_spec(run_dir: Path | str, *overrides: str) -> Any:
    """The resolved, checked RunSpec of `finetune OVERRIDES...` (make_cfg, then resolve)."""
    return resolve(make_cfg(run_dir, *overrides))


@pytest.fixture
def cfg_factory(tmp_path: Path):
    def _make(*overrides: str, run_dir: Path | None = None) -> Any:
        return make_cfg(run_dir or tmp_path / "run", *overrides)

    return _make


needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx not installed (pip install '.[mlx]')")
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed (bash scripts/setup.sh)")
_NO_GSM8K = (f"{GSM8K} absent: set FINETUNE_GSM8K=/path/to/train.jsonl or FINETUNE_SHARED=/path/to/shared "
             "(it ships beside the project checkout as ../shared)")


@pytest.fixture
def gsm8k() -> Path:
    """The GSM8K file; a test that needs it skips where it is absent, and fails in CI
    (CI=true), where a missing copy is a broken setup rather than a smaller machine."""
    if not GSM8K.is_file():
        if IN_CI:
            pytest.fail(_NO_GSM8K)
        pytest.skip(_NO_GSM8K)
    return GSM8K


def pytest_report_header(config: Any) -> str:
    return f"gsm8k: {GSM8K} ({'found' if GSM8K.is_file() else 'ABSENT: tests that need it ' + ('FAIL (CI)' if IN_CI else 'skip')})"


def finetune_cmd() -> list[str]:
    """The installed `finetune` console script of this interpreter's environment (it imports
    the package first on sys.path, so PYTHONPATH picks which copy runs), else `python -m
    finetune.cli`."""
    script = Path(sysconfig.get_path("scripts")) / "finetune"
    if script.is_file() and Path(sys.executable).parent == script.parent:
        return [str(script)]
    return [sys.executable, "-m", "finetune.cli"]


def cuda_backend_with_oom(raise_when: Any, on: str = "model") -> Any:
    """The real cuda backend with a planted allocation failure: torch's own OutOfMemoryError,
    raised where a real one would come from, whenever ``raise_when(backend, tensor)`` is true.
    ``on="model"``: a forward pre-hook on the model, handed its ``input_ids`` (rows = the
    micro-batch); ``on="head"``: a forward hook on the output head, handed the logits it made.
    ``backend.steps_done`` counts finished optimizer steps, so a failure can start at a step."""
    import torch

    from finetune.backends.cuda.loss import output_head
    from finetune.backends.cuda.runtime import CudaBackend

    class PlantedOom(CudaBackend):
        steps_done = 0

        def setup(self, spec, model_dir):
            info = super().setup(spec, model_dir)

            def fire(t: Any) -> None:
                if raise_when(self, t):
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (test)")

            if on == "model":
                self.model.register_forward_pre_hook(
                    lambda m, args, kw: fire(kw.get("input_ids", args[0] if args else None)), with_kwargs=True)
            else:
                output_head(self.model).register_forward_hook(lambda m, args, out: fire(out))
            return info

        def optimizer_step(self, lr):
            self.steps_done += 1
            return super().optimizer_step(lr)

    return PlantedOom()


# The longest files first: xdist (--dist loadfile) hands whole files to the workers in
# collection order, so a long file collected last kept one worker busy while the other sat
# idle. Within a file the order is unchanged. By the seconds each took in a full run on two
# cores (test_slurm: where a cluster answers, as in CI).
LONGEST_FIRST = ("test_sweeps.py", "test_security.py", "test_evaluate.py", "test_families.py", "test_slurm.py",
                 "test_generate_format.py", "test_planner.py", "test_compile.py", "test_dist_torch.py",
                 "test_first_hour.py", "test_gpu_bench_smoke.py", "test_family_plans.py", "test_dist_mlx.py",
                 "test_packed_plan.py", "test_model_handle.py", "test_inputs_as_they_come.py", "test_sweep_failures.py",
                 "test_train_e2e.py", "test_resume_finished.py", "test_fsdp_qlora.py", "test_sweep_secrets.py",
                 "test_reserved_plan.py", "test_full_disk.py", "test_umask.py", "test_chunked_loss.py",
                 "test_data_cache.py", "test_cli_runs.py", "test_rundir.py", "test_governor.py", "test_faults.py",
                 "test_signals.py", "test_planner_dist.py", "test_bad_input.py", "test_cli_config.py",
                 "test_third_backend.py", "test_plan_data.py", "test_generate.py", "test_preference_sweep.py",
                 "test_preference_plan.py", "test_loggers.py", "test_preference_mlx.py", "test_plan_golden.py",
                 "test_packing.py", "test_multimodal.py", "test_export.py", "test_defaults_and_targets.py",
                 "test_gguf_export.py", "test_model_source.py", "test_preference_trl.py", "test_governor_reactions.py",
                 "test_packing_families.py")


def pytest_configure(config: Any) -> None:
    """xdist reorders the files by their number of tests, most first, unless told not to: then
    LONGEST_FIRST only broke ties, and a long file of one test (test_gpu_bench_smoke, ~50 s)
    was handed out last, with the other worker idle while it ran.

    A process that collects (an xdist worker, or the only one under -n 0) does so with the cyclic
    collector off: collection imports the frameworks and the test modules, whose garbage is
    small, and each full collection there rescanned every object imported so far.
    pytest_collection_finish collects once, freezes what is alive and turns it back on. (xdist's
    controller collects nothing and keeps its collector.)"""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    controller = getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")
    if not controller:
        gc.disable()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(Path(str(it.fspath)).name, len(rank)))


def pytest_collection_finish(session: Any) -> None:
    """Move what collection left alive (torch, transformers, mlx, every test module: ~550k
    objects that live to the end) out of the collector's reach, then collect as usual. Each full
    collection scanned them all again: over test_families' tests, 22.0 s of full collections
    became 7.6 s."""
    gc.collect()
    gc.freeze()
    gc.enable()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    """Collect, then freeze what is alive, after a test that imported modules (model classes,
    PEFT's tuners, mlx-lm's models: they live to the end) and after a test file's last test and
    its module fixtures' teardown (what outlives the file). Every full collection after it (each
    run's own before it loads, Python's automatic ones) scanned those objects again: over
    test_families alone (-n 0), 18.4 CPU s of full collections, 86 of them in the runs' own.
    Garbage is still collected: only an object alive at a freeze that later becomes cyclic
    garbage is kept."""
    before = len(sys.modules)
    yield
    if len(sys.modules) != before or nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config: Any) -> None:
    """The process ends next: its last collections need not scan what the tests imported (the
    interpreter's exit took ~1.5 s more with torch and transformers loaded)."""
    gc.freeze()


@pytest.fixture
def small_fs(tmp_path: Path) -> Any:
    """A 4 MiB tmpfs (a real filesystem that fills) mounted at tmp_path/mnt; unmounted after the
    test. Skips where it cannot be mounted (not root, no tmpfs)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the ENOSPC switches cover these paths elsewhere")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=False,
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no tmpfs can be mounted here ({r.stderr.strip()[-200:]})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


def fill_disk(mnt: Path) -> Path:
    """Fill the filesystem at ``mnt`` to the last byte (big writes, then single bytes); return
    the filler file."""
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\1" * size)
            except OSError:
                pass
    return filler
