"""Quiet by default: the default run on a CPU prints only our own lines (the known third-party
ones are filtered by name, finetune/quiet.py), and --debug shows them again."""

from __future__ import annotations

import subprocess

from conftest import finetune_cmd, needs_torch

# every line a default run prints, by its start: the backend choice, the data, the progress bar,
# the end table and its explanations, where the run went
OURS = ("backend=auto chose", "reused the token cache", "tokenized", "built the tiny model", "train:",
        "Memory at the end", "census:", "process:", "OS:", "no allocator figures", "not measurable here",
        "accounting:", "[memory]", "[governor]", "run dir:", "          allocated", "Device ", "Overall ")


@needs_torch
def test_default_run_on_a_cpu_prints_only_our_lines(tmp_path):
    r = subprocess.run([*finetune_cmd(), "train.steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in (r.stdout + r.stderr).replace("\r", "\n").splitlines() if ln.strip()]
    foreign = [ln for ln in lines if not ln.startswith(OURS)]
    assert not foreign, foreign
    assert any(ln.startswith("Memory at the end") for ln in lines)


def test_filters_are_specific():
    """Each filter names its logger and message: the same logger's other records still show."""
    import logging

    from finetune import quiet

    quiet.install()
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    h = Keep()
    logger.addHandler(h)
    try:
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'")
        logger.warning("something else bitsandbytes says")
    finally:
        logger.removeHandler(h)
    assert kept == ["something else bitsandbytes says"]
