"""Compat overlay for `recheck` at a session commit older than the move of UserError into
finetune/errors.py (issue 22): test files written since import it from here. Copied into the
work tree only where that commit lacks the file."""

from finetune.config import UserError  # noqa: F401
