"""`python -m finetune ...` runs the CLI, as the `finetune` console script does."""

from finetune.cli import main

main()
