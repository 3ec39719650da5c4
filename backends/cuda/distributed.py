"""Several processes of one cuda-backend run: torchrun / ``accelerate launch`` / SLURM.

The launcher's environment says how many ranks there are (WORLD_SIZE, RANK, LOCAL_RANK and
MASTER_ADDR/MASTER_PORT from torchrun and accelerate; SLURM_NTASKS, SLURM_PROCID,
SLURM_LOCALID under ``srun`` without torchrun, with MASTER_ADDR set by the job script). The
process group is nccl on GPUs and gloo on the CPU.

Two strategies (``backend.strategy``):

- ``ddp``: every rank holds the whole model. Gradients are accumulated locally over the
  rank's micro-batches and summed over ranks once per optimizer step, in flat buckets of at
  most ``DDP_BUCKET_BYTES`` (``sum_gradients``), after the loop's per-step agreement. Not
  torch's DistributedDataParallel wrapper: DDP all-reduces inside the last backward, so an
  out-of-memory error on one rank leaves the others waiting in that all-reduce forever; here
  every rank first learns whether any rank ran out of memory and only then communicates, so
  the governor can lower the micro-batch on all of them at the same step. For LoRA the
  gradients are a few MB and the lost overlap costs nothing measurable; for a full fine-tune
  the all-reduce is the price of that guarantee (it runs once per optimizer step, not per
  micro-batch).
- ``fsdp``: FSDP2 ``fully_shard`` over one mesh of all ranks, each decoder layer a unit and
  the root (embeddings, final norm, lm_head) the last, full shard (weights resharded after
  forward). Gradients are reduce-scattered in every micro-batch's backward (sharded
  accumulation: less memory than holding unsharded gradients until the last micro-batch).
  Because FSDP all-gathers inside forward, an out-of-memory error on one rank cannot be
  survived in-process under fsdp: the others wait in a collective. Run it with
  ``memory.budget`` (the governor plans before loading) and checkpoints.

Loss convention under either: every rank scales its local loss sum by 1 / label tokens of
the whole optimizer step (all ranks), so the SUM of gradients over ranks is the one-process
gradient. DDP sums; FSDP's reduce-scatter would average, so its divide factor is set to 1.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from finetune.backends.base import Comm
from finetune.backends.cuda.memory import DDP_BUCKET_BYTES
from finetune.errors import UserError


def launched_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when a launcher started several processes, else None."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1") or 1) > 1:
        return int(env.get("RANK", 0)), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    # srun without torchrun (also submitit's tasks_per_node > 1): one task per GPU, torch's
    # env:// rendezvous from SLURM's ids. SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: the batch
    # script itself also sees the job's task count, but runs as a step of one task.
    if int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1 and "RANK" not in env:
        head = env.get("MASTER_ADDR") or _slurm_head_node()
        if head is None:
            raise UserError("several SLURM tasks but no MASTER_ADDR; export MASTER_ADDR=$(scontrol show hostnames "
                            "$SLURM_JOB_NODELIST | head -n1) in the job script (or launch with srun torchrun)")
        env["MASTER_ADDR"] = head
        env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0") or 0) % 1000))
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    return None


def _slurm_head_node() -> str | None:
    """The job's first node (``scontrol show hostnames``), where rank 0 listens."""
    import shutil
    import subprocess

    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if not nodes or shutil.which("scontrol") is None:
        return None
    out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=30)
    names = out.stdout.split()
    return names[0] if out.returncode == 0 and names else None


class TorchComm(Comm):
    """Collectives on torch.distributed's default process group."""

    def __init__(self, rank: int, world_size: int, local_rank: int, use_cuda: bool, alone: bool = False):
        """``alone``: a group of this one process (FSDP2 at world size 1, for backend.cpu_offload
        without a launcher), its rendezvous an in-process store: no address, no port."""
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            try:
                if alone:
                    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                else:
                    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
            except (RuntimeError, ValueError) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UserError(f"the process group ({backend}) could not start: {first[:200]}; launch with "
                                "torchrun --nproc-per-node N -m finetune ... (it sets MASTER_ADDR, MASTER_PORT, "
                                "RANK, WORLD_SIZE)") from None
        self.description = f"rank {rank} of {world_size} ({backend})"

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def broadcast_parameters(params: list[torch.Tensor]) -> None:
    """Rank 0's values into every rank's ``params`` (trainable weights start equal, as DDP's
    constructor makes them; the seed already does, this makes it a guarantee)."""
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def sum_gradients(params: list[torch.nn.Parameter], bucket_bytes: int = DDP_BUCKET_BYTES) -> None:
    """Sum every parameter's gradient over ranks, in flat buckets of at most ``bucket_bytes``
    (one dtype per bucket; one bucket alive at a time), in place. A gradient larger than the
    bucket is all-reduced where it lies, with no copy."""
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in group + [None]:  # None flushes the last bucket
            if g is not None and g.numel() * g.element_size() > bucket_bytes:
                dist.all_reduce(g, op=dist.ReduceOp.SUM)  # alone and in place: no bucket copy
                continue
            if g is not None and (not bucket or size + g.numel() * g.element_size() <= bucket_bytes):
                bucket.append(g)
                size += g.numel() * g.element_size()
                continue
            if bucket:
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                offset = 0
                for b in bucket:
                    n = b.numel()
                    b.copy_(flat[offset:offset + n].view_as(b))
                    offset += n
                del flat
            bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)


def decoder_layers(hf: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks of a transformers causal LM (FSDP's units)."""
    names = getattr(hf, "_no_split_modules", None) or []
    layers = [m for m in hf.modules() if type(m).__name__ in names]
    if not layers:  # an architecture that does not declare them: the ModuleList of blocks
        for m in hf.modules():
            if isinstance(m, torch.nn.ModuleList) and len(m) > 1:
                layers = list(m)
                break
    return layers


def shard_model(model: torch.nn.Module, hf: torch.nn.Module, comm: TorchComm, param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None, cpu_offload: bool = False) -> list[torch.nn.Module]:
    """FSDP2 ``fully_shard`` each decoder layer, then the root (``model``: the PeftModel for
    adapters, else the transformers model). Mixed precision through FSDP's policy: unsharded
    parameters in ``param_dtype`` for compute, gradients reduced in ``reduce_dtype``.
    ``cpu_offload``: FSDP's ``CPUOffloadPolicy`` (the shards, their gradients and so the
    optimizer's state in host memory, pinned where a GPU copies them). Returns the units, first
    to last."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(comm.device.type, (comm.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=comm.device.type == "cuda") if cpu_offload else OffloadPolicy()
    units = []
    for layer in decoder_layers(hf):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        units.append(layer)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    units.append(model)
    # bitsandbytes' QuantState is no parameter: fully_shard moved each Params4bit to the mesh's
    # device (Params4bit.to moves its state in place); make sure of it where the model loaded on
    # the host (cpu_offload), since the layer computes on the device with it
    for mod in model.modules():
        qs = getattr(mod, "quant_state", None) if hasattr(mod, "quant_storage") else None
        if qs is not None:
            qs.to(comm.device)
    for u in units:
        # sum, not mean, over ranks: the loss is already scaled for the whole step
        u.set_gradient_divide_factor(1.0)
        # plain SUM collectives: a factor of 1 needs no pre/post scaling, and gloo (the CPU
        # process group) has no PREMUL_SUM, which FSDP would otherwise ask for
        u.set_force_sum_reduction_for_comms(True)
    return units


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise): what its memory holds."""
    return t.to_local() if hasattr(t, "to_local") else t
