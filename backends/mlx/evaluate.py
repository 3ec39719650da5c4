"""``finetune mode=eval`` on the mlx backend: an lm-eval model on mlx-lm. It is mlx-lm's own
(``mlx_lm.evaluate.MLXLM``: loglikelihood, loglikelihood_rolling and generate_until, as
``mlx_lm.evaluate`` runs lm-eval), with the model loaded here so that it carries the adapter and
the model's config as training read it (``MlxBackend.eval_model`` calls it; finetune/evaluate.py
holds the shared mode logic)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from finetune.backends.mlx.hfconfig import model_config
from lm_eval.api.model import LM
from mlx_lm.evaluate import MLXLM

from finetune.errors import UserError


class AdaptedMLXLM(MLXLM):
    """mlx-lm's lm-eval model, loaded with ``adapter_path`` (mlx-lm's ``load``) and the raw text
    lm-eval's tasks give it (no chat template unless asked: lm-eval's default, as the cuda
    backend's HFLM)."""

    def __init__(self, model_dir: Path, adapter: Path | None, batch_size: int, trust_remote_code: bool = False,
                 use_chat_template: bool = False) -> None:
        from mlx_lm.utils import load

        LM.__init__(self)
        self._model, self.tokenizer = load(
            str(model_dir), adapter_path=str(adapter) if adapter is not None else None,
            model_config=model_config(model_dir), tokenizer_config={"trust_remote_code": trust_remote_code},
            trust_remote_code=trust_remote_code)
        self._max_tokens = None
        self._batch_size = batch_size
        self.use_chat_template = use_chat_template
        self._sampler = None

    def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list[str]:
        """mlx-lm's, its progress lines (``batch_generate(verbose=True)`` prints to stdout) on
        stderr: stdout is the result table alone, as on cuda."""
        with contextlib.redirect_stdout(sys.stderr):
            return list(super().generate_until(requests))


def eval_model(model_dir: Path, adapter: Path | None, batch_size: int, trust_remote_code: bool = False,
               allow_pickle: bool = False) -> Any:
    """``AdaptedMLXLM`` on the base in ``model_dir`` plus the mlx-lm ``adapter`` (None: the base)."""
    if not any(model_dir.glob("*.safetensors")):
        raise UserError(f"model.path={model_dir} has only pickle weights, which mlx-lm does not load (even with "
                        "model.allow_pickle=true); convert them to safetensors, or use backend=cuda")
    return AdaptedMLXLM(model_dir, adapter, batch_size, trust_remote_code=trust_remote_code)
