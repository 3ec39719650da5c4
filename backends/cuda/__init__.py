"""The cuda backend: torch + transformers + PEFT + bitsandbytes (runs on CPU without a GPU).

``runtime`` imports torch; ``capabilities`` and ``memory`` never do."""
