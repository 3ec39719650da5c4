"""Tab completion of a key's values, where Hydra's completion offers only the current one.

``eval "$(finetune -sc install=bash)"`` installs Hydra's bash function, which asks ``finetune -sc
query=bash`` with the typed line in ``COMP_LINE`` for each <TAB>. Hydra completes groups, their
options and the config's keys from the composed config, but for a key's value it offers the value
composed now (``mode=`` -> ``mode=train``) and nothing for a partial one (``mode=p``), and for a
sweep (``optim=adamw,``) nothing. The CLI answers those words here, before Hydra: every value a key
takes (``finetune.keyhelp.options``: every mode, the resolver's choices, the backends' choices,
true/false), and a group's options after a comma or a ``[``. Every other word is Hydra's.

Bash shows candidates only; fish shows each with its key's meaning (``value<TAB>meaning``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from finetune.config import GROUPS, MODES, group_options
from finetune.keyhelp import key, options

SHELLS = ("bash", "zsh", "fish")  # zsh runs the bash function (bashcompinit)


def _meaning(path: str) -> str:
    k = key(path)
    return k.meaning if k is not None else f"a {path} option"


def candidates(word: str) -> list[tuple[str, str]] | None:
    """(completion, what it means) for the word under the cursor, or None to leave the word to
    Hydra. ``mode=`` -> every mode; ``train.schedule=co`` -> ``train.schedule=constant`` and
    ``=cosine``; ``optim=adamw,`` -> ``optim=adamw,<each option>``; a group without a comma and a
    key without finite values -> None."""
    sign = word[:1] if word[:1] in "+~" else ""
    body = word[len(sign):]
    if "=" not in body:
        return None
    name, _, value = body.partition("=")
    cut = max(value.rfind(","), value.rfind("["))
    head, partial = value[:cut + 1], value[cut + 1:]
    if name in GROUPS:
        if cut < 0:  # a group's options: Hydra's own answer
            return None
        found = [(o, f"{name} option") for o in group_options(name)]
    elif name.endswith(".name") and name.removesuffix(".name") in GROUPS:
        return None  # chosen with the group (optim=sgd): Hydra offers the composed value
    else:
        vals = options(name)
        if not vals:
            return None
        found = [(v, MODES[v] if name == "mode" else _meaning(name)) for v in vals]
    return [(f"{sign}{name}={head}{v}", what) for v, what in found if v.startswith(partial)]


def current_word(line: str) -> str:
    """The word being completed: the last one of ``line`` unless the line ends with a space."""
    return "" if not line or line[-1].isspace() else line.split()[-1]


def answer(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """What ``finetune -sc query=SHELL`` prints for ``COMP_LINE`` in ``env`` where finetune
    completes the word itself; None where Hydra answers (not a query, or a word of Hydra's)."""
    args = list(argv)
    for flag in ("-sc", "--shell-completion"):
        if flag in args:
            i = args.index(flag)
            break
    else:
        return None
    query = args[i + 1] if i + 1 < len(args) else ""
    shell = query.partition("=")[2]
    if not query.startswith("query=") or shell not in SHELLS or "COMP_LINE" not in env:
        return None
    found = candidates(current_word(env["COMP_LINE"]))
    if found is None:
        return None
    if shell == "fish":
        return "\n".join(f"{c}\t{what}" for c, what in found)
    return " ".join(c for c, _ in found)
