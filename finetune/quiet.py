"""Quiet by default: the third-party messages a run on our paths prints that tell a user nothing
they can act on, each silenced by name with the reason. ``--debug`` shows everything.

Each filter is specific (a logger and a message, or a warning's text and category): anything
else those libraries say still reaches the user.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

# (logger, a piece of its message, why it says nothing to act on)
LOG_FILTERS = (
    ("bitsandbytes.backends.cpu.ops", "kernels-community",
     "bitsandbytes 0.50 on a CPU looks for the optional `kernels` package for its 4-bit gemm and falls back to "
     "its own, which is what runs"),
    # the same lookup under HF_HUB_OFFLINE=1 (how a local hub cache is used): the `kernels` package
    # says it skips the trust check of a kernel it then does not load
    ("kernels._internals.hf_hub", "kernels-community",
     "bitsandbytes' optional kernel lookup under HF_HUB_OFFLINE=1; bitsandbytes falls back to its own gemm"),
    # mlx_lm/evaluate.py logs through the root logger, which Hydra's console prints on stdout
    ("root", "Estimating loglikelihood", "mode=eval on mlx: mlx-lm's count of the requests it scores"),
    ("root", "Generating continuation for", "mode=eval on mlx: mlx-lm's count of the requests it generates for"),
    ("lm_eval.evaluator", "specified through cli", "mode=eval: eval.max_gen_toks doing what it says (on stdout, over "
                                                   "the result table, under Hydra's console logging)"),
    ("lm_eval.evaluator", "Overwriting default num_fewshot", "mode=eval: eval.num_fewshot doing what it says"),
)
# (warning text, category, why)
WARNING_FILTERS = (
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning,
     "PEFT 0.21's get_peft_model reads transformers 5's renamed property; nothing for a user to change"),
)
# loggers whose INFO lines are housekeeping: only their warnings and errors are shown
INFO_ONLY = (
    ("matplotlib.font_manager", "'generated new fontManager' the first time a machine draws a chart"),
    ("lm_eval", "mode=eval: the device, the seeds and each task's contexts, which Hydra's console logging prints "
                "on stdout around the result table (finetune/evaluate.py says on stderr what it evaluates)"),
)


class _Drop(logging.Filter):
    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        return self.needle not in record.getMessage()


def install(debug: bool = False) -> None:
    """Silence the known messages above (nothing under ``debug``)."""
    if debug:
        return
    for name, needle, _ in LOG_FILTERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.needle == needle for f in logger.filters):
            logger.addFilter(_Drop(needle))
    for text, category, _ in WARNING_FILTERS:
        warnings.filterwarnings("ignore", message=text, category=category)
    for name, _ in INFO_ONLY:
        logging.getLogger(name).setLevel(logging.WARNING)


def no_loading_bar() -> None:
    """transformers 5 draws a "Loading weights" bar over a local checkpoint's tensors: our own
    progress starts right after, so that bar only pushes the run's first lines off the screen.
    Only that bar is dropped (transformers' public tqdm hook); downloads keep theirs."""
    import os

    if os.environ.get("HYDRA_FULL_ERROR") == "1":  # --debug
        return
    from transformers.utils import logging as tlog

    def hook(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("desc") == "Loading weights":
            kwargs = {**kwargs, "disable": True}
        return factory(*args, **kwargs)

    tlog.set_tqdm_hook(hook)
