"""How a prompt becomes tokens: one rule for the data a run trains on and for ``mode=generate``
(issue 31), so a model answers the prompt in the shape it learned.

Training renders each record (finetune/data/tokens.py ``_render``): chat ``messages`` through the
tokenizer's chat template; ``prompt``/``completion`` and ``text`` as they are, end to end, no
special token added; ``question``/``answer`` as ``QA_PROMPT`` followed by the answer. A run
records which of those its prompts took (``prompt_format``: "chat", "raw" or "question/answer")
in summary.json and beside its adapter (``RECORD_FILE``), and generation formats its prompt the
same way. Generation on either backend stops at the same end tokens (``end_token_ids``) and
strips them.

Nothing here imports a framework: tokenizers are taken as they come (transformers' own, or
mlx-lm's wrapper around one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.io import atomic_write_json

PROMPT_FORMATS = ("chat", "raw", "question/answer")
# a record's format (finetune/data/formats.py record_format) -> the shape its prompt trained in
FORMAT_OF_RECORDS = {"chat messages": "chat", "prompt/completion": "raw", "text": "raw",
                     "question/answer": "question/answer",
                     # preference records (finetune/data/formats.py): string prompts as they are,
                     # chat turns through the template
                     "preference pairs": "raw", "preference pairs, chat turns": "chat",
                     "unpaired (KTO)": "raw", "unpaired (KTO), chat turns": "chat"}
# what a question/answer record's prompt becomes (GSM8K's shape); the answer follows directly
QA_PROMPT = "Question: {}\nAnswer: "
# the run's note beside its adapter (adapter/finetune.json): PEFT and mlx-lm read only their own
# adapter_config.json and weights, so a file of ours beside them leaves both formats as they are
RECORD_FILE = "finetune.json"


def prompt_format(record_formats: dict[str, int]) -> str | None:
    """The prompt format of a run whose records were read as ``record_formats`` (format ->
    records, finetune/data/tokens.py's stats): the one most of its records took (None: no records)."""
    counts: dict[str, int] = {}
    for name, n in record_formats.items():
        fmt = FORMAT_OF_RECORDS.get(name)
        if fmt is not None:
            counts[fmt] = counts.get(fmt, 0) + int(n)
    return max(counts, key=lambda f: counts[f]) if counts else None


def write_record(adapter_dir: Path, fmt: str | None, record_formats: dict[str, int]) -> None:
    """``RECORD_FILE`` in ``adapter_dir``: the prompt format and the record formats behind it."""
    atomic_write_json(adapter_dir / RECORD_FILE, {"prompt_format": fmt, "data_formats": dict(record_formats)})


def read_record(d: Path | None) -> str | None:
    """The prompt format recorded beside an adapter (or a full model) in ``d``; None where there
    is no record or it names no format this version knows (an adapter from elsewhere)."""
    if d is None:
        return None
    try:
        fmt = json.loads((Path(d) / RECORD_FILE).read_text()).get("prompt_format")
    except (OSError, ValueError, AttributeError):
        return None
    return fmt if fmt in PROMPT_FORMATS else None


@dataclass(frozen=True)
class Prompt:
    """What a backend's generate tokenizes: ``text`` is the user's message (``chat``: through the
    tokenizer's chat template, the generation prompt added) or the text the model continues."""

    text: str
    chat: bool
    # raw text only: add the tokenizer's own special tokens (a BOS) as its encode does by
    # default: for a prompt with no record (a foreign adapter trained by a tool that adds them);
    # finetune's training adds none (finetune/data/tokens.py _encode), so a recorded raw prompt gets none either
    special_tokens: bool = False


def wrap(text: str, fmt: str) -> str:
    """``text`` as a prompt of format ``fmt`` takes it before tokenizing (question/answer: inside
    ``QA_PROMPT``; chat and raw: as it is)."""
    return QA_PROMPT.format(text) if fmt == "question/answer" else text


def has_chat_template(model_dir: Path) -> bool:
    """Whether the tokenizer in ``model_dir`` has a chat template, read from the files
    transformers takes it from (chat_template.jinja/.json, additional_chat_templates/, or
    tokenizer_config.json's ``chat_template``), without loading the tokenizer."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    extra = d / "additional_chat_templates"
    if extra.is_dir() and any(extra.iterdir()):
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _config_eos(model_dir: Path) -> set[int]:
    """The checkpoint's own end ids: generation_config.json's ``eos_token_id`` where it names
    one, else config.json's (its text model's, for a multimodal one), as mlx-lm's loader and
    transformers' generation config read them."""
    for name in ("generation_config.json", "config.json"):
        try:
            cfg = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(cfg, dict):
            continue
        ids = _ids(cfg.get("eos_token_id")) or _ids((cfg.get("text_config") or {}).get("eos_token_id"))
        if ids:
            return ids
    return set()


_SENTINEL = "finetune-end-of-turn-probe"


def end_of_turn_id(tok: Any) -> int | None:
    """The special token the chat template closes an assistant's turn with (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``), found by rendering a turn and reading the first token
    after its content; None without a template, or where no special token follows."""
    if not getattr(tok, "chat_template", None):
        return None
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tok.apply_chat_template(turns, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses this turn shape names no end token
        return None
    if not isinstance(text, str) or _SENTINEL not in text:
        return None
    after = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
    ids = tok.encode(after, add_special_tokens=False) if after else []
    if not ids:
        return None
    special = set(getattr(tok, "all_special_ids", None) or ())
    special |= {i for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items() if getattr(t, "special", False)}
    return int(ids[0]) if ids[0] in special else None


def end_token_ids(tok: Any, model_dir: Path) -> list[int]:
    """The ids generation stops at, on either backend: the tokenizer's EOS, the checkpoint's own
    (generation_config.json / config.json) and the chat template's end of turn. Each is a special
    token, so the decoded completion (``skip_special_tokens``) holds none of them."""
    ids = _config_eos(model_dir)
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    eot = end_of_turn_id(tok)
    if eot is not None:
        ids.add(eot)
    return sorted(ids)
