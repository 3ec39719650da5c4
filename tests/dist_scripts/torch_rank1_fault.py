"""A cuda-backend run under torchrun with a fault on rank 1 alone, run by tests/test_dist_torch.py:

- FAULT=oom: rank 1's model raises torch's real OutOfMemoryError for micro-batches above one
  row from optimizer step 2 on (the backend's own handling turns it into OutOfMemory, as on
  a GPU);
- FAULT=sigterm: rank 1 sends itself SIGTERM during optimizer step 2 (a scheduler preempting
  one node's process).

    FAULT=oom torchrun --standalone --nproc-per-node 2 tests/dist_scripts/torch_rank1_fault.py OVERRIDES...
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from finetune.run import loop
from finetune.backends.cuda.runtime import CudaBackend


class FaultOnRankOne(CudaBackend):
    steps_done = 0
    signalled = False

    def setup(self, spec, model_dir):
        info = super().setup(spec, model_dir)

        def pre_hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if int(os.environ["RANK"]) != 1 or self.steps_done < 1:
                return
            if os.environ["FAULT"] == "oom" and ids.shape[0] > 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (test, rank 1)")
            if os.environ["FAULT"] == "sigterm" and self.steps_done == 1 and not self.signalled:
                self.signalled = True
                os.kill(os.getpid(), signal.SIGTERM)

        self.model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return info

    def optimizer_step(self, lr):
        self.steps_done += 1
        return super().optimizer_step(lr)


if __name__ == "__main__":
    loop.get_backend = lambda name: FaultOnRankOne()
    from finetune.cli import main

    sys.argv = ["finetune", *sys.argv[1:]]
    main()
