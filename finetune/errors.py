"""The error a user's input causes, at the bottom of the house: every layer raises it and the
CLI turns it into one line, so it imports nothing of the project's."""

from __future__ import annotations


class UserError(Exception):
    """A bad input: printed as one line naming the fix, exit code 2, no traceback."""
