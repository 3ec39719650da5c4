"""Tokens and keys never reach a file: the saved config (.hydra/), the loggers' copy of it,
exported configs. A value is secret when its key names one (``api_key``, ``hf_token``,
``password``...), when it is the value of such an environment variable (HF_TOKEN,
WANDB_API_KEY, MLFLOW_TRACKING_TOKEN...), or when it is the password in a URL.

Model and tokenizer files use "token" for their vocabulary (``bos_token_id``, ``pad_token``:
``"<|endoftext|>"``): those keys and special-token values are not secrets (masking them would
break the exported model), see ``is_secret_key``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from finetune.io import atomic_write_text
from finetune.model.safetensors_io import header_bytes

MASK = "***"
# ``(^|_)token($|_)`` so hf_token matches and max_new_tokens / tokens_per_sec do not
SECRET_KEY = re.compile(r"(^|[_.-])(token|api[_-]?key|apikey|secret|password|passwd|auth|credentials?)($|[_.-])",
                        re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(://[^/:@\s]+:)[^/@\s]+@")
MIN_SECRET_LEN = 6  # shorter env values ("1", "true") are settings, not secrets
# vocabulary keys of config.json / tokenizer_config.json: ids (bos_token_id, image_token_index)
# and the special tokens themselves (pad_token, eos_token, additional_special_tokens)
VOCAB_KEY = re.compile(r"_token_ids?$|_token_index$|(^|_)(bos|eos|pad|unk|sep|cls|mask)_token$", re.IGNORECASE)
# a special token's text names a vocabulary entry: "<|im_end|>", "<s>", "[PAD]"
_SPECIAL_TOKEN = re.compile(r"^(<[^<>\s]{1,64}>|\[[A-Z_]{1,32}\])$")


def is_secret_key(key: Any, value: Any) -> bool:
    """Whether ``value``, found under ``key``, is a secret by its key's name (``api_key``,
    ``hf_token``, ``password``...), not a tokenizer's vocabulary (ids, special tokens, an
    AddedToken dict). Empty values are not secrets."""
    k = str(key)
    if not SECRET_KEY.search(k) or VOCAB_KEY.search(k) or value is None or value == "":
        return False
    if isinstance(value, str) and _SPECIAL_TOKEN.match(value):
        return False
    return not (isinstance(value, dict) and "content" in value)  # {"content": "<s>", "special": true, ...}


def env_secrets() -> list[str]:
    """Values of environment variables whose names say they hold a secret."""
    return sorted({v for k, v in os.environ.items() if SECRET_KEY.search(k) and len(v) >= MIN_SECRET_LEN},
                  key=len, reverse=True)


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    """``text`` with every known secret value and URL password masked."""
    for s in env_secrets() if secrets is None else secrets:
        text = text.replace(s, MASK)
    return _URL_PASSWORD.sub(lambda m: m.group(1) + MASK + "@", text)


def config_secrets(tree: Any) -> list[str]:
    """Values found under secret-named keys of a plain config tree (dicts and lists)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if (is_secret_key(k, v) and isinstance(v, (str, int)) and not isinstance(v, bool)
                        and len(str(v)) >= MIN_SECRET_LEN):
                    found.append(str(v))
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(tree)
    return found


def redact_tree(tree: Any, secrets: list[str] | None = None) -> Any:
    """A copy of a plain config tree with secret-named keys and secret values masked."""
    secrets = env_secrets() if secrets is None else secrets
    if isinstance(tree, dict):
        return {k: MASK if is_secret_key(k, v) else redact_tree(v, secrets)
                for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact_tree(v, secrets) for v in tree]
    if isinstance(tree, str):
        return redact_text(tree, secrets)
    return tree


def is_secret_override(override: str) -> bool:
    """Whether a command-line override (``+extra.api_key=sk-...``, ``hf_token=a,b``) sets a
    key named like a secret (``is_secret_key``) to a value."""
    key, eq, value = str(override).partition("=")
    return bool(eq) and is_secret_key(key.lstrip("+~"), value)


def redact_overrides(overrides: list[str], secrets: list[str] | None = None) -> list[str]:
    """Overrides with a secret key's value masked whatever its length (``+extra.api_key=***``),
    and known secret values masked in the others."""
    return [o.partition("=")[0] + "=" + MASK if is_secret_override(o) else redact_text(str(o), secrets)
            for o in overrides]


# a YAML list item holding an override (``- +extra.api_key=sk-...``, maybe quoted), and Hydra's
# ``override_dirname: a=1,+extra.api_key=sk-...``
_OVERRIDE_ITEM = re.compile(r"^(\s*-\s+)(['\"]?)([^\s'\"=]+=.*?)\2\s*$")
_OVERRIDE_DIRNAME = re.compile(r"^(\s*override_dirname:\s+)(.*)$")


