"""Activation offload (``train.activation_offload``): what autograd saves for backward during
the model's body moves to host memory as the forward saves it and comes back when backward
reads it, through ``torch.autograd.graph.saved_tensors_hooks`` (torchtune's
``training/_activation_offloading.py`` OffloadActivations does the same; transformers'
checkpoint offload likewise).

Kept on the device: tensors under ``OFFLOAD_MIN_BYTES`` (a copy costs more than it saves),
parameters (they stay where they are anyway), and everything saved from the output head on
(its logits and the loss's tensors are the first that backward reads). A storage saved by
several ops (one input read by q, k and v) moves once and comes back once: the hooks key it by
its storage, as the planner counts unique storages (backends/cuda/activations.py). On a GPU the
host copies are pinned, so both directions run without a pageable staging copy. Under
gradient checkpointing the hooks see what checkpoint saves outside its regions (each layer's
input, torch.utils.checkpoint _NoopSaveInputs), not the recomputation's.

``moved_bytes`` counts what the hooks copied, both ways (forward to host, backward back): the
run's transfer volume, which the plan prices (``offload_transfer_bytes``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from finetune.backends.cuda.activations import OFFLOAD_MIN_BYTES


class _HostCopy:
    """One device storage held in host memory, with the views autograd saved of it."""

    __slots__ = ("host", "device", "users", "back")

    def __init__(self, host: torch.UntypedStorage, device: torch.device) -> None:
        self.host, self.device, self.users = host, device, 0
        self.back: torch.UntypedStorage | None = None  # the storage restored on the device


class ActivationOffload:
    """``with off.forward(head):`` around a forward: its saved tensors go to the host."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        # under FSDP a parameter is a DTensor (no storage of its own): its local shard's
        self._params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                        for p in model.parameters()}
        self._live: dict[int, tuple[Any, _HostCopy]] = {}  # device storage address -> its host copy, this forward
        self._on = False
        self.moved_bytes = 0  # bytes copied by the hooks, to the host and back, since the last read

    def take_moved(self) -> int:
        """The bytes moved since the last call (a step's transfer volume)."""
        n, self.moved_bytes = self.moved_bytes, 0
        return n

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._on or t.device != self.device or t.is_sparse:
            return t
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
            return t
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() < OFFLOAD_MIN_BYTES or isinstance(t, torch.nn.Parameter):
            return t
        got = self._live.get(key)
        # the same storage, not a new one at a freed one's address (storages keep their Python
        # object while they live, so a weak reference tells them apart)
        copy = got[1] if got is not None and got[0]() is storage else None
        if copy is None:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.pin).untyped_storage()
            host.copy_(storage, non_blocking=self.pin)
            copy = _HostCopy(host, t.device)
            self._live[key] = (weakref.ref(storage), copy)
            self.moved_bytes += storage.nbytes()
        copy.users += 1
        return (copy, t.dtype, t.storage_offset(), t.size(), t.stride(), t.requires_grad)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        copy, dtype, offset, size, stride, _ = packed
        if copy.back is None:
            back = torch.empty(copy.host.nbytes(), dtype=torch.uint8, device=copy.device).untyped_storage()
            back.copy_(copy.host, non_blocking=self.pin)
            copy.back = back
            self.moved_bytes += copy.host.nbytes()
        out = torch.empty(0, dtype=dtype, device=copy.device).set_(copy.back, offset, size, stride)
        copy.users -= 1
        if copy.users == 0:  # every saved view of it read: the device copy lives in those views only
            copy.back = None
        return out

    def forward(self, head: torch.nn.Module | None) -> Any:
        """The hooks for one forward; offloading stops where ``head`` (the output head) starts."""
        return _Forward(self, head)


class _Forward:
    def __init__(self, off: ActivationOffload, head: torch.nn.Module | None) -> None:
        self.off, self.head = off, head
        self.hooks = torch.autograd.graph.saved_tensors_hooks(off._pack, off._unpack)
        self.handle: Any = None

    def __enter__(self) -> None:
        self.off._live = {}
        self.off._on = True
        if self.head is not None:
            self.handle = self.head.register_forward_pre_hook(self._head_starts)
        self.hooks.__enter__()

    def _head_starts(self, *_: Any) -> None:
        # a no-grad forward (the one-time head check) saves nothing and does not end the region
        if torch.is_grad_enabled():
            self.off._on = False

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)
        self.off._on = False
        self.off._live = {}  # the packed tuples hold their copies; the map is this forward's only
        if self.handle is not None:
            self.handle.remove()
