"""What the cuda runtime writes and reads back: the adapter (or the full model with its base's
tokenizer files), and a checkpoint's trainable weights, optimizer state and RNG (one process's,
or under FSDP every rank's shards through torch.distributed.checkpoint). A mixin of
``CudaBackend``, which sets the model, optimizer and ranks these save.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from finetune.backends.base import Comm

from finetune.errors import UserError
from finetune.model.source import TOKENIZER_FILES
from finetune.spec import RunSpec


class CudaFiles:
    """The adapter and checkpoints of the cuda runtime (Backend's save_adapter, save_state,
    load_state, rank_state)."""

    model: Any
    hf: Any
    optimizer: Any
    scaler: torch.amp.GradScaler | None
    comm: Comm
    sharded: bool
    spec: RunSpec | None
    model_dir: Path | None

    # ---- files -------------------------------------------------------------------------
    def save_adapter(self, path: Path | None) -> None:
        """PEFT adapter (safetensors) for lora/dora/qlora; for full, the HF model plus the base
        model's tokenizer files. Under fsdp every rank calls this (the trainable weights are
        gathered from the shards, a collective) and rank 0, whose ``path`` is set, writes.

        Only the trainable weights are gathered (``ignore_frozen_params``): the adapter is all
        PEFT writes, and gathering the frozen base too put the whole model on rank 0's host to
        write a few MiB (449 MiB of RSS growth for the save of a 418 MiB model, measured in
        benchmarks/results/fsdp_sharded_load_cpu.txt section 4). method=full trains every
        weight, so it still gathers them all."""
        state = None
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                          ignore_frozen_params=True))
        if path is None:
            return
        path = Path(path)
        spec, src = self.spec, self.model_dir
        assert spec is not None and src is not None, "save_adapter runs after setup()"
        if spec.method.name == "full":
            self.hf.save_pretrained(str(path), state_dict=state)
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, path / name)
        else:
            # adapter_config.json + adapter_model.safetensors (PEFT keeps the adapter keys of state)
            self.model.save_pretrained(str(path), state_dict=state)

    def rank_state(self) -> dict[str, Any]:
        """This rank's RNG (every rank's goes into rank 0's checkpoint, for an exact resume)."""
        return {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}

    def save_state(self, path: Path, rank_states: list[dict[str, Any]] | None = None) -> None:
        """trainable.safetensors (requires_grad params by name), optimizer.pt, rng.pt (torch
        CPU/CUDA RNG, each rank's under several, and the GradScaler). Under fsdp every rank
        writes its shards of the trainable weights and optimizer state into ``path``/dcp with
        torch.distributed.checkpoint (a collective); rank 0 writes rng.pt."""
        from safetensors.torch import save_file

        path = Path(path)
        if self.sharded:
            import torch.distributed.checkpoint as dcp

            dcp.save(self._sharded_state(), checkpoint_id=str(path / "dcp"))
        else:
            weights = {n: p.detach().cpu().contiguous()
                       for n, p in self.model.named_parameters() if p.requires_grad}
            save_file(weights, str(path / "trainable.safetensors"))
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        if self.comm.rank == 0:
            torch.save({**self.rank_state(), "ranks": rank_states,
                        "scaler": self.scaler.state_dict() if self.scaler else None}, path / "rng.pt")

    def _sharded_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        model = {k: v for k, v in get_model_state_dict(self.model).items() if k in trainable}
        return {"model": model, "optim": get_optimizer_state_dict(self.model, self.optimizer)}

    def load_state(self, path: Path) -> None:
        """Restore save_state's files after setup() with the same config."""
        from safetensors.torch import load_file

        path = Path(path)
        if self.sharded:
            self._load_sharded(path)
            return
        saved = load_file(str(path / "trainable.safetensors"))
        params = dict(self.model.named_parameters())
        missing = sorted(n for n, p in params.items() if p.requires_grad and n not in saved)
        if missing or set(saved) - set(params):
            example = (missing or sorted(set(saved) - set(params)))[0]
            raise UserError(f"checkpoint {path} does not match this model/method (e.g. {example})")
        with torch.no_grad():
            for n, t in saved.items():
                params[n].copy_(t)
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        if getattr(self.optimizer, "is_paged", False):
            self._repage_optimizer_state()
        self._load_rng(path)

    def _load_sharded(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if not (path / "dcp").is_dir():
            raise UserError(f"checkpoint {path} was not saved sharded (backend.strategy=fsdp); resume it with the "
                            "strategy it was trained with")
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self._load_rng(path)

    def _load_rng(self, path: Path) -> None:
        rng = torch.load(path / "rng.pt", weights_only=True)
        mine = rng
        if self.comm.world_size > 1 and rng.get("ranks") and len(rng["ranks"]) == self.comm.world_size:
            mine = rng["ranks"][self.comm.rank]
        torch.set_rng_state(mine["cpu"])
        if mine["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(mine["cuda"])
        if self.scaler and rng["scaler"]:
            self.scaler.load_state_dict(rng["scaler"])

    def _repage_optimizer_state(self) -> None:
        # bitsandbytes' load_state_dict puts the state in ordinary device tensors; move it back
        # into paged (unified) buffers so a resumed run uses the memory a fresh one does.
        for p, st in self.optimizer.state.items():
            for key in ("state1", "state2"):
                if torch.is_tensor(st.get(key)) and not getattr(st[key], "is_paged", False):
                    buf = self.optimizer.get_state_buffer(p, dtype=st[key].dtype)
                    buf.copy_(st[key])
                    st[key] = buf
