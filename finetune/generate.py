"""``finetune mode=generate``: load a base and a run's adapter on either backend, print a completion.

    finetune mode=generate backend=mlx generate.adapter=outputs/RUN generate.prompt="What is 2+3?"

``generate.adapter`` is a run directory or an adapter directory in either format: an adapter
from the other backend is converted on the fly (finetune.export) into a temporary directory,
so a LoRA trained on a Mac answers on a CUDA box and the other way round. A ``method=full``
run's ``adapter/`` is a whole model and is loaded as the model. The base is the one the
adapter's config names where it exists here, else ``model=``. The prompt goes through the
tokenizer's chat template when it has one (as the user's message, generation prompt added).
Generation itself is the libraries' own (``transformers`` ``generate``, ``mlx_lm.generate``):
greedy at ``generate.temperature=0``, sampled otherwise with ``train.seed``.

As in training: ``model.trust_remote_code`` (off by default) goes to every loader, and the
model's weights load from safetensors only unless ``model.allow_pickle=true`` (a pickle runs
code when loaded; finetune/model_source.py ``check_weights`` refuses it in one line first).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.config import UserError

NATIVE = {"cuda": "peft", "mlx": "mlx"}  # the adapter format each backend's library loads


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _generate_cuda(model_dir: Path, adapter: Path | None, prompt: str, max_new_tokens: int, temperature: float,
                   seed: int, trust_remote_code: bool = False, allow_pickle: bool = False) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.export import check_remote_code

    check_remote_code(model_dir, trust_remote_code, "set model.trust_remote_code=true")
    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    # use_safetensors=True: transformers refuses pickle weights rather than falling back to them
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto", trust_remote_code=trust_remote_code,
                                                 use_safetensors=None if allow_pickle else True)
    if adapter is not None:
        from peft import PeftModel

        # the adapter is adapter_model.safetensors (detect_format refuses a pickle-only one;
        # a converted one is written so), which PEFT prefers over any .bin beside it
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)
    if tok.chat_template:
        ids = tok.apply_chat_template(_messages(prompt), add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    torch.manual_seed(seed)
    sample = temperature > 0
    kwargs: dict[str, Any] = {"do_sample": sample, "max_new_tokens": max_new_tokens,
                              "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    if sample:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)  # plain temperature sampling, as mlx's sampler
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)  # greedy: no sampling knobs from generation_config
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device), **kwargs)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _generate_mlx(model_dir: Path, adapter: Path | None, prompt: str, max_new_tokens: int, temperature: float,
                  seed: int, trust_remote_code: bool = False, allow_pickle: bool = False) -> str:
    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    if not any(model_dir.glob("*.safetensors")):
        raise UserError(f"model.path={model_dir} has only pickle weights, which mlx-lm does not load (even with "
                        "model.allow_pickle=true); convert them to safetensors, or use backend=cuda")
    # mlx-lm reads model*.safetensors only; the tokenizer's own code runs only when trusted
    from finetune.backends.mlx.hfconfig import model_config as mlx_model_config

    model, tok = load(str(model_dir), adapter_path=str(adapter) if adapter is not None else None,
                      model_config=mlx_model_config(model_dir),
                      tokenizer_config={"trust_remote_code": trust_remote_code}, trust_remote_code=trust_remote_code)
    if tok.chat_template:
        ids = tok.apply_chat_template(_messages(prompt), add_generation_prompt=True)
    else:
        ids = tok.encode(prompt)
    mx.random.seed(seed)
    return generate(model, tok, ids, max_tokens=max_new_tokens, sampler=make_sampler(temp=temperature))


# Each backend's generation, by the concrete backend name (lazy: only the chosen one imports its
# framework). It belongs beside each runtime in backends/<name>/ once the Protocol grows a
# generate(); until then it lives here, in the two functions above.
GENERATORS: dict[str, Callable[..., str]] = {"cuda": _generate_cuda, "mlx": _generate_mlx}


def _full_model(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors")) and not (d / "adapter_config.json").is_file()


def resolve(cfg: Any) -> tuple[Path, Path | None, str | None]:
    """(model directory, adapter directory or None, the adapter's format or None) for ``cfg``."""
    from finetune.export import MLX_CONFIG, detect_format, find_adapter_dir
    from finetune.model_source import resolve_model_dir

    spec = cfg.generate.adapter
    if spec is None:
        return resolve_model_dir(cfg.model), None, None
    d = Path(str(spec)).expanduser()
    for full in (d, d / "adapter"):
        if _full_model(full):  # a method=full run: its adapter/ is the whole model
            return full, None, None
    adapter = find_adapter_dir(d)
    fmt = detect_format(adapter)
    named = json.loads((adapter / MLX_CONFIG).read_text()).get(
        "base_model_name_or_path" if fmt == "peft" else "model")
    if named and (Path(str(named)).expanduser() / "config.json").is_file():
        return Path(str(named)).expanduser(), adapter, fmt
    return resolve_model_dir(cfg.model), adapter, fmt


def generate(cfg: Any) -> dict[str, Any]:
    """Print (and return) the completion of ``generate.prompt`` by the base + ``generate.adapter``."""
    from finetune.backends import resolve_backend_name

    g = cfg.generate
    if not g.prompt and cfg.get("prompt"):
        g.prompt = cfg.prompt  # the top-level short form: finetune mode=generate prompt="..."
    if not g.prompt:
        raise UserError('mode=generate needs a prompt: add prompt="..." (or generate.prompt="...")')
    if g.max_new_tokens < 1:
        raise UserError(f"generate.max_new_tokens={g.max_new_tokens} must be >= 1")
    if g.temperature < 0:
        raise UserError(f"generate.temperature={g.temperature} must be >= 0 (0: greedy)")
    backend, _ = resolve_backend_name(str(cfg.backend.name))
    if backend not in GENERATORS:
        raise UserError(f"backend={backend} is not valid; choose one of: auto, {', '.join(GENERATORS)}")
    from finetune.backends import get_backend

    get_backend(backend)  # the framework is installed, else a UserError with the install line
    from finetune.model_source import check_weights

    model_dir, adapter, fmt = resolve(cfg)
    check_weights(model_dir, cfg.model)  # no weights, or pickles without model.allow_pickle: one line
    trust, pickle = bool(cfg.model.trust_remote_code), bool(getattr(cfg.model, "allow_pickle", False))
    with tempfile.TemporaryDirectory(prefix="finetune-generate-") as tmp:
        native = adapter
        if adapter is not None and fmt != NATIVE[backend]:
            from finetune.export import convert

            native = convert(adapter, Path(tmp) / "adapter", NATIVE[backend], base=str(model_dir), allow_pickle=pickle)
        completion = GENERATORS[backend](model_dir, native, str(g.prompt), int(g.max_new_tokens),
                                         float(g.temperature), int(cfg.train.seed), trust_remote_code=trust,
                                         allow_pickle=pickle)
    print(completion, flush=True)
    return {"backend": backend, "model_dir": str(model_dir), "adapter": str(adapter) if adapter else None,
            "adapter_format": fmt, "converted": fmt is not None and fmt != NATIVE[backend],
            "prompt": str(g.prompt), "completion": completion}
