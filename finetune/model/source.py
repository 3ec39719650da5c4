"""Resolve ``model=`` to a local HF-format directory (tiny: built here; else local or hub)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, NamedTuple, cast

from finetune import quiet
from finetune.model import safetensors_io
from finetune.errors import UserError
from finetune.spec import ModelSpec
from finetune.model.tiny import build_tiny, preset_config, tiny_config, tiny_dir

# What training needs from a hub repository; skips other formats (pytorch_model.bin twins,
# gguf, onnx) that would multiply the download.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
# Files a tokenizer is built from (transformers' names, sentencepiece's and tiktoken's): what a
# saved or merged model's directory copies from its base, and what the token cache's
# fingerprint hashes (in this order: the fingerprint depends on it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "tiktoken.model", "chat_template.jinja", "chat_template.json")


def resolve_model_dir(model: ModelSpec, seed: int = 0) -> Path:
    """Return the local directory holding config.json, weights and tokenizer files (a hub id
    downloaded, or checked against the hub, by ``snapshot_download``)."""
    found = local_model_dir(model, seed=seed, hub_cache=False)
    if isinstance(found, Path):
        return found
    if model.path is None:
        raise UserError(f"{found}; set model.path=<hub id or local dir>")
    repo = str(model.path)
    try:
        from huggingface_hub import snapshot_download

        snap = Path(snapshot_download(repo, allow_patterns=HUB_PATTERNS, revision=model.revision, token=_hf_token()))
    except Exception as e:  # offline, gated, misspelt: all end the same way for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"could not get model {repo} from the hub ({first[:160]}); download it "
            f"({hf_download(repo, model.revision)}, with HF_TOKEN set for a gated model) or pass model.path=/local/dir"
        ) from None
    missing = snapshot_missing(snap)
    why = _hub_unreachable() if missing else None
    if why is not None:
        # snapshot_download answers from the cache when the hub is out of reach, however little of
        # the snapshot is there: a config.json fetched for a plan (model_config) is not a model
        raise UserError(f"model.path={repo}: the hub cache holds only part of its snapshot ({snap}: no "
                        f"{' and no '.join(missing)}) and {why}; a run needs the whole snapshot: download it "
                        f"({hf_download(repo, model.revision)})")
    return snap


def hf_download(repo: str, revision: str | None = None, *args: str) -> str:
    """The ``hf download`` command line (huggingface_hub's CLI; ``huggingface-cli`` is gone
    from huggingface_hub 1.x) that puts ``repo`` (``args``: only those files, or options) in
    the hub cache."""
    return " ".join(["hf download", repo, *args, *(["--revision", revision] if revision else [])])


def snapshot_missing(d: Path) -> list[str]:
    """What a run needs that the model directory ``d`` lacks: its weights (safetensors or
    pickles, as ``check_weights`` takes them), its tokenizer (any of TOKENIZER_FILES)."""
    names = {p.name for p in d.iterdir()} if d.is_dir() else set()
    missing = []
    if not any(n.endswith((".safetensors", *PICKLE_SUFFIXES)) for n in names):
        missing.append("weights (*.safetensors)")
    if not names & set(TOKENIZER_FILES):
        missing.append("tokenizer files")
    return missing


def local_model_dir(model: ModelSpec, *, seed: int, hub_cache: bool = True) -> Path | str:
    """The model's directory as far as this machine alone finds it, or why there is none (a str).

    The one resolution order: the tiny model (built here), a local directory (which must hold
    config.json), then, with ``hub_cache``, the local hub cache's snapshot of a hub id (what
    ``mode=plan`` reads without a download; a run asks the hub itself, ``resolve_model_dir``).

    Raises:
        UserError: a local path that does not exist or holds no config.json.
    """
    if model.path is None:
        if model.name != "tiny":
            return f"model={model.name} has no model.path"
        return build_tiny(model, seed=seed)
    local = Path(str(model.path)).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise UserError(f"model.path={model.path} has no config.json; point it at an HF-format model directory")
        return local.resolve()
    if str(model.path).startswith((".", "/", "~")):
        raise UserError(f"model.path={model.path} does not exist; give an existing directory or a hub id")
    snap = cached_snapshot(str(model.path), model.revision) if hub_cache else None
    return snap if snap is not None else f"{model.path} is not in the local hub cache (the run downloads it)"


# Where a multimodal checkpoint (Gemma 3 from 4B up, Mistral 3, Llama 4: a text model beside a
# vision tower, ``text_config`` in config.json) keeps its language model's weights, in the names
# transformers saves (the hub's; ``model.language_model.`` as some versions save) -> the names of
# the text-only class its ``text_config`` builds. Only the language model is loaded and trained:
# the vision tower is never read (what the plan prices, finetune/model/describe.py ``_text``).
TEXT_KEY_MAPPING = {r"^(?:model\.)?language_model\.model\.": "model.", r"^model\.language_model\.": "model.",
                    r"^(?:model\.)?language_model\.lm_head\.": "lm_head."}


def is_multimodal(hf: dict[str, Any]) -> bool:
    """Whether config.json ``hf`` is a multimodal checkpoint's (a text model inside, under ``text_config``)."""
    return isinstance(hf.get("text_config"), dict) and any(k in hf for k in ("vision_config", "audio_config"))


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's language model: its ``text_config``, with its ``model_type``
    (the outer one where it names none) and the head tied as the whole model's config says,
    where it says so: transformers 5's multimodal classes tie by the outer ``tie_word_embeddings``
    (Mistral 3's defaults to true over an untied text config) and save no head then."""
    text = {**hf["text_config"], "model_type": hf["text_config"].get("model_type") or hf.get("model_type")}
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def load_causal_lm(model_dir: Path, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(model_dir, ...)``; for a multimodal checkpoint, its
    language model alone: the text-only class of its ``text_config``, its weights found through
    ``TEXT_KEY_MAPPING``, the vision tower's left unread. Every weight of that text model must be
    found (else UserError); transformers' report listing the vision tower's keys as unexpected
    is not printed, since they are left out on purpose. The model saves as a text checkpoint.
    transformers' "Loading weights" bar is not drawn (``quiet.no_loading_bar``): training,
    generation and merges all load through here."""
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet.no_loading_bar()
    hf = _read_config_json(Path(model_dir) / "config.json")
    if not is_multimodal(hf):
        return AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, **kwargs)
    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code).get_text_config()
    config.tie_word_embeddings = bool(text_config(hf).get("tie_word_embeddings", config.tie_word_embeddings))
    report = logging.getLogger("transformers.modeling_utils")
    drop = _DropLoadReport()
    report.addFilter(drop)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code,
                                                           config=config, key_mapping=TEXT_KEY_MAPPING,
                                                           output_loading_info=True, **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        # Qwen2.5-VL: its language model (M-RoPE over 3-D positions) has no text-only class
        raise UserError(f"{model_dir}: a multimodal checkpoint whose language model ({config.model_type}) transformers "
                        f"has no text-only causal LM class for, so finetune cannot load it alone; use backend=mlx "
                        "(where mlx-lm builds it) or a text model's checkpoint") from None
    finally:
        report.removeFilter(drop)
    # Saved (a full fine-tune, a merge) as the text model it now is, in its own names: transformers
    # would otherwise revert the renaming above on save_pretrained and write the multimodal names
    # under a text config.json, which loads back as a random model.
    model._weight_conversions = None
    missing = sorted(info["missing_keys"])
    if missing:
        raise UserError(f"{model_dir}: a multimodal checkpoint whose language model was not found where finetune "
                        f"looks ({', '.join(TEXT_KEY_MAPPING)}): {len(missing)} of its weights are missing, "
                        f"{missing[0]} first; use the text model's own checkpoint")
    return model


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def _hf_token() -> str | None:
    import os

    return os.environ.get("HF_TOKEN") or None


def _is_hub_id(path: Any) -> bool:
    """A ``model.path`` that names a hub repository: not a path, and nothing local by that name."""
    return path is not None and not str(path).startswith((".", "/", "~")) and not Path(str(path)).expanduser().exists()


def _read_config_json(cj: Path) -> dict[str, Any]:
    import json

    try:
        return json.loads(cj.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{cj} is unreadable ({e}); fix it or point model.path at another model") from None


def _presets(name: str = "*") -> dict[str, dict[str, Any]]:
    """The presets under conf/model/ (``name``, or all), as their YAML says (name -> dict)."""
    from importlib import resources

    import yaml

    out = {}
    for f in (resources.files("finetune.conf") / "model").iterdir():
        if f.name.endswith(".yaml") and name in ("*", f.name[:-5]):
            doc = yaml.safe_load(f.read_text()) or {}
            out[str(doc.get("name") or f.name[:-5])] = doc
    return out


def _preset_is_of(model: ModelSpec) -> bool:
    """Whether the preset describes ``model.path`` (its YAML's own path is that path): only then
    do its facts (``model.config``, ``model.dtype``) stand for the checkpoint."""
    name = str(model.name)
    return _presets(name).get(name, {}).get("path", False) == model.path


def _preset_facts(model: ModelSpec) -> dict[str, Any] | None:
    facts = model.config
    return _plain(facts) if facts is not None and _preset_is_of(model) else None


def _plain(node: Any) -> dict[str, Any]:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(node):
            return cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))  # a mapping node
    except ImportError:  # pragma: no cover - omegaconf ships with hydra, a dependency
        pass
    return dict(node)


def _cached_config(repo_id: str, revision: str | None) -> Path | None:
    """config.json of ``repo_id`` in the local hub cache (HF_HUB_CACHE / HF_HOME), no network."""
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return Path(hit) if isinstance(hit, str) else None


def cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The local hub cache's snapshot directory of ``repo_id`` (where its config.json is), no network."""
    if not _is_hub_id(repo_id):
        return None
    hit = _cached_config(repo_id, revision)
    return hit.parent if hit is not None else None


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached, or None when it can (or a proxy stands between). One
    connection attempt of at most 3 s: hf_hub_download itself retries a dead network for
    about 25 s, logging each retry."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "the hub is unreachable (offline: HF_HUB_OFFLINE=1)"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except OSError as e:
        return f"the hub is unreachable ({url.hostname}: {e.strerror or type(e).__name__})"
    return None


def _hub_failure(e: BaseException, revision: str | None) -> str:
    """Why config.json could not be downloaded, in a few words."""
    from huggingface_hub import constants, errors

    if constants.is_offline_mode():
        return "the hub is unreachable (offline: HF_HUB_OFFLINE=1)"
    if isinstance(e, errors.GatedRepoError):
        return "the repository is gated (accept its licence on the hub and set HF_TOKEN)"
    if isinstance(e, errors.RevisionNotFoundError):
        return f"the hub has no revision {revision}"
    if isinstance(e, errors.RepositoryNotFoundError):
        return "the hub has no such repository (or it is private: set HF_TOKEN)"
    if isinstance(e, errors.EntryNotFoundError):
        return "the repository has no config.json"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"the hub is unreachable ({first[:120]})"


class ConfigRead(NamedTuple):
    """A model's config.json as ``read_model_config`` found it."""

    config: dict[str, Any]  # as described: a hub checkpoint's with the user's model.config facts over it
    where: str  # a short label of where it was read (the plan's model.source)
    path: Path | None  # the config.json file (the tiny model: where it is built); None: a preset's facts
    local: tuple[dict[str, Any] | None, str | None]  # what ``local_config`` reads for the same model
    overridden: tuple[str, ...] = ()  # "key=value" of the model.config facts set over a hub checkpoint's


def model_config(model: ModelSpec, model_dir: Path | str | None = None) -> tuple[dict[str, Any], str]:
    """The checkpoint's ``config.json`` as a dict, and a short label of where it was read
    (``read_model_config``)."""
    got = read_model_config(model, model_dir)
    return got.config, got.where


def read_model_config(model: ModelSpec, model_dir: Path | str | None = None) -> ConfigRead:
    """The checkpoint's ``config.json``, where it was read, and the facts set over it.

    Looked for in order: ``model_dir`` (a loaded model's directory); a local ``model.path``;
    a hub id's config.json in the hub cache, then downloaded alone (``model.revision``,
    $HF_TOKEN; HF_HUB_OFFLINE=1 skips the download); failing both, the preset's released facts
    (``model.config``) when the preset is of that same repository. With ``model.path`` null:
    ``tiny``'s own config (what ``build_tiny`` writes), another preset's ``model.config``.

    ``model.config.KEY=VALUE`` on the command line (a fact other than the preset's own) is
    planned, never ignored: the tiny model is built from it; a hub checkpoint's config.json is
    described with it over it (``overridden``: a plan's what-if, which a run refuses); a
    checkpoint on disk (``model_dir``, a local ``model.path``) whose config.json says otherwise
    refuses it.

    Raises:
        UserError: one line naming the fixes; never falls back to another model's numbers.
    """
    none: tuple[dict[str, Any] | None, str | None] = (None, None)
    if model_dir is not None:
        cj = Path(str(model_dir)) / "config.json"
        if not cj.is_file():
            raise UserError(f"{model_dir} has no config.json; point model.path at an HF-format model directory")
        return _on_disk(model, cj)
    path = model.path
    name = str(model.name)
    if path is None:
        if name == "tiny":
            return ConfigRead(tiny_config(model), "preset tiny (the config.json build_tiny writes)",
                              tiny_dir(model) / "config.json", none)
        facts = model.config
        if facts is None:
            raise UserError(f"model={name} has no model.path and no model.config; "
                            "set model.path=<hub id or local dir>")
        return ConfigRead(_plain(facts), f"model.config of preset {name}", None, none)
    if not _is_hub_id(path):
        local = Path(str(path)).expanduser()
        if not local.exists():
            raise UserError(f"model.path={path} does not exist; give an existing directory or a hub id")
        if not (local / "config.json").is_file():
            raise UserError(f"model.path={path} has no config.json; point it at an HF-format model directory")
        return _on_disk(model, local / "config.json")
    repo, revision = str(path), model.revision
    from huggingface_hub import constants

    cached = _cached_config(repo, revision)
    if cached is not None:
        hf = _read_config_json(cached)
        return _over_hub(model, hf, f"{repo} config.json in the hub cache ({constants.HF_HUB_CACHE})", cached)
    why = _hub_unreachable()
    if why is None:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its retry warnings would break the one-line error
        try:
            got = Path(hf_hub_download(repo, "config.json", revision=revision, token=_hf_token()))
            return _over_hub(model, _read_config_json(got), f"{repo} config.json from the hub ({got})", got)
        except UserError:
            raise
        except Exception as e:  # offline, gated, misspelt, no network: named in the one line below
            why = _hub_failure(e, revision)
        finally:
            hf_logging.set_verbosity(level)
    facts = _preset_facts(model)
    if facts is not None:
        over = tuple(f"{k}={_shown(v)}" for k, v in config_overrides(model).items())
        where = f"model.config of preset {name} (released config.json facts; {repo}: {why})"
        return ConfigRead(facts, where + _with(over), None, none, over)
    match = [n for n, doc in sorted(_presets().items()) if doc.get("path") == repo and doc.get("config")]
    preset = f"use its preset (model={match[0]})" if match else "use a preset (model=<name>, see conf/model/)"
    raise UserError(f"model.path={repo}: no config.json in the hub cache ({constants.HF_HUB_CACHE}) and {why}; "
                    f"download it ({hf_download(repo, revision)}; a plan needs only "
                    f"{hf_download(repo, revision, 'config.json')}), point model.path at a local directory, or {preset}")


def config_overrides(model: ModelSpec) -> dict[str, Any]:
    """The facts of ``model.config`` that are not its preset's own (``model.config.KEY=VALUE``
    on the command line, or a preset's config: replaced): key -> value; every fact where the
    preset (``model.name``) has no config: block of its own."""
    facts = model.config
    if facts is None:
        return {}
    mine = _lists(_plain(facts))  # the spec's lists are tuples, the YAML's lists
    own = _lists(dict(preset_config(str(model.name)) or ()))
    return {k: v for k, v in mine.items() if k not in own or own[k] != v}


def _lists(v: Any) -> Any:
    """``v`` with every tuple a list, dicts walked: facts compared as config.json holds them."""
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_lists(x) for x in v]
    return v


def _shown(v: Any) -> str:
    import json

    return json.dumps(v) if isinstance(v, (bool, dict, list)) or v is None else str(v)


def _text_node(hf: dict[str, Any]) -> dict[str, Any]:
    """Where a config.json keeps its language model's facts: a multimodal one's ``text_config``."""
    return hf["text_config"] if is_multimodal(hf) else hf


def _on_disk(model: ModelSpec, cj: Path) -> ConfigRead:
    """A checkpoint on disk's config.json (``cj``); one fact of ``model.config`` set against it: one line."""
    hf = _read_config_json(cj)
    node = _text_node(hf)
    for k, v in config_overrides(model).items():
        if k in node and node[k] != v:
            raise UserError(f"model.config.{k}={_shown(v)} contradicts {cj} ({k}: {_shown(node[k])}): a checkpoint "
                            f"on disk is the model its config.json describes; drop model.config.{k}, or plan the "
                            f"change on its hub id or preset (finetune mode=plan model=<preset> model.config.{k}=...)")
    return ConfigRead(hf, str(cj), cj, (hf, str(cj)))


def _over_hub(model: ModelSpec, hf: dict[str, Any], where: str, path: Path) -> ConfigRead:
    """A hub checkpoint's config.json with the facts of ``model.config`` the user set over it
    (a plan's what-if: a layer count, a vocabulary)."""
    over = {k: v for k, v in config_overrides(model).items() if _text_node(hf).get(k) != v}
    if not over:
        return ConfigRead(hf, where, path, (hf, str(path)))
    if is_multimodal(hf):
        described = {**hf, "text_config": {**hf["text_config"], **over}}
    else:
        described = {**hf, **over}
    shown = tuple(f"{k}={_shown(v)}" for k, v in over.items())
    return ConfigRead(described, where + _with(shown), path, (hf, str(path)), shown)


def _with(overridden: tuple[str, ...]) -> str:
    """What a config.json's label adds for the facts set over it."""
    return ", with " + ", ".join(f"model.config.{o}" for o in overridden) if overridden else ""


# config.json dtype names -> ours (transformers 5 writes "dtype", 4.x "torch_dtype")
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "half": "float16", "fp16": "float16"}


def local_config(model: ModelSpec, model_dir: Path | str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """The model's ``config.json`` as a dict and its path, read from ``model_dir``, a local
    ``model.path`` or, for a hub id, the hub cache (never the network); (None, None) for a hub
    id not in the cache (or ``tiny`` not built)."""
    path = model.path if model_dir is None else None
    for d in (model_dir, path):
        if d is None:
            continue
        cj = Path(str(d)).expanduser() / "config.json"
        if cj.is_file():
            return _read_config_json(cj), str(cj)
    if _is_hub_id(path):  # the hub cache only: no download here
        cached = _cached_config(str(path), model.revision)
        if cached is not None:
            return _read_config_json(cached), str(cached)
    return None, None


def stored_dtype(model: ModelSpec, model_dir: Path | str | None = None,
                 local: tuple[dict[str, Any] | None, str | None] | None = None) -> tuple[str, str]:
    """The dtype the checkpoint stores its floating weights in, and where that was read:
    ``config.json`` ``dtype``/``torch_dtype`` (also inside ``text_config``; a hub id's from the
    hub cache), else the preset's ``model.dtype``, else float32 (transformers' own default when a
    config names none). A hub id neither cached nor of this preset is read with ``model_config``.
    ``local``: ``local_config``'s answer, where the caller has read it already."""
    hf, where = local if local is not None else local_config(model, model_dir)
    if hf is None and model_dir is None and _is_hub_id(model.path) \
            and not (model.dtype and _preset_is_of(model)):
        # a hub id not in the cache, and a preset of another model (tiny's float32 says nothing
        # of it): read its config.json (downloaded alone, or the one line naming the fix)
        hf, where = model_config(model)
    if hf is not None:
        for node in (hf, hf.get("text_config") or {}):
            for key in ("dtype", "torch_dtype"):
                v = node.get(key)
                if isinstance(v, str) and v.removeprefix("torch.") in _DTYPE_NAMES:
                    return _DTYPE_NAMES[v.removeprefix("torch.")], f"{where} {key}"
    preset = model.dtype
    if preset:
        if str(preset) not in _DTYPE_NAMES:
            raise UserError(f"model.dtype={preset} is not a dtype; choose one of: float32, bfloat16, float16")
        return _DTYPE_NAMES[str(preset)], f"model.dtype of preset {model.name}"
    return "float32", "no dtype in config.json or model.dtype: float32 (transformers' default)"


def stored_quantization(model: ModelSpec, model_dir: Path | str | None = None,
                        local: tuple[dict[str, Any] | None, str | None] | None = None) -> dict[str, Any] | None:
    """An MLX pre-quantized checkpoint's ``quantization`` block (``{"group_size": 64, "bits":
    4, ...}``, as ``mlx_lm.convert -q`` and the mlx-community repos write it), or None.
    ``local``: ``local_config``'s answer, where the caller has read it already."""
    hf, where = local if local is not None else local_config(model, model_dir)
    q = (hf or {}).get("quantization")  # HF "quantization_config" (bnb, GPTQ, AWQ) is another format
    if not isinstance(q, dict) or "bits" not in q or "group_size" not in q:
        return None
    return {"bits": int(q["bits"]), "group_size": int(q["group_size"]), "mode": str(q.get("mode", "affine")),
            "source": where}


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_weights(model_dir: Path | str, model: ModelSpec) -> None:
    """UserError, naming the fix, for a model directory without weights, or with pickle-only
    weights (loading a pickle runs code from the file) unless ``model.allow_pickle=true``."""
    d = Path(model_dir)
    files = [p for p in d.iterdir() if p.is_file()] if d.is_dir() else []
    safetensors = [p for p in files if p.name.endswith(".safetensors")]
    pickles = [p for p in files if p.name.endswith(PICKLE_SUFFIXES) and "training_args" not in p.name]
    if safetensors:
        for f in sorted(safetensors):
            why = safetensors_io.damage(f)
            if why is not None:
                raise UserError(f"{f} is damaged ({why}), as an interrupted download leaves it; "
                                f"{_download_again(f, model)}")
        _check_shards(d, model)
        return
    if pickles:
        if model.allow_pickle:
            return
        raise UserError(f"model.path={d} has only pickle weights ({pickles[0].name}), which run code when loaded; "
                        "convert them to safetensors, or set model.allow_pickle=true if you trust the source")
    raise UserError(f"model.path={d} holds no weights (*.safetensors); point model.path at a complete model directory")


def _shard_names(index: Path) -> list[str]:
    """The shard files a ``model.safetensors.index.json`` names (OSError, ValueError or
    AttributeError where it is unreadable)."""
    import json

    return sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))


