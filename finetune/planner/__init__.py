"""Predict a run's memory from the config alone: no weights loaded, no torch, no mlx.

``plan(spec)`` builds the parameter inventory the backends would build (every tensor, its
shape, dtype, whether it trains, how it is quantized), then prices each mechanism that holds
memory during a step:

- weights by dtype; 4-bit NF4 (bitsandbytes) or affine (mlx) quantization with its constants;
- LoRA/DoRA adapters exactly per adapted Linear and layer;
- gradients for trainable tensors only;
- optimizer state per optimizer and per tensor (bitsandbytes' small-tensor and paging rules);
- activations kept for backward, per layer that needs gradients, by attention implementation
  and gradient checkpointing; logits and the loss at full vocabulary;
- framework overheads (CUDA context, allocator rounding);
- several processes (``backend.num_devices`` ranks without ``device_map=auto``): per rank for
  ``backend.strategy`` (ddp replicas, FSDP2 shards), plus the collectives' buffers (the memory
  model's ``rank_tensors`` and ``collective_buffers``); plan.json's ``per_rank`` section.

Every figure is an int of bytes. The mechanisms cite the libraries' code they model (file and
function, versions: torch 2.13, transformers 5.24, peft 0.21, bitsandbytes 0.50, accelerate
1.15, mlx 0.32, mlx-lm 0.32). Where a number is calibrated rather than derived it says so.

The package, each module on top of the next: ``report`` (table, plan.json, plan_error), ``fit``
(``plan`` and fitting a budget, levers), ``price`` (bytes per category, device and phase;
``preference``: a preference step's 2 rows a pair, its reference pass or table),
``model`` (the setup resolved, the inventory), ``describe`` (the model description from
config.json). The types a memory model reads too sit below the backends: ``finetune.model.types``,
``finetune.model.inventory``. What a
framework holds is not here: each backend's memory model (``finetune/backends/<name>/memory.py``,
torch/mlx-free) prices its weights, optimizer state, activations and overheads, so adding an
optimizer or a precision to one backend touches that backend's folder only.

Public API: ``plan``, ``format_table``, ``run_plan``, ``trainable_params``, ``parse_budget``,
``fit_to_budget`` (+ ``FitResult``), ``plan_error``.
"""

from __future__ import annotations

from finetune.backends import memory_model
from finetune.backends.cuda.memory import (  # the backends' own constants and pricing functions, by their old names
    BNB_QMAPS_BYTES,
    CUDA_CONTEXT_BYTES,
    DDP_BUCKET_BYTES,
    bnb4_bytes,
)
from finetune.backends.mlx.memory import mlx_quant_bytes
from finetune.budget import parse_budget
from finetune.model.types import ModelDesc
from finetune.model.describe import describe
from finetune.planner.fit import FitResult, fit_to_budget, plan
from finetune.planner.setup import SCHEMA_VERSION, describe_model, inventory, resolve
from finetune.planner.price import (
    _split_layers,  # noqa: F401  (tests check the split directly)
    activations,
    params_total,
    trainable_params,
)
from finetune.planner.present import format_run_plan_error, format_table, plan_error, run_plan, run_plan_error
from finetune.model.inventory import GIB, MIB, Setup, Tensor

__all__ = ["FitResult", "fit_to_budget", "format_table", "params_total", "parse_budget", "plan", "plan_error", "run_plan_error", "format_run_plan_error",
           "run_plan", "trainable_params",
           # the pieces, for tests and scripts that price parts of a plan
           "BNB_QMAPS_BYTES", "CUDA_CONTEXT_BYTES", "DDP_BUCKET_BYTES", "GIB", "MIB", "SCHEMA_VERSION", "ModelDesc", "Setup", "Tensor",
           "activations", "bnb4_bytes", "describe", "describe_model", "inventory", "memory_model", "mlx_quant_bytes",
           "optimizer_state_bytes", "resolve"]


def optimizer_state_bytes(optim: str, backend: str, shape: tuple[int, ...], dtype_bytes: int,
                          on_gpu: bool, momentum: float = 0.0, host_step: bool = False) -> tuple[int, int]:
    """(allocator-held bytes, paged bytes) of one trainable tensor's optimizer state on
    ``backend``: its memory model's ``optimizer_state_bytes``."""
    return memory_model(backend).optimizer_state_bytes(optim, shape, dtype_bytes, on_gpu, momentum, host_step)
