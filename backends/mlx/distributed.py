"""Several processes of one MLX run (``mlx.launch``, mpirun): which launcher started this
process, the ranks' ``Comm`` over ``mx.distributed``, and gradients summed over ranks.

The cuda backend's counterpart is ``backends/cuda/distributed.py``.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from finetune.backends.base import Comm
from finetune.errors import UserError
from mlx.utils import tree_flatten, tree_unflatten

# What each mx.distributed backend's launcher leaves in the environment (mlx's
# _distributed_utils/launch.py): ring writes the hosts' "ip:port" lists to a temporary file
# named by MLX_HOSTFILE (an empty file under -n 1: one process) and sets MLX_RANK; jaccl
# (Thunderbolt RDMA, macOS 26.2+) sets MLX_IBV_DEVICES and MLX_JACCL_COORDINATOR; mpirun
# sets OMPI_COMM_WORLD_SIZE.
_FIXES = {
    "ring": "check that every host in the hostfile reaches the others at the IPs listed, that the ports are "
            "free (mlx.launch -p PORT picks others) and that every rank runs the same command",
    "jaccl": "check the hostfile's rdma devices (mlx.distributed_config --backend jaccl) and that rank 0's IP "
             "is reachable from every host",
    "mpi": "check that mpirun reaches every host and that MLX finds libmpi (mlx.launch --backend mpi)",
}


def launcher_backend(env: Mapping[str, str] | None = None) -> str | None:
    """The mx.distributed backend whose launcher started this process with more than one rank,
    or None (no launcher, or ``mlx.launch -n 1``)."""
    env = os.environ if env is None else env
    if env.get("MLX_IBV_DEVICES") and "MLX_RANK" in env:
        return "jaccl"
    hostfile = env.get("MLX_HOSTFILE")
    if hostfile and "MLX_RANK" in env:
        try:
            one_process = not Path(hostfile).read_text().strip()  # -n 1: mlx.launch writes ""
        except OSError:
            one_process = False  # let init fail on it, with the fix named
        return None if one_process else "ring"
    if int(env.get("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "mpi"
    return None


class MlxComm(Comm):
    """The ranks of an ``mx.distributed`` group. Values cross as raw bytes (float64 packed into
    uint8 and all-gathered, then reduced here in rank order), so a reduction is exact and gives
    the same number on every rank, where mlx's own all_sum would round through float32."""

    def __init__(self, group: Any, kind: str) -> None:
        self.group = group
        self.rank, self.world_size = int(group.rank()), int(group.size())
        self.kind = kind
        self.hosts: list[str] = self.all_gather_object(socket.gethostname())
        self.local_rank = self.hosts[: self.rank].count(self.hosts[self.rank])
        n_hosts = len(dict.fromkeys(self.hosts))
        self.description = f"mx.distributed {kind}: {self.world_size} processes on {n_hosts} host(s)"

    def _gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (the same length on every rank), at index = rank."""
        out = mx.distributed.all_gather(mx.array(np.frombuffer(data, np.uint8)), group=self.group)
        rows = np.asarray(out).reshape(self.world_size, len(data))
        return [r.tobytes() for r in rows]

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce op={op!r}; choose sum or max")
        if not values:
            return []
        rows = [np.frombuffer(b, np.float64) for b in self._gather_bytes(np.asarray(values, np.float64).tobytes())]
        acc = rows[0].copy()
        for r in rows[1:]:  # rank order: the same float sum on every rank
            acc = acc + r if op == "sum" else np.maximum(acc, r)
        return [float(v) for v in acc]

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj)
        lengths = [int(np.frombuffer(b, np.int64)[0]) for b in self._gather_bytes(np.int64(len(data)).tobytes())]
        padded = self._gather_bytes(data + bytes(max(lengths) - len(data)))
        return [pickle.loads(b[:n]) for b, n in zip(padded, lengths)]

    def barrier(self) -> None:
        mx.eval(mx.distributed.all_sum(mx.zeros(1), group=self.group))

    def close(self) -> None:
        """mx.distributed has no call to leave a group: its sockets close with the process."""


def sum_over_ranks(tree: Any, group: Any, chunk_bytes: int = 32 * 2**20) -> Any:
    """``tree`` summed elementwise over the ranks of ``group``: consecutive arrays of one dtype
    are flattened into chunks of about ``chunk_bytes`` (one all_sum per chunk, as mlx's
    ``nn.average_gradients``, which mlx-lm's trainer uses), but summed, not averaged: the loop
    scales every rank's loss by 1 / label tokens of the whole step, so the sum is the
    one-process gradient."""
    flat = tree_flatten(tree)
    out: list[tuple[str, mx.array]] = []
    i = 0
    while i < len(flat):
        j, size, dtype = i, 0, flat[i][1].dtype
        while j < len(flat) and flat[j][1].dtype == dtype and (j == i or size + flat[j][1].nbytes <= chunk_bytes):
            size += flat[j][1].nbytes
            j += 1
        chunk = flat[i:j]
        if len(chunk) == 1:
            out.append((chunk[0][0], mx.distributed.all_sum(chunk[0][1], group=group)))
        else:
            big = mx.distributed.all_sum(mx.concatenate([v.reshape(-1) for _, v in chunk]), group=group)
            cuts = np.cumsum([v.size for _, v in chunk])[:-1].tolist()
            out += [(k, part.reshape(v.shape)) for (k, v), part in zip(chunk, mx.split(big, cuts))]
        i = j
    return tree_unflatten(out)


def join() -> Comm:
    """Join ``mx.distributed`` when ``mlx.launch`` (or mpirun) started this process as one of
    several ranks (``MlxComm``); otherwise stay one process (``Comm()``)."""
    kind = launcher_backend()
    if kind is None:
        return Comm()
    try:
        group = mx.distributed.init(strict=True, backend=kind)
    except (RuntimeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        # the ring says "(error: 98)": add the errno's words (address in use, refused)
        first = re.sub(r"\(error: (\d+)\)", lambda m: f"(error {m[1]}: {os.strerror(int(m[1]))})", first)
        raise UserError(f"rank {os.environ.get('MLX_RANK', '?')}: mx.distributed.init(backend={kind}) failed "
                        f"({first[:200]}); {_FIXES[kind]}") from None
    return MlxComm(group, kind) if group.size() > 1 else Comm()