def _weight_files(d: Path) -> list[Path]:
    """The safetensors files of one checkpoint in ``d``: the shards its index names, else
    ``model.safetensors``, else every ``model*.safetensors`` (never Mistral's duplicate
    ``consolidated.safetensors`` or an adapter's file)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            return [d / f for f in _shard_names(index)]
        except (OSError, ValueError, AttributeError):
            return []
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    return sorted(d.glob("model*.safetensors"))


def checkpoint_elements(model: ModelSpec, model_dir: Path | str | None = None,
                        text_only: bool = False) -> tuple[int, str] | None:
    """Elements of every tensor the checkpoint's safetensors files hold, read from their headers
    (no weights, no torch), and the directory read; None where this machine has no such files
    for the model (a hub id not downloaded, pickle-only weights, a file without a readable
    header). ``model_dir``: a loaded model's directory; else the local directory or hub-cache
    snapshot ``local_model_dir`` finds. ``text_only``: a multimodal checkpoint's language model
    alone (the tensors ``TEXT_KEY_MAPPING`` maps, and the head), what ``load_causal_lm`` loads."""
    d = Path(str(model_dir)) if model_dir is not None else local_model_dir(model, seed=0)
    if not isinstance(d, Path) or not d.is_dir():
        return None
    files = _weight_files(d)
    if not files or not all(f.is_file() for f in files):
        return None
    stats = [f.stat() for f in files]
    total = _elements(tuple((str(f), st.st_mtime_ns, st.st_size) for f, st in zip(files, stats)), text_only)
    return None if total is None else (total, f"{d}, its language model" if text_only else str(d))


@functools.lru_cache(maxsize=32)
def _elements(files: tuple[tuple[str, int, int], ...], text_only: bool) -> int | None:
    """Elements of the tensors of ``files`` ((path, mtime, size): a file rewritten is read again)."""
    import math
    import re

    text = [re.compile(p) for p in (*TEXT_KEY_MAPPING, r"^lm_head\.")]
    total = 0
    for f, _, _ in files:
        got = safetensors_io.read_header(f)
        if isinstance(got, str):
            return None
        total += sum(math.prod(t.get("shape") or [1]) for k, t in safetensors_io.tensors_of(got[0]).items()
                     if isinstance(t, dict) and (not text_only or any(p.match(k) for p in text)))
    return total


def _download_again(f: Path, model: ModelSpec) -> str:
    path = model.path
    if path is None:  # tiny: built here, so building it again is the download
        return f"delete {f.parent} and run again to rebuild it"
    if _is_hub_id(path):
        return f"download it again ({hf_download(str(path), model.revision, '--force-download')})"
    return f"download it again ({hf_download('<repo>', None, '--local-dir', str(f.parent))}) or copy it whole"


def _check_shards(d: Path, model: ModelSpec) -> None:
    """A sharded checkpoint's index (``model.safetensors.index.json``) names every shard; one
    missing is an incomplete download."""
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        shards = _shard_names(index)
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{index} is unreadable ({e}); {_download_again(index, model)}") from None
    missing = [s for s in shards if not (d / s).is_file()]
    if missing:
        raise UserError(f"{d / missing[0]} is missing ({len(missing)} of {len(shards)} shards that "
                        f"{index.name} names); {_download_again(d / missing[0], model)}")
