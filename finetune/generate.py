"""``finetune mode=generate``: load a base and a run's adapter on either backend, print a completion.

    finetune mode=generate backend=mlx generate.adapter=outputs/RUN generate.prompt="What is 2+3?"

``generate.adapter`` is a run directory or an adapter directory in either format: an adapter
from the other backend is converted on the fly (finetune.export) into a temporary directory,
so a LoRA trained on a Mac answers on a CUDA box and the other way round. A ``method=full``
run's ``adapter/`` is a whole model and is loaded as the model. The base is the one the
adapter's config names where it exists here, else ``model=``. The prompt goes through the
tokenizer's chat template when it has one (as the user's message, generation prompt added).
Generation itself is the libraries' own, behind ``Backend.generate`` (backends/<name>/generate.py:
``transformers`` ``generate``, ``mlx_lm.generate``): greedy at ``generate.temperature=0``,
sampled otherwise with ``train.seed``.

As in training: ``model.trust_remote_code`` (off by default) goes to every loader, and the
model's weights load from safetensors only unless ``model.allow_pickle=true`` (a pickle runs
code when loaded; finetune/model_source.py ``check_weights`` refuses it in one line first).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from finetune.backends import capabilities
from finetune.backends.runtimes import get_backend
from finetune.export import MLX_CONFIG, convert, detect_format, find_adapter_dir
from finetune.model_source import check_weights, resolve_model_dir
from finetune.spec import RunSpec


def _full_model(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors")) and not (d / "adapter_config.json").is_file()


def locate(spec: RunSpec) -> tuple[Path, Path | None, str | None]:
    """(model directory, adapter directory or None, the adapter's format or None) for ``spec``."""
    given = spec.generate.adapter
    if given is None:
        return resolve_model_dir(spec.model), None, None
    d = Path(str(given)).expanduser()
    for full in (d, d / "adapter"):
        if _full_model(full):  # a method=full run: its adapter/ is the whole model
            return full, None, None
    adapter = find_adapter_dir(d)
    fmt = detect_format(adapter)
    named = json.loads((adapter / MLX_CONFIG).read_text()).get(
        "base_model_name_or_path" if fmt == "peft" else "model")
    if named and (Path(str(named)).expanduser() / "config.json").is_file():
        return Path(str(named)).expanduser(), adapter, fmt
    return resolve_model_dir(spec.model), adapter, fmt


def generate(spec: RunSpec) -> dict[str, Any]:
    """Print (and return) the completion of ``generate.prompt`` by the base + ``generate.adapter``.
    The prompt, the token count and the temperature were checked by the resolver."""
    g, backend = spec.generate, spec.backend.resolved
    native_format = capabilities(backend).adapter_format
    runtime = get_backend(backend)  # the framework is installed, else a UserError with the install line

    model_dir, adapter, fmt = locate(spec)
    check_weights(model_dir, spec.model)  # no weights, or pickles without model.allow_pickle: one line
    trust, pickle = spec.model.trust_remote_code, spec.model.allow_pickle
    with tempfile.TemporaryDirectory(prefix="finetune-generate-") as tmp:
        native = adapter
        if adapter is not None and fmt != native_format:
            native = convert(adapter, Path(tmp) / "adapter", native_format, base=str(model_dir), allow_pickle=pickle)
        completion = runtime.generate(model_dir, native, str(g.prompt), g.max_new_tokens, g.temperature,
                                      spec.train.seed, trust_remote_code=trust, allow_pickle=pickle)
    print(completion, flush=True)
    return {"backend": backend, "model_dir": str(model_dir), "adapter": str(adapter) if adapter else None,
            "adapter_format": fmt, "converted": fmt is not None and fmt != native_format,
            "prompt": str(g.prompt), "completion": completion}
