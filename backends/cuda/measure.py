"""torch's CPU memory, measured from outside the allocator, where no allocator counter exists.

Two figures the chunked-loss benchmark and its tests read the same way:
- ``SavedBytes``: the bytes of the non-parameter storages autograd keeps for backward, live
  (saved-tensor hooks; a storage leaves the count when its last saved tensor is dropped);
- ``profiled_peak``: the highest running sum of the profiler's allocation records ("[memory]"
  events: + for an allocation, - for a free, in time order) during a ``torch.profiler.profile``
  with ``profile_memory=True``, above what was live when it started.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class SavedBytes:
    """Use ``with saved.hooks():`` around a forward; ``saved.bytes`` is what autograd keeps."""

    def __init__(self, model: torch.nn.Module):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._kept: dict[int, int] = {}  # storage address: bytes, while a saved tensor refers to it

    def _pack(self, t: torch.Tensor) -> Any:
        box, key = _Saved(t), t.untyped_storage().data_ptr()
        if key not in self._params:
            self._kept[key] = t.untyped_storage().nbytes()
            weakref.finalize(box, self._kept.pop, key, None)
        return box

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda box: box.t)

    @property
    def bytes(self) -> int:
        return sum(self._kept.values())


class _Saved:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def profiled_peak(prof: Any) -> int:
    """Peak bytes allocated during ``prof`` above the start, from its allocation records."""
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak
