"""``finetune mode=eval`` on the cuda backend: lm-eval's own HF model (``HFLM``), the PEFT adapter
through its ``peft=`` argument, exactly as ``lm_eval --model hf --model_args
pretrained=BASE,peft=ADAPTER`` builds it (``CudaBackend.eval_model`` calls it; finetune/evaluate.py
holds the shared mode logic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lm_eval.models.huggingface import HFLM

from finetune.export.basemodel import check_remote_code


def eval_model(model_dir: Path, adapter: Path | None, batch_size: int, trust_remote_code: bool = False,
               allow_pickle: bool = False) -> Any:
    """lm-eval's ``HFLM`` on the base in ``model_dir`` plus the PEFT ``adapter`` (None: the base
    alone): on cuda where CUDA is visible, else the CPU, at
    the checkpoint's dtype (``dtype=auto``, lm-eval's default). Pickle weights load only where
    ``allow_pickle`` (``check_weights`` refused them before)."""
    check_remote_code(model_dir, trust_remote_code, "set model.trust_remote_code=true")
    kwargs: dict[str, Any] = {} if allow_pickle else {"use_safetensors": True}
    return HFLM(pretrained=str(model_dir), peft=str(adapter) if adapter is not None else None, device="cuda" if torch.cuda.is_available() else "cpu",
                batch_size=batch_size, trust_remote_code=trust_remote_code, **kwargs)
