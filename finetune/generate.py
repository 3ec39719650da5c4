"""``finetune mode=generate``: load a base and a run's adapter on either backend, print a completion.

    finetune mode=generate backend=mlx generate.adapter=outputs/RUN generate.prompt="What is 2+3?"

``generate.adapter`` is a run directory or an adapter directory in either format: an adapter
from the other backend is converted on the fly (finetune.export) into a temporary directory,
so a LoRA trained on a Mac answers on a CUDA box and the other way round. A ``method=full``
run's ``adapter/`` is a whole model and is loaded as the model. The base is the one the
adapter's config names where it exists here, else ``model=``.

The prompt takes the shape the adapter's run gave its prompts (``finetune/prompting.py``, recorded
in the adapter's ``finetune.json``): the chat template for chat ``messages`` data (as the user's
message, the generation prompt added), raw text for ``prompt``/``completion`` and ``text`` data,
``Question: ...\nAnswer: `` for ``question``/``answer`` data. ``generate.chat_template=true|false``
overrides it; with no record (an adapter from elsewhere, or none) the chat template is used where
the tokenizer has one. One line on stderr says which (stdout is the completion alone).
Generation itself is the libraries' own, behind ``Backend.generate`` (backends/<name>/generate.py:
``transformers`` ``generate``, ``mlx_lm``'s ``stream_generate``): greedy at
``generate.temperature=0``, sampled otherwise with ``train.seed``; both stop at the same end
tokens (EOS, the chat template's end of turn) and print none of them.

As in training: ``model.trust_remote_code`` (off by default) goes to every loader, and the
model's weights load from safetensors only unless ``model.allow_pickle=true`` (a pickle runs
code when loaded; finetune/model/source.py ``check_weights`` refuses it in one line first).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from finetune.backends import capabilities
from finetune.backends.runtimes import get_backend
from finetune.export.adapters import MLX_CONFIG, detect_format, find_adapter_dir
from finetune.export.conversion import convert
from finetune.errors import UserError
from finetune.model.source import check_weights, resolve_model_dir
from finetune.prompting import Prompt, has_chat_template, read_record, wrap
from finetune.spec import RunSpec


def _full_model(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors")) and not (d / "adapter_config.json").is_file()


def locate(spec: RunSpec) -> tuple[Path, Path | None, str | None]:
    """(model directory, adapter directory or None, the adapter's format or None) for ``spec``."""
    model_dir, adapter, fmt, full = locate_given(spec, spec.generate.adapter, base_of_full=False)
    return (full or model_dir), adapter, fmt


def locate_given(spec: RunSpec, given: str | None, base_of_full: bool = True
                 ) -> tuple[Path, Path | None, str | None, Path | None]:
    """(the base's directory, adapter directory or None, the adapter's format or None, a whole
    model or None) for ``given``, a run dir or adapter dir (mode=eval's too). A whole model (a
    method=full run's adapter/, a merged export) comes with the base as ``model=`` names it
    where ``base_of_full``, else with the whole model in the base's place."""
    if given is None:
        return resolve_model_dir(spec.model), None, None, None
    d = Path(str(given)).expanduser()
    for full in (d, d / "adapter"):
        if _full_model(full):  # a method=full run: its adapter/ is the whole model (a merged export too)
            return (resolve_model_dir(spec.model) if base_of_full else full), None, None, full
    adapter = find_adapter_dir(d)
    fmt = detect_format(adapter)
    named = json.loads((adapter / MLX_CONFIG).read_text()).get(
        "base_model_name_or_path" if fmt == "peft" else "model")
    if named and (Path(str(named)).expanduser() / "config.json").is_file():
        return Path(str(named)).expanduser(), adapter, fmt, None
    return resolve_model_dir(spec.model), adapter, fmt, None


_FORMAT_WORDS = {"chat": "the chat template", "raw": "raw text",
                 "question/answer": 'raw text as "Question: <prompt>\\nAnswer: "'}


def choose_prompt(spec: RunSpec, model_dir: Path, adapter: Path | None) -> tuple[Prompt, str]:
    """The prompt as the backend tokenizes it, and the one line that says which format and why:
    ``generate.chat_template`` where set, else the format recorded beside the adapter (or in a
    full model's directory), else the chat template where the tokenizer has one."""
    g = spec.generate
    recorded = read_record(adapter if adapter is not None else model_dir)
    if g.chat_template is not None:
        # false keeps a recorded non-chat shape (question/answer's "Question: ...")
        fmt = "chat" if g.chat_template else (recorded if recorded not in (None, "chat") else "raw")
        why = f"generate.chat_template={str(g.chat_template).lower()}"
        if recorded is not None and recorded != fmt:
            why += f"; the adapter's run formatted its prompts as {_FORMAT_WORDS[recorded]}"
    else:
        if recorded is not None:
            fmt, why = recorded, "as the adapter's run formatted its prompts"
        else:
            fmt = "chat" if has_chat_template(model_dir) else "raw"
            why = ("no adapter" if g.adapter is None else "no record of the adapter's prompt format") + (
                ", and the tokenizer has one" if fmt == "chat" else ", and the tokenizer has no chat template")
        why += f"; generate.chat_template={'false' if fmt == 'chat' else 'true'} to change it"
    if fmt == "chat" and not has_chat_template(model_dir):
        raise UserError(f"the prompt would go through the chat template ({why.split(';')[0]}), but the tokenizer in "
                        f"{model_dir} has none; set generate.chat_template=false (raw text)")
    # raw text with no record: the tokenizer's own special tokens, as today and as other tools
    # train; a recorded raw prompt: none, as finetune's training encoded it
    prompt = Prompt(wrap(str(g.prompt), fmt), chat=fmt == "chat", special_tokens=recorded is None)
    return prompt, f"prompt: {_FORMAT_WORDS[fmt]} ({why})"


def generate(spec: RunSpec) -> dict[str, Any]:
    """Print (and return) the completion of ``generate.prompt`` by the base + ``generate.adapter``.
    The prompt, the token count and the temperature were checked by the resolver."""
    g, backend = spec.generate, spec.backend.resolved
    native_format = capabilities(backend).adapter_format
    runtime = get_backend(backend)  # the framework is installed, else a UserError with the install line

    model_dir, adapter, fmt = locate(spec)
    check_weights(model_dir, spec.model)  # no weights, or pickles without model.allow_pickle: one line
    prompt, line = choose_prompt(spec, model_dir, adapter)
    print(line, file=sys.stderr, flush=True)
    trust, pickle = spec.model.trust_remote_code, spec.model.allow_pickle
    with tempfile.TemporaryDirectory(prefix="finetune-generate-") as tmp:
        native = adapter
        if adapter is not None and fmt != native_format:
            native = convert(adapter, Path(tmp) / "adapter", native_format, base=str(model_dir), allow_pickle=pickle)
        completion = runtime.generate(model_dir, native, prompt, g.max_new_tokens, g.temperature,
                                      spec.train.seed, trust_remote_code=trust, allow_pickle=pickle)
    print(completion, flush=True)
    return {"backend": backend, "model_dir": str(model_dir), "adapter": str(adapter) if adapter else None,
            "adapter_format": fmt, "converted": fmt is not None and fmt != native_format,
            "prompt": str(g.prompt), "prompt_format": "chat" if prompt.chat else "raw", "prompt_text": prompt.text,
            "completion": completion}
