"""The run's live state: what the governor may change while training, in one typed object.

The governor owns it; the loop reads the micro-batch from it; the planner prices it (so a
plan made mid-run is for the run as it is now, not as it was configured); checkpoints save
it. Changing it never changes the math: the effective batch is fixed for the run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from finetune.spec import RunSpec


@dataclass
class RunState:
    backend: str  # the concrete backend ("cuda" | "mlx"), backend=auto resolved
    micro_batch: int  # samples per forward/backward
    effective_batch: int  # samples per optimizer step: micro_batch * grad_accum, fixed for the run
    grad_checkpointing: bool
    loss_chunk: int = 0  # train.loss_chunk: target tokens per chunk of head + loss (0: the whole logits)
    # train.packing: tokens per packed micro-batch (the memory lever then; micro_batch is not
    # used to split a step); 0: not packed
    tokens_per_micro: int = 0
    activation_offload: bool = False  # train.activation_offload: saved activations in host memory
    cpu_offload: bool = False  # backend.cpu_offload: FSDP's shards, grads and state in host memory

    @property
    def grad_accum(self) -> int:
        return self.effective_batch // self.micro_batch

    @classmethod
    def from_spec(cls, spec: RunSpec, backend: str) -> RunState:
        """The run's state as configured: the governor changes it from there."""
        t = spec.train
        return cls(backend=backend, micro_batch=t.batch_size, effective_batch=t.effective_batch,
                   grad_checkpointing=t.grad_checkpointing, loss_chunk=t.loss_chunk,
                   tokens_per_micro=t.packed_tokens, activation_offload=t.activation_offload,
                   cpu_offload=spec.backend.cpu_offload)

    def with_(self, **changes: Any) -> RunState:
        """A copy with ``changes`` (micro_batch, grad_checkpointing, ...)."""
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "grad_accum": self.grad_accum}
