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

# precision: (weight dtype, autocast dtype or None); None weight dtype = the stored one
CUDA = {
    "auto": (None, None),
    "32-true": ("float32", None),
    "bf16-mixed": ("float32", "bfloat16"),
    "bf16-true": ("bfloat16", None),
    "16-mixed": ("float32", "float16"),
}
MLX = {"auto": None, "32-true": "float32", "bf16-true": "bfloat16"}


@dataclass(frozen=True)
class Dtypes:
    weights: str  # frozen (and, for method=full, trained) weights
    adapters: str  # LoRA/DoRA matrices
    compute: str  # the matmuls' dtype (autocast's where there is one)
    autocast: str | None
    note: str | None = None  # a choice made for the user, said in the plan and the run


def resolve(backend: str, precision: str, method: str, stored: str) -> Dtypes:
    """Dtypes a run of ``backend`` with ``precision`` and ``method`` holds, for a checkpoint
    stored in ``stored`` (see ``finetune.model_source.stored_dtype``)."""
    if backend == "mlx":
        w = MLX[precision] or stored
        # mlx-lm draws LoRA matrices in fp32; bf16-true casts them (model.set_dtype) with the rest
        return Dtypes(w, w if precision != "auto" else "float32", w, None)
    weights, autocast = CUDA[precision]
    note = None
    if weights is None:
        weights = stored
        if stored == "float16" and method == "full":
            # Pure fp16 weights train without loss scaling (GradScaler refuses fp16 params) and
            # overflow; bf16 holds the same 2 bytes a weight with fp32's range.
            weights = "bfloat16"
            note = "precision=auto: the checkpoint stores float16; method=full trains it in bfloat16 (same bytes)"
    adapters = "bfloat16" if precision == "bf16-true" else "float32"
    return Dtypes(weights, adapters, autocast or weights, autocast, note)
