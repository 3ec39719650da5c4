"""A checkpoint that belongs to another model or method is refused with one line naming a
tensor that does not fit, never loaded half-way."""

from __future__ import annotations

import pytest

from finetune.config import compose
from finetune.errors import UserError
from finetune.model.source import resolve_model_dir
from finetune.resolver import resolve

from conftest import needs_torch


@needs_torch
@pytest.mark.parametrize("saved,loaded,example", [
    ("method.lora.num_layers=-1", "method.lora.num_layers=1", "layers.0"),  # the checkpoint has more tensors
    ("method.lora.num_layers=1", "method.lora.num_layers=-1", "layers.0"),  # the model has more
], ids=["extra-in-checkpoint", "missing-from-checkpoint"])
def test_cuda_checkpoint_of_other_adapters_is_refused(tmp_path, saved, loaded, example):
    from finetune.backends.cuda.runtime import CudaBackend

    spec = resolve(compose(tmp_path, "backend=cuda", saved))
    model_dir = resolve_model_dir(spec.model)
    be = CudaBackend()
    be.setup(spec, model_dir)
    be.save_state(tmp_path)
    other = CudaBackend()
    other.setup(resolve(compose(tmp_path, "backend=cuda", loaded)), model_dir)
    with pytest.raises(UserError, match=rf"checkpoint {tmp_path} does not match this model/method \(e.g. .*{example}"):
        other.load_state(tmp_path)
