"""A cuda-backend run under torchrun that writes what each rank held, run by
tests/test_fsdp_qlora.py: the run's summary.json carries rank 0's census only, so every rank
writes its own to RANK_MEMORY_DIR/rank{R}.json, with its RSS (``/proc/self/statm``) just before
the model loads, its high-water mark over the setup (the load and fully_shard), and after its
last optimizer step (the growth the plan's host figure is compared with), and its high-water
mark over the adapter's save (``rss_before_save``, ``peak_rss_save``).

    RANK_MEMORY_DIR=DIR torchrun --standalone --nproc-per-node 2 tests/dist_scripts/torch_rank_memory.py OVERRIDES...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from finetune.run import loop
from finetune.backends.cuda.runtime import CudaBackend


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """The kernel's RSS high-water mark (VmHWM) set back to the current RSS (proc(5), clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


class RankMemory(CudaBackend):
    record: dict = {}

    def setup(self, spec, model_dir):
        # what the load would import lazily, imported first: the growth is the run's memory
        import bitsandbytes  # noqa: F401
        import peft  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import transformers
        import transformers.integrations.bitsandbytes  # noqa: F401

        arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
        getattr(transformers, arch)
        # cpu_offload as this rank's setup got it (the governor's lever, planned before loading)
        self.record = {"rss_before_load": rss_bytes(), "cpu_offload": spec.backend.cpu_offload}
        reset_peak_rss()
        info = super().setup(spec, model_dir)
        # the setup's high-water mark: the load, the adapters, fully_shard and the optimizer built
        self.record["peak_rss_setup"] = peak_rss_bytes()
        return info

    def optimizer_step(self, lr):
        norm = super().optimizer_step(lr)
        # after every step: the last one's is what the file keeps
        self.record.update({"rss_after_step": rss_bytes(), "census": dict(self.census())})
        # and with the C heap's free pages handed back (glibc keeps freed chunks mapped): the
        # part of the growth that is no live tensor's
        from finetune.accounting.probes import _libc

        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)
        self.record["rss_after_step_trimmed"] = rss_bytes()
        self._write()
        return norm

    def save_adapter(self, path):
        # the save's own high-water mark: under fsdp every rank takes part in its gathers
        self.record["rss_before_save"] = rss_bytes()
        reset_peak_rss()
        super().save_adapter(path)
        self.record["peak_rss_save"] = peak_rss_bytes()
        self._write()

    def _write(self):
        out = Path(os.environ["RANK_MEMORY_DIR"]) / f"rank{os.environ['RANK']}.json"
        out.write_text(json.dumps(self.record))


if __name__ == "__main__":
    loop.get_backend = lambda name: RankMemory()
    from finetune.cli import main

    sys.argv = ["finetune", *sys.argv[1:]]
    main()
