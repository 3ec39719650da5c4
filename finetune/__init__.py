"""finetune: fine-tune LLMs on CUDA or Apple Silicon with memory accounting that tells the truth."""

from pathlib import Path as _Path

# conf/ and backends/ sit at the top of the repository and install as finetune.conf and
# finetune.backends (pyproject's package-dir). Run from a source tree without installing
# (PYTHONPATH=checkout, a copy made for mutation tests), the same two folders serve.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "backends" / "base.py").is_file():
    __path__.append(str(_root))  # noqa: F821
