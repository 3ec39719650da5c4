"""What every rule module builds on: the explanation record, the small readers of a timeline
the shared and the backends' rules share, and the registry each backend's rules module
(backends/<name>/rules.py) adds its rules and allocator wording to. Below both: the shared
rules (finetune/accounting/rules.py) and the backends' rules import it, and nothing here imports
either, so registering a backend's rules makes no import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

MiB = 1 << 20

Explanation = dict[str, Any]


def _ex(rule: str, severity: str, text: str, **figures: float | None) -> Explanation:
    return {"rule": rule, "severity": severity, "text": text,
            "figures": {k: (int(v) if isinstance(v, (int, float)) and not k.endswith("_pct") else v)
                        for k, v in figures.items() if v is not None}}


def _where(s: dict[str, Any]) -> str:
    return "after load" if s["phase"] == "load" else f"at the {s['phase']} phase of step {s['step']}"



def _max_of(samples: list[dict[str, Any]], key: str) -> tuple[int | None, dict[str, Any] | None]:
    best, at = None, None
    for s in samples:
        v = s.get(key)
        if v is not None and (best is None or v > best):
            best, at = v, s
    return best, at


def _step_times(samples: list[dict[str, Any]]) -> dict[int, float]:
    """Seconds per optimizer step from the timeline itself: the time between consecutive
    optimizer-phase samples, spread over the steps between them."""
    opt = [s for s in samples if s.get("phase") == "optimizer" and s.get("time_s") is not None]
    out: dict[int, float] = {}
    for a, b in pairwise(opt):
        gap = b["step"] - a["step"]
        if gap > 0:
            for st in range(a["step"] + 1, b["step"] + 1):
                out[st] = (b["time_s"] - a["time_s"]) / gap
    return out


def _swapping_steps(samples: list[dict[str, Any]]) -> tuple[set[int], int | None]:
    """Steps in which the OS swapped: between two readings of the system figures (fresh
    optimizer-phase samples) whose swapped-out bytes, swap used or this process's major faults
    grew. Returns (steps, bytes swapped out over the run or None)."""
    fresh = [s for s in samples if s.get("phase") in ("optimizer", "load") and s.get("system_fresh", True)]
    steps: set[int] = set()
    for a, b in pairwise(fresh):
        grew = any((b.get(k) is not None and a.get(k) is not None and b[k] > a[k] + tol)
                   for k, tol in (("swapped_out", 0), ("swap_used", 16 * MiB), ("major_faults", 64)))
        if grew:
            steps.update(range(a["step"] + 1, b["step"] + 1))
    outs = [s["swapped_out"] for s in fresh if s.get("swapped_out") is not None]
    return steps, (outs[-1] - outs[0]) if len(outs) >= 2 else None


def _governor_said(ctx: dict[str, Any], from_step: int) -> str:
    acts = [e for e in ctx.get("adaptations") or [] if e.get("step", 0) >= from_step
            and e.get("action") in ("lower_micro_batch", "enable_grad_checkpointing", "enable_loss_chunk",
                                    "release_cache")]
    if not acts:
        return ("the governor changed nothing" + ("" if ctx.get("adapt", True) else " (memory.adapt=false)")
                + ("" if ctx.get("budget_set") else "; set memory.budget so it keeps the run under RAM"))
    said = []
    for e in acts[:3]:
        b, a = e.get("before") or {}, e.get("after") or {}
        what = {"lower_micro_batch": f"lowered the micro-batch {b.get('batch_size')} -> {a.get('batch_size')}",
                "enable_grad_checkpointing": "turned on gradient checkpointing",
                "enable_loss_chunk": f"computed the loss in chunks of {a.get('loss_chunk')} tokens",
                "release_cache": "released MLX's cache"}[e["action"]]
        said.append(f"{what} at step {e['step']} ({e.get('trigger')})")
    return "the governor " + ", then ".join(said)


# ---- the registry: each backend's rules module (backends/<name>/rules.py) adds its own ----------
Rule = Callable[[list[dict[str, Any]], dict[str, Any]], list[Explanation]]

BACKEND_RULES: list[tuple[Rule, str]] = []  # (rule, the name of the shared rule it follows)
SWAP_EXPLAINED_BY: set[str] = set()  # explanations that already tell the swap story (rule_swap stays quiet)


@dataclass(frozen=True)
class AllocatorWords:
    """How one backend's allocator cache reads in the shared rules (cache growth, fragmentation)."""

    backend: str  # the samples' "backend"
    marker: str | None  # a sample key only this backend writes (for samples without "backend")
    cache_limit_key: str | None  # the sample key of the cache's cap, where one exists
    cache_growth: Callable[[int | None], str]  # the cap (or None) -> the sentence's end
    fragmentation: Callable[[int | None], str]  # inactive split bytes (or None) -> the sentence's end


ALLOCATOR_WORDS: list[AllocatorWords] = []
_FALLBACK_WORDS: list[AllocatorWords] = []  # for a sample no backend claims


def register(rule: Rule, after: str, explains_swap: tuple[str, ...] = ()) -> None:
    """Add a backend's ``rule`` to the explanations, right after the shared rule named ``after``
    (once). ``explains_swap``: the rule ids of its explanations that make ``rule_swap`` redundant."""
    if all(r is not rule for r, _ in BACKEND_RULES):
        BACKEND_RULES.append((rule, after))
    SWAP_EXPLAINED_BY.update(explains_swap)


def register_allocator_words(words: AllocatorWords, fallback: bool = False) -> None:
    """Add a backend's allocator wording; ``fallback``: also the words for unclaimed samples."""
    if words not in ALLOCATOR_WORDS:
        ALLOCATOR_WORDS.append(words)
    if fallback and not _FALLBACK_WORDS:
        _FALLBACK_WORDS.append(words)


def allocator_words(s: dict[str, Any]) -> AllocatorWords:
    """The wording of the backend that recorded ``s`` (its "backend", else a key only it writes)."""
    for w in ALLOCATOR_WORDS:
        if s.get("backend") == w.backend or (w.marker is not None and s.get(w.marker) is not None):
            return w
    return _FALLBACK_WORDS[0]
