"""Loading a backend's runtime (``finetune.backends.<name>.runtime``, which imports its framework).

Above the registry (``finetune.backends``) and the planner, since the runtimes use both; only the
loop, generation and scripts that train load one, and only the chosen backend's, so the other
platform's framework is never imported.
"""

from __future__ import annotations

import importlib
import importlib.util

from finetune.backends import capabilities
from finetune.backends.base import Backend
from finetune.errors import UserError


def get_backend(name: str) -> Backend:
    """Instantiate a backend by concrete name, importing only its module."""
    caps = capabilities(name)  # an unknown name: UserError naming the registered ones
    if caps.framework and importlib.util.find_spec(caps.framework) is None:
        raise UserError(caps.install)
    runtime = importlib.import_module(f"finetune.backends.{name}.runtime")
    return runtime.BACKEND()
