"""``python -m finetune.export``: the ``finetune-export`` command (finetune/export/__init__.py)."""

import sys

from finetune.export import main

if __name__ == "__main__":
    sys.exit(main())
