"""The cuda runtime's optimizers: one constructor per name the backend's capabilities list
(torch's Adam/AdamW, fused where the parameters allow, SGD; transformers' Adafactor;
bitsandbytes' 8-bit and paged ones), built over the trainable parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from finetune.backends.cuda.capabilities import CAPABILITIES

from finetune.errors import UserError
from finetune.spec import OptimSpec

OPTIMIZERS = CAPABILITIES.optimizers


def _adafactor(params: list[torch.nn.Parameter], o: OptimSpec) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    # Fixed lr from the loop's schedule; eps = (regularizer of the squared grad, of the scale).
    return Adafactor(params, lr=o.lr, eps=(o.eps, 1e-3), weight_decay=o.weight_decay, scale_parameter=False,
                     relative_step=False, warmup_init=False)


def _bnb(name: str) -> Callable[[list[torch.nn.Parameter], OptimSpec], torch.optim.Optimizer]:
    # Paged optimizers put state >= 1e5 elements in CUDA unified memory; on CPU bitsandbytes
    # warns and falls back to ordinary tensors.
    def make(params: list[torch.nn.Parameter], o: OptimSpec) -> torch.optim.Optimizer:
        import bitsandbytes as bnb

        return getattr(bnb.optim, name)(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)

    return make


def _fused(params: list[torch.nn.Parameter], o: OptimSpec) -> dict[str, Any]:
    """``fused=True`` for Adam/AdamW whose parameters are all plain floating tensors on the CPU or
    a CUDA device: one kernel per tensor (CPU: 0.44 -> 0.10 ms per step for the 16 LoRA tensors
    of benchmarks/vs_peers.py's model) and, on CUDA, no workspace: torch's default foreach path
    allocates one more copy of every trainable tensor in its step (``_foreach_sqrt`` of
    exp_avg_sq; +6 GiB at a 3B full fine-tune in bf16), the fused kernel none. HF Trainer's
    default since torch 2.8 is this kernel (adamw_torch_fused) and torchtune's configs set
    fused=True. ``optim.fused=false`` and FSDP's DTensor shards keep torch's default (foreach), as the planner prices
    (backends/cuda/memory.py adam_fused)."""
    ok = o.fused and bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                              and type(p.data) is torch.Tensor for p in params)
    return {"fused": True} if ok else {}


# One constructor per name in CAPABILITIES.optimizers (tests/test_capabilities.py checks both ways)
OPTIMIZER_BUILDERS: dict[str, Callable[[list[torch.nn.Parameter], OptimSpec], torch.optim.Optimizer]] = {
    "adamw": lambda p, o: torch.optim.AdamW(p, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                            **_fused(p, o)),
    "adam": lambda p, o: torch.optim.Adam(p, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                          **_fused(p, o)),
    "sgd": lambda p, o: torch.optim.SGD(p, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay),
    "adafactor": _adafactor,
    "adamw_8bit": _bnb("AdamW8bit"),
    "paged_adamw_8bit": _bnb("PagedAdamW8bit"),
    "paged_adamw": _bnb("PagedAdamW32bit"),
}


def build_optimizer(o: OptimSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if o.name not in OPTIMIZER_BUILDERS:  # a lookup that misses raises, never falls through
        raise UserError(f"optim={o.name} is not supported by backend=cuda; choose one of: {', '.join(OPTIMIZERS)}")
    return OPTIMIZER_BUILDERS[o.name](params, o)
