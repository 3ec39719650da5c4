"""Quiet by default: the known third-party lines are filtered by name (finetune/quiet.py), each
filter specific to its logger and message. That the default run on a CPU prints only our own
lines (OURS) is checked on the default run of tests/test_train_e2e.py
(test_cli_default_job_end_to_end)."""

from __future__ import annotations

# every line a default run prints, by its start: the backend choice, the data, the progress bar,
# the end table and its explanations, where the run went
OURS = ("backend=auto chose", "reused the token cache", "tokenized", "data: ", "built the tiny model", "train:",
        "Memory at the end", "census:", "process:", "OS:", "no allocator figures", "not measurable here",
        "accounting:", "[memory]", "[governor]", "[plan]", "run dir:", "done: ", "          allocated", "Device ", "Overall ")


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


def test_importing_bitsandbytes_offline_says_nothing():
    """Under HF_HUB_OFFLINE=1 (how a local hub cache is used) bitsandbytes' import on a CPU has the
    `kernels` package log that it skips a trust check, besides its own fallback line: both
    filtered, nothing reaches stderr (the suite's warm CLI server also relies on a quiet import)."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("bitsandbytes")
    code = "from finetune import quiet; quiet.install(); import bitsandbytes"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
