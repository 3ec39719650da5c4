"""The error a user's input causes, at the bottom of the house: every layer raises it and the
CLI turns it into one line, so it imports nothing of the project's."""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn


class UserError(Exception):
    """A bad input: printed as one line naming the fix, exit code 2, no traceback."""


def debug() -> bool:
    """``--debug`` or ``HYDRA_FULL_ERROR=1``: errors show their traceback (for bug reports)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def refuse(e: BaseException) -> NoReturn:
    """A bad input: one line naming the fix, exit 2; under --debug its traceback first."""
    if debug():
        traceback.print_exception(e)
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    sys.exit(2)