def _mask_override_lines(text: str) -> str:
    """YAML text with every override of a secret-named key masked, short values included (the
    value search of ``redact_text`` only masks values of MIN_SECRET_LEN characters or more)."""
    out = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        end = line[len(body):]
        m = _OVERRIDE_ITEM.match(body)
        if m and is_secret_override(m[3]):
            body = f"{m[1]}{m[2]}{m[3].partition('=')[0]}={MASK}{m[2]}"
        m = _OVERRIDE_DIRNAME.match(body)
        if m and any(is_secret_override(p) for p in m[2].split(",")):
            body = m[1] + ",".join(redact_overrides(m[2].split(","), []))
        out.append(body + end)
    return "".join(out)


def override_secrets(overrides: list[str]) -> list[str]:
    """The values secret-named overrides set, a sweep's each value too (``api_key=a,b``)."""
    found = []
    for o in overrides:
        if is_secret_override(o):
            value = str(o).partition("=")[2]
            pieces = [value, *(v.strip("'\" ") for v in value.strip("[]()").split(","))]
            found += [v for v in pieces if len(v) >= MIN_SECRET_LEN]
    return found


def redact_yaml_file(path: Path, secrets: list[str]) -> None:
    """Rewrite a YAML file Hydra saved (``.hydra/*.yaml``, ``multirun.yaml``) with ``secrets``,
    the values under secret-named keys and secret-named overrides masked; untouched when it
    holds none."""
    import yaml

    path = Path(path)
    if not path.is_file():
        return
    text = path.read_text()
    found = list(secrets)
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        tree = None
    found += config_secrets(tree)
    overrides = (((tree or {}).get("hydra") or {}).get("overrides") or {}) if isinstance(tree, dict) else {}
    if isinstance(tree, list):  # overrides.yaml
        found += override_secrets([str(o) for o in tree])
    elif isinstance(overrides, dict):
        found += override_secrets([str(o) for v in overrides.values() if isinstance(v, list) for o in v])
    clean = _mask_override_lines(redact_text(text, sorted(set(found), key=len, reverse=True)))
    if clean != text:
        atomic_write_text(path, clean)


def redact_multirun_yaml(path: Path, secrets: list[str]) -> None:
    """A sweep's ``multirun.yaml`` (Hydra writes it before the first job) with secrets masked."""
    try:
        redact_yaml_file(path, secrets)
    except OSError:  # the jobs still run; their own files are masked as they start
        pass


def redact_hydra_files(run_dir: str | None, tree: Any) -> None:
    """Rewrite ``run_dir``'s ``.hydra/*.yaml`` (config, overrides, hydra) with secrets masked:
    those in the environment and in ``tree`` (the composed config, interpolations unresolved).
    Hydra writes them before the task runs; nothing else reads them back."""
    if not run_dir:
        return
    secrets = sorted(set(env_secrets()) | set(config_secrets(tree)), key=len, reverse=True)
    hydra_dir = Path(str(run_dir)) / ".hydra"
    if not hydra_dir.is_dir():
        return
    for f in hydra_dir.glob("*.yaml"):
        redact_yaml_file(f, secrets)


# files an export writes as text (configs, model cards, chat templates); everything else is
# binary: tensors, sentencepiece models
_TEXT_SUFFIXES = (".json", ".md", ".txt", ".yaml", ".yml", ".jinja")
# a vocabulary's keys are its tokens ("token", "_token" are words in most BPE vocabularies):
# these files have secret values replaced, never their keys' values masked
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "added_tokens.json")


def redact_dir(root: Path | str, secrets: list[str]) -> None:
    """Mask secrets in every text file under ``root``, in place (call it on the temporary
    directory of an atomic write, before it is renamed into place): JSON config files lose the
    values under secret-named keys (``is_secret_key``) and every value in ``secrets``; other
    text files, vocabularies included, their ``secrets`` and URL passwords. Files that hold no
    secret are left byte for byte as they were."""
    import json

    for f in sorted(p for p in Path(root).rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES):
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # not text after all: secrets_in_dir still checks its bytes
            continue
        if f.suffix == ".json" and f.name not in _VOCAB_FILES:
            try:
                tree = json.loads(text)
            except ValueError:
                tree = None
            if tree is not None:
                clean_tree = redact_tree(tree, secrets)
                if clean_tree != tree:
                    atomic_write_text(f, json.dumps(clean_tree, indent=2, ensure_ascii=False) + "\n")
                continue
        clean = redact_text(text, secrets)
        if clean != text:
            atomic_write_text(f, clean)


def secrets_in_dir(root: Path | str, secrets: list[str]) -> list[tuple[Path, str]]:
    """(file, secret) for each secret value still found in a file under ``root``: every byte
    of text and small files; of a ``.safetensors`` file its JSON header (the rest is tensor
    data), so a merged model of many GiB is checked in milliseconds."""
    found = []
    needles = [(s, s.encode()) for s in secrets if s]
    for f in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        head = header_bytes(f) if f.suffix == ".safetensors" else None
        # a file without a readable header is read whole, as any other file
        data = head if isinstance(head, bytes) else f.read_bytes()
        found += [(f, s) for s, b in needles if b in data]
    return found
