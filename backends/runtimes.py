"""Loading a backend's runtime (``finetune.backends.<name>.runtime``, which imports its framework).

Above the registry (``finetune.backends``) and the planner, since the runtimes use both; only the
loop, generation and scripts that train load one, and only the chosen backend's, so the other
platform's framework is never imported.
"""

from __future__ import annotations

import importlib
import importlib.util

from finetune.backends import BACKENDS
from finetune.backends.base import Backend
from finetune.errors import UserError


def get_backend(name: str) -> Backend:
    """Instantiate a backend by concrete name, importing only its module."""
    needs = {"cuda": ("torch", "backend=cuda needs torch: run `bash scripts/setup.sh` (or pip install '.[cuda]')"),
             "mlx": ("mlx", "backend=mlx needs mlx: pip install '.[mlx]' (on Linux this brings mlx[cpu])")}
    if name not in needs:
        raise UserError(f"backend={name} is not valid; choose one of: auto, {', '.join(BACKENDS)}")
    module, fix = needs[name]
    if importlib.util.find_spec(module) is None:
        raise UserError(fix)
    runtime = importlib.import_module(f"finetune.backends.{name}.runtime")
    return runtime.BACKEND()
