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
