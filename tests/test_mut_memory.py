"""The memory models' pieces on their edges, priced on tensors whose bytes are chosen so the
edge is met exactly."""

from __future__ import annotations

from pathlib import Path

from finetune.backends.cuda.memory import DDP_BUCKET_BYTES, collective_buffers

from finetune import planner
from finetune.config import compose
from finetune.planner import Tensor

MiB = 1 << 20


def _grad(name: str, nbytes: int) -> Tensor:
    return Tensor(name, (nbytes // 4,), 0, "linear", True, 4)  # fp32


def test_ddp_packs_gradients_that_fill_a_bucket_exactly_into_one(tmp_path: Path) -> None:
    # torch DDP's bucket_cap_mb=25: 20 MiB + 5 MiB of gradients make one full 25 MiB bucket
    _, s = planner.resolve(compose(tmp_path / "run", "backend=cuda", "backend.num_devices=2"))
    assert (s.strategy, s.world_size, DDP_BUCKET_BYTES) == ("ddp", 2, 25 * MiB)
    full = collective_buffers([_grad("a", 20 * MiB), _grad("b", 5 * MiB)], s)
    assert full == {"ddp_bucket": {"bytes": 25 * MiB, "phase": "grad_sync"}}
    over = collective_buffers([_grad("a", 20 * MiB), _grad("b", 5 * MiB + 4)], s)
    assert over == {"ddp_bucket": {"bytes": 20 * MiB, "phase": "grad_sync"}}
