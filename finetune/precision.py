"""What a precision means in dtypes, for the planner and both backends alike. No torch, no mlx.

``precision=auto`` (the default) keeps the checkpoint's stored dtype, as transformers 5
(``from_pretrained(dtype="auto")``), PEFT and mlx-lm (``mlx_lm.load``) do: frozen weights as
stored, LoRA/DoRA matrices in fp32 (PEFT's ``autocast_adapter_dtype=True``; mlx-lm's
``LoRALinear`` draws them in fp32), ``method=full`` in the stored dtype. The explicit
precisions cast: ``32-true`` everything fp32, ``bf16-true`` everything bf16, the ``-mixed``
ones fp32 master weights with an autocast dtype (cuda only).
"""

from __future__ import annotations

from dataclasses import dataclass
from finetune.backends import capabilities

# What each precision means per backend lives in its capabilities
# (finetune/backends/<name>/capabilities.py ``precisions``: weight dtype or None = as stored,
# autocast dtype or None); this module turns that into the dtypes a run holds.


@dataclass(frozen=True)
class Dtypes:
    weights: str  # frozen (and, for method=full, trained) weights
    adapters: str  # LoRA/DoRA matrices
    compute: str  # the matmuls' dtype (autocast's where there is one)
    autocast: str | None
    note: str | None = None  # a choice made for the user, said in the plan and the run


def resolve(backend: str, precision: str, method: str, stored: str) -> Dtypes:
    """Dtypes a run of ``backend`` with ``precision`` and ``method`` holds, for a checkpoint
    stored in ``stored`` (see ``finetune.model.source.stored_dtype``)."""
    weights, autocast = capabilities(backend).precisions[precision]
    note = None
    if weights is None:
        weights = stored
        if stored == "float16" and method == "full" and autocast is None:
            # Pure fp16 weights train without loss scaling (GradScaler refuses fp16 params) and
            # overflow; bf16 holds the same 2 bytes a weight with fp32's range.
            weights = "bfloat16"
            note = "precision=auto: the checkpoint stores float16; method=full trains it in bfloat16 (same bytes)"
    # PEFT holds adapters in fp32 unless bf16-true (autocast_adapter_dtype); mlx-lm draws them
    # in fp32 and bf16-true's model.set_dtype casts them with the rest
    adapters = "bfloat16" if precision == "bf16-true" else "float32"
    return Dtypes(weights, adapters, autocast or weights, autocast, note)
