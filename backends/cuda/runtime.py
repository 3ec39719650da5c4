"""The ``cuda`` backend: torch + transformers + PEFT + bitsandbytes, on CUDA or on the CPU.

One class, ``CudaBackend``, behind the Protocol in ``backends.base``. Without a GPU it runs the
same code on the CPU (bitsandbytes 0.50 has CPU kernels for NF4 and the 8-bit optimizers), so
every path here is exercised by the CPU test suite; only allocator figures need CUDA.

Choices worth knowing:
- precision: ``32-true`` fp32 weights and math; ``bf16-mixed`` fp32 weights, forward under
  ``torch.autocast(bfloat16)``; ``bf16-true`` bf16 weights (LoRA adapters too, and so the
  optimizer state of ``torch.optim`` optimizers); ``16-mixed`` fp32 weights, fp16 autocast and a
  ``torch.amp.GradScaler`` (on CPU as well, where torch supports fp16 autocast). The loss is
  always computed in fp32 from upcast logits.
- qlora does not call ``peft.prepare_model_for_kbit_training``: it would upcast every
  non-4-bit weight (embeddings, norms, lm_head) to fp32 and switch gradient checkpointing on,
  silently overriding ``precision`` and ``train.grad_checkpointing`` (and the memory the
  planner predicted). Non-reentrant checkpointing needs none of its input-grad hooks.
- OOM: a ``torch.OutOfMemoryError`` anywhere in forward/backward drops every gradient of the
  optimizer step so far (torch cannot undo one micro-batch's share), frees what it can and
  raises ``OutOfMemory``; the loop then redoes the whole optimizer step.

The backend's jobs, a module each: this one sets the model up (named stages) and runs its steps;
``load`` holds what setup loads with (device, checks, 4-bit, adapters, packed attention),
``optimizers`` the optimizers, ``loss`` the loss (chunked, compiled), ``files`` the adapter and
checkpoints, ``readings`` the memory the accountant and governor read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from finetune.backends.base import Batch, Comm, ModelInfo, OutOfMemory, PhaseHook
from finetune.backends.cuda import host_offload
from finetune.backends.cuda.files import CudaFiles
from finetune.backends.cuda.load import (
    add_adapters,
    bnb_config,
    check_loadable,
    dtype_name,
    logical_numel,
    measure_cuda_contexts,
    packed_attention,
    resolve_device,
    set_alloc_conf,
)
from finetune.backends.cuda.loss import compile_loss, is_compile_failure
from finetune.backends.cuda.memory import FSDP_OPTIMIZERS
from finetune.backends.cuda.optimizers import build_optimizer
from finetune.backends.cuda.preference import CudaPreference
from finetune.backends.cuda.readings import CudaReadings

from finetune import precision as precision_mod
from finetune.accounting.probes import HostHeapTrim, lean_host_heap
from finetune.errors import UserError
from finetune.model.source import load_causal_lm
from finetune.planner.setup import attention, model_handle
from finetune.prompting import Prompt
from finetune.spec import RunSpec

log = logging.getLogger("finetune")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CudaBackend(CudaFiles, CudaReadings, CudaPreference):
    """torch/transformers/PEFT/bitsandbytes backend; see the module docstring. Its files (the
    adapter, checkpoints) are ``CudaFiles``' (files.py), its memory readings ``CudaReadings``'
    (readings.py), its preference steps ``CudaPreference``'s (preference.py)."""

    name = "cuda"

    def __init__(self) -> None:
        # Set by setup(); Any to the type checker: torch types an nn.Module's attributes as
        # Tensor | Module (save_pretrained, gradient_checkpointing_enable would not type), and
        # bitsandbytes' optimizers add get_state_buffer to torch's Optimizer.
        self.model: Any = None  # what forward runs (a PeftModel for adapters)
        self.hf: Any = None  # the transformers model inside it
        self.optimizer: Any = None
        self.scaler: torch.amp.GradScaler | None = None
        self.device = torch.device("cpu")  # where inputs go (the embedding's device)
        self.autocast_dtype: torch.dtype | None = None
        self.grad_checkpointing = False
        self.spec: RunSpec | None = None  # the run, set by setup()
        self.model_dir: Path | None = None
        self._contexts: dict[int, int | None] = {}  # CUDA context bytes per device, at setup
        self._totals: dict[int, int] | None = None  # device memory per CUDA index, read once
        self.comm: Comm = Comm()  # the ranks of the run (one process unless a launcher started several)
        self.strategy: str | None = None  # "ddp" | "fsdp" under several ranks, else None
        self.sharded = False  # fsdp: every rank saves its shards into one checkpoint directory
        self._loss_chunk = 0  # train.loss_chunk: target tokens per chunk of head + loss (0: whole)
        self._head_said = False  # the head's fallback to every position is said once
        self._max_norm: float | None = None  # optim.max_grad_norm (None: no clipping)
        # Rows are right-padded, and in a causal model a real token never attends to a later
        # position, so a padding mask changes no real token's output: the pads' own outputs
        # carry loss weight 0 and send no gradient back. Without it transformers builds no
        # [B, 1, T, T] mask and sdpa takes its causal kernel (FlashAttention on a GPU; 4% less
        # step time on this CPU), as mlx-lm's models always do. Kept for remote-code models,
        # whose attention we have not read.
        self._padding_mask = False
        self._compiled_loss: Callable | None = None  # train.compile: token_loss_sum through torch.compile
        self._offload: Any = None  # train.activation_offload: offload.ActivationOffload, else None
        self._slots: list[Any] = []  # fsdp's sharded load: the weights _distribute fills (sharded_load.Slot)
        # the C heap's free pages handed back after an optimizer step that left them (set by
        # setup where the step's buffers are host memory, see optimizer_step), else None
        self.host_trim: HostHeapTrim | None = None

    # ---- several processes -------------------------------------------------------------
    def connect(self, spec: RunSpec) -> Comm:
        """Join torchrun's (or accelerate's, or SLURM's) process group when one launched us:
        nccl on GPUs, gloo on the CPU (backend.device=cpu or no GPU visible)."""
        from finetune.backends.cuda import distributed

        set_alloc_conf(spec.backend.alloc_conf)
        world = distributed.launched_world()
        if world is None:
            if spec.backend.cpu_offload:  # FSDP2 over a group of this process alone (the resolver asked for fsdp)
                use_cuda = torch.cuda.is_available() and spec.backend.device != "cpu"
                self.comm = distributed.TorchComm(0, 1, 0, use_cuda, alone=True)
                self.strategy, self.sharded = "fsdp", True
            return self.comm
        rank, size, local_rank = world
        b = spec.backend
        use_cuda = torch.cuda.is_available() and b.device != "cpu"
        if use_cuda and local_rank >= torch.cuda.device_count():
            if torch.cuda.device_count() != 1:
                raise UserError(f"rank {rank} has LOCAL_RANK={local_rank} but this node sees "
                                f"{torch.cuda.device_count()} GPU(s); launch at most that many processes per node "
                                "(--nproc-per-node, --ntasks-per-node)")
            local_rank = 0  # SLURM bound one GPU to this task (--gpus-per-task=1): it is cuda:0 here
        if b.strategy == "fsdp" and b.device_map == "auto":
            raise UserError("backend.strategy=fsdp shards the model over the ranks; drop backend.device_map=auto "
                            "(it splits one process's model over GPUs)")
        self.comm = distributed.TorchComm(rank, size, local_rank, use_cuda)
        self.strategy = b.strategy
        self.sharded = self.strategy == "fsdp"
        return self.comm

    # ---- setup -------------------------------------------------------------------------
    def setup(self, spec: RunSpec, model_dir: Path) -> ModelInfo:
        """Load ``model_dir`` with transformers, apply method/precision/checkpointing, build the
        optimizer. ``spec`` is resolved and checked (finetune.resolver): the method, optimizer
        and precision are ones this backend runs. Raises UserError for what it cannot run here.

        The stages, in order (each refuses what it cannot run before the next one starts)."""
        self._remember(spec, model_dir)
        device = self._place(spec, model_dir)
        torch.manual_seed(spec.train.seed)  # adapter init (LoRA A) and dropout are reproducible
        self._load(spec, model_dir, device)
        if spec.train.packing:
            self.packed_attention = packed_attention(self.hf, self.device)
            log.info("packed rows: %s", self.packed_attention)
        self._adapt(spec)
        self.model.train()  # dropout on; transformers checkpoints only in training mode
        self.set_grad_checkpointing(spec.train.grad_checkpointing)
        if self.comm.world_size > 1 or self.sharded:
            self._distribute(spec)
        self.set_activation_offload(spec.train.activation_offload)  # on the device the model computes on
        self._setup_loss(spec)
        trainable = self._setup_optimizer(spec)
        self.host_trim = HostHeapTrim() if self.device.type == "cpu" or spec.backend.cpu_offload else None
        return self._model_info(spec, model_dir, trainable)

    def _remember(self, spec: RunSpec, model_dir: Path) -> None:
        """The run and what the step reads at every call (clipping, the padding mask)."""
        if spec.backend.resolved != self.name:  # the resolver checked its choices against that backend
            raise ValueError(f"a spec resolved for backend={spec.backend.resolved} was handed to backend={self.name}")
        self.spec, self.model_dir = spec, Path(model_dir)
        self.handle = model_handle(spec, model_dir)  # the run's model, described once (RunSpec.model_handle)
        mn = spec.optim.max_grad_norm
        self._max_norm = None if mn is None else float(mn)  # read once, not every step
        self._padding_mask = spec.model.trust_remote_code

    def _place(self, spec: RunSpec, model_dir: Path) -> torch.device:
        """Dtypes (the ones the planner priced, finetune/precision.py) and the device; on a GPU
        the CUDA context is measured before anything else touches CUDA in this process."""
        prec = spec.precision.name
        self.dtypes = precision_mod.resolve("cuda", prec, spec.method.name, self.handle.stored_dtype[0])
        device = resolve_device(spec.backend.device, self.comm.local_rank)
        if device.type == "cuda":  # before anything else touches CUDA in this process
            split_later = spec.backend.device_map == "auto"
            self._contexts = measure_cuda_contexts(list(range(torch.cuda.device_count())) if split_later
                                                    else [device.index or 0])
        self.weight_dtype = _TORCH_DTYPES[self.dtypes.weights]
        self.autocast_dtype = _TORCH_DTYPES[self.dtypes.autocast] if self.dtypes.autocast else None
        self._check_precision("bf16-true" if prec == "auto" and self.dtypes.weights == "bfloat16" else prec, device)
        return device

    def _load(self, spec: RunSpec, model_dir: Path, device: torch.device) -> None:
        """The base model through ``from_pretrained`` on ``device`` (or split over the GPUs),
        4-bit quantized there for qlora; a multimodal checkpoint's language model alone."""
        m = spec.method
        check_loadable(spec, model_dir, self.handle.quantization)
        self.desc = self.handle.desc
        wanted = spec.backend.attn_implementation
        attention(self.desc, wanted)  # refuses, in one line, an attention this model does not run
        kwargs: dict[str, Any] = {"dtype": self.weight_dtype,
                                  # auto: transformers' own choice for the model
                                  "attn_implementation": None if wanted == "auto" else wanted,
                                  # the repository's own Python runs only when the user said so
                                  "trust_remote_code": spec.model.trust_remote_code,
                                  # pickle weights run code when loaded (model.allow_pickle)
                                  "use_safetensors": None if spec.model.allow_pickle else True}
        # device_map=auto splits layers over every visible GPU; on CPU there is nothing to split.
        split = spec.backend.device_map == "auto" and device.type == "cuda"
        # fsdp with qlora or backend.cpu_offload: loaded (and quantized) in host memory, where
        # cpu_offload keeps the shards; fully_shard takes one unit at a time through the GPU, so no
        # GPU ever holds the whole model (backends/cuda/host_offload.py loads_on_host)
        on_host = self.sharded and (spec.backend.cpu_offload or m.name == "qlora")
        kwargs["device_map"] = "auto" if split else {"": "cpu" if on_host else str(device)}
        if m.name == "qlora":
            # fsdp: the packed bytes viewed as the dtype FSDP gathers in (its MixedPrecisionPolicy
            # param_dtype, else the weights'), so its cast to param_dtype leaves them as they are
            storage = (self.autocast_dtype or self.weight_dtype) if self.sharded else None
            kwargs["quantization_config"] = bnb_config(m, self.autocast_dtype or self.weight_dtype, storage)

        hf = self._skeleton(spec, model_dir, kwargs) if self.sharded else None
        try:
            with lean_host_heap():  # the load's host peak is what is live (the plan's figure)
                if hf is None:  # a multimodal checkpoint: its language model alone
                    hf = load_causal_lm(model_dir, **kwargs)
        except (RuntimeError, NotImplementedError, ImportError) as e:
            if m.name != "qlora":
                raise
            raise UserError(f"method=qlora: bitsandbytes 4-bit cannot run here ({e}); "
                            "use method=lora") from e
        self.hf = hf
        self.device = hf.get_input_embeddings().weight.device
        if m.name == "qlora":
            # bitsandbytes 0.50 repacks 4-bit weights for its CPU inference kernel the first
            # time an eval-mode forward runs (Linear4bit.forward, support_avx512bf16_for_cpu);
            # the next training forward then adds the bias in place on a view and autograd
            # refuses. Keep the training layout for the whole run.
            for mod in hf.modules():
                if hasattr(mod, "support_avx512bf16_for_cpu"):
                    mod.support_avx512bf16_for_cpu = False

    def _skeleton(self, spec: RunSpec, model_dir: Path, kwargs: dict[str, Any]) -> Any:
        """fsdp: the model with no weights, for ``_distribute`` to shard and fill one checkpoint
        tensor at a time (backends/cuda/sharded_load.py); None where that load does not apply
        (said why), and the whole model loads on every rank instead."""
        from finetune.backends.cuda import sharded_load

        why = host_offload.sharded_load_refusal(self.desc.experts, self.handle.config, spec.model.trust_remote_code,
                                                spec.train.packing)
        if why is None:
            try:
                config = sharded_load.config_of(model_dir, spec.model.trust_remote_code)
                hf, self._slots = sharded_load.skeleton(
                    model_dir, config, kwargs["dtype"], kwargs["attn_implementation"],
                    kwargs.get("quantization_config"), cast(Any, self.comm).device)
                stacked = sum(1 for s in self._slots if s.experts is not None)
                log.info("fsdp: each rank loads only its shard (%d checkpoint weights by their rows, %d stacked expert "
                         "weights from its own experts' tensors)", len(self._slots) - stacked, stacked)
                return hf
            except sharded_load.Refused as e:
                why = str(e)
        log.info("fsdp: every rank loads the whole model, then shards it (%s)", why)
        return None

    def _adapt(self, spec: RunSpec) -> None:
        """method=full trains every weight; the others wrap the model in PEFT adapters."""
        m = spec.method
        if m.name == "full":
            self.hf.requires_grad_(True)
            self.model = self.hf
        else:
            self.model = add_adapters(self.hf, m, spec.precision.name, self.desc)

    def _setup_loss(self, spec: RunSpec) -> None:
        """train.loss_chunk (refused under FSDP shards) and train.compile's compiled loss."""
        self._loss_chunk = spec.train.loss_chunk
        if self._loss_chunk and self.sharded:
            raise UserError("train.loss_chunk calls the output head outside FSDP's forward, where its weights are "
                            "still sharded; use train.loss_chunk=0 with backend.strategy=fsdp (or strategy=ddp)")
        if spec.train.compile:
            self._compiled_loss = compile_loss(self.device, self._loss_chunk, self.strategy)

    def _setup_optimizer(self, spec: RunSpec) -> list[torch.nn.Parameter]:
        """The optimizer over the trainable parameters (returned), and fp16's grad scaler."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(spec.optim, trainable)
        if self.autocast_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(self.device.type)
        return trainable

    def _model_info(self, spec: RunSpec, model_dir: Path, trainable: list[torch.nn.Parameter]) -> ModelInfo:
        m, prec = spec.method, spec.precision.name
        devices = sorted({str(p.device) for p in self.model.parameters()})
        return ModelInfo(
            params_total=sum(logical_numel(p) for p in self.model.parameters()),
            params_trainable=sum(p.numel() for p in trainable),
            device=str(self.device),
            dtype=m.quant.type if m.name == "qlora" else dtype_name(self.weight_dtype),
            model_path=str(Path(model_dir).resolve()),
            extra={"devices": devices, "precision": prec, "dtypes": self.dtypes.__dict__,
                   "optimizer": type(self.optimizer).__name__,
                   "autocast": dtype_name(self.autocast_dtype) if self.autocast_dtype else None,
                   "grad_scaler": self.scaler is not None,
                   "grad_checkpointing": self.grad_checkpointing},
        )

    def _distribute(self, spec: RunSpec) -> None:
        """Several ranks: equal trainable weights everywhere (ddp), or FSDP2 shards (fsdp);
        then each rank its own dropout stream (seed + rank)."""
        from finetune.backends.cuda import distributed

        if self.strategy == "fsdp":
            if spec.optim.name not in FSDP_OPTIMIZERS:
                raise UserError(f"optim={spec.optim.name} cannot update FSDP's sharded (DTensor) parameters; use "
                                "optim=adamw (or adam, sgd) with backend.strategy=fsdp, or backend.strategy=ddp")
            autocast = self.autocast_dtype
            comm = cast(distributed.TorchComm, self.comm)  # strategy=fsdp over ranks: connect() made a TorchComm
            if self._slots:
                from finetune.backends.cuda import sharded_load

                sharded_load.to_meta(self._slots)
            self.units = distributed.shard_model(self.model, self.hf, comm, param_dtype=autocast,
                                                 reduce_dtype=torch.float32 if autocast is not None else None,
                                                 cpu_offload=spec.backend.cpu_offload)
            if self._slots:  # each rank reads its rows of the checkpoint (backends/cuda/sharded_load.py)
                with lean_host_heap():
                    sharded_load.fill(self._slots, comm.rank, comm.world_size, self.weight_dtype, comm.device,
                                      torch.device("cpu") if spec.backend.cpu_offload else comm.device)
                self._slots = []
            self.device = comm.device
        else:
            distributed.broadcast_parameters([p for p in self.model.parameters() if p.requires_grad])
        torch.manual_seed(spec.train.seed * 1_000_003 + self.comm.rank)

    @staticmethod
    def _check_precision(prec: str, device: torch.device) -> None:
        if "bf16" in prec and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError(f"precision={prec}: this GPU has no bfloat16; "
                            "use precision=16-mixed or 32-true")
        if prec == "16-mixed" and device.type == "cpu":
            try:  # torch's CPU autocast gained fp16 late; probe rather than guess
                with torch.autocast("cpu", dtype=torch.float16):
                    torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2))
            except (RuntimeError, TypeError) as e:
                raise UserError("precision=16-mixed needs fp16 autocast, which this torch lacks "
                                "on CPU; use precision=bf16-mixed") from e


    def set_grad_checkpointing(self, enabled: bool) -> None:
        """Turn activation recomputation (non-reentrant) on or off for the following steps."""
        hf = self.hf
        if enabled:
            kw = {"use_reentrant": False}
            if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.x name
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        elif self.grad_checkpointing:
            if hasattr(hf, "activation_checkpointing_disable"):
                hf.activation_checkpointing_disable()
            else:
                hf.gradient_checkpointing_disable()
        self.grad_checkpointing = enabled

    def set_activation_offload(self, enabled: bool) -> str | None:
        """Move what the model's body saves for backward to host memory in the following steps
        (backends/cuda/offload.py), or stop. None: applied."""
        from finetune.backends.cuda.offload import ActivationOffload

        self._offload = ActivationOffload(self.model, self.device) if enabled else None
        return None

    def offloaded_bytes(self) -> int | None:
        """Bytes the activation offload moved (to the host and back) since the last call; None: off."""
        return None if self._offload is None else self._offload.take_moved()

    def set_loss_chunk(self, tokens: int) -> str | None:
        """The governor's lever: the following steps compute head + loss ``tokens`` target
        tokens at a time. None when applied, else why not (the loss is left as it was)."""
        from finetune.backends.cuda.loss import UnsupportedModel, check_chunkable

        if tokens <= 0:
            self._loss_chunk = 0
            return None
        if self.sharded:
            return "under backend.strategy=fsdp the output head's weights are shards outside FSDP's forward"
        if self._compiled_loss is not None:
            return "train.compile traced the whole-logits loss"
        try:
            check_chunkable(self.model, self.device, self._autocast)
        except UnsupportedModel as e:
            return str(e)
        except torch.OutOfMemoryError:
            self.release_cache()
            return "no memory was left to check the model's head on 8 tokens"
        self._loss_chunk = int(tokens)
        return None

    # ---- steps -------------------------------------------------------------------------
    def _autocast(self) -> Any:
        on = self.autocast_dtype is not None
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=on)

    def _to_device(self, array: np.ndarray, dtype: type) -> torch.Tensor:
        """``array`` as a tensor on the input device. A copy from pageable host memory
        (``.to(device)``) synchronizes the stream first (torch's memcpy_and_sync): the CPU would
        wait for every kernel queued so far, three times per micro-batch. From pinned memory
        with non_blocking it queues behind them instead; the caching host allocator keeps the
        pinned buffer until the copy has run."""
        t = torch.from_numpy(np.asarray(array, dtype=dtype))
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _loss_sum(self, batch: Batch, compiled: bool = True) -> torch.Tensor:
        """Sum of fp32 token cross-entropy over target positions (mask[:, 1:]), through the
        torch.compile'd loss under train.compile unless ``compiled`` is False (evaluation: its
        no-grad, eval-mode graph would be one more compilation for a few batches)."""
        ids = self._to_device(batch.input_ids, np.int64)
        attn = positions = None
        if batch.position_ids is not None:  # packed: transformers masks each sample from its positions
            positions = self._to_device(batch.position_ids, np.int64)
        elif self._padding_mask:
            lengths = self._to_device(batch.lengths, np.int64)
            attn = (torch.arange(ids.shape[1], device=self.device)[None, :] < lengths[:, None]).long()
        from finetune.backends.cuda.loss import UnsupportedModel, head_fallback, token_loss_sum

        use_compiled = compiled and self._compiled_loss is not None
        # the head on target rows only (backends/cuda/loss.py), except in the compiled loss
        # (its rows would be a data-dependent shape) and under FSDP (the head's weights are
        # sharded outside the model's forward)
        target_head = not use_compiled and not self.sharded
        # the target rows are picked from the mask on the host (no device read); the
        # whole-logits loss multiplies on the device: sent now, its copy is no sync later
        mask = (torch.from_numpy(np.asarray(batch.loss_mask, dtype=np.float32)) if self._loss_chunk or target_head
                else self._to_device(batch.loss_mask, np.float32))
        loss_fn = self._compiled_loss if use_compiled and self._compiled_loss is not None else token_loss_sum
        try:
            # train.loss_chunk > 0: the head and cross-entropy a chunk of tokens at a time, so
            # the [B, T, V] logits never exist (backends/cuda/loss.py); 0: the target rows' at once
            loss = loss_fn(self.model, ids, attn, mask, self._loss_chunk, self._autocast, position_ids=positions,
                           target_head=target_head)
        except UnsupportedModel as e:  # a model the chunked loss cannot reproduce: say so once
            raise UserError(str(e)) from None
        if target_head and not self._head_said and head_fallback(self.model):
            self._head_said = True
            log.info("the output head runs on every position, not only targets: %s", head_fallback(self.model))
        return loss

    def forward_backward(self, batch: Batch, loss_scale: float,
                         on_phase: PhaseHook | None = None) -> float:
        """Accumulate grads of ``loss_sum * loss_scale``; return loss_sum.

        Raises:
            OutOfMemory: on torch.OutOfMemoryError. Every gradient accumulated since the last
                optimizer_step is dropped (set to None) with it: redo the whole step.
        """
        try:
            if self._offload is not None:
                from finetune.backends.cuda.loss import output_head

                with self._offload.forward(output_head(self.model)):
                    loss_sum = self._loss_sum(batch)
            else:
                loss_sum = self._loss_sum(batch)
            if on_phase:
                on_phase("forward")
            scaled = loss_sum * loss_scale
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            value = float(loss_sum.detach())
        except torch.cuda.OutOfMemoryError as e:  # alias of torch.OutOfMemoryError (any device)
            # Leave the except block before freeing: the traceback pins the activations.
            message = str(e).splitlines()[0] if str(e) else "out of memory"
        except Exception as e:  # inductor builds the forward here and may build the backward lazily
            if self._compiled_loss is None or not is_compile_failure(e):
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"train.compile: torch.compile could not build the step here ({type(e).__name__}: "
                            f"{first[:200]}); set train.compile=false") from None
        else:
            if on_phase:
                on_phase("backward")
            return value
        loss_sum = scaled = None  # drop our references to the graph
        self.zero_grad()
        self.release_cache()
        raise OutOfMemory(f"torch.OutOfMemoryError in forward/backward: {message}")

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (set to None, freeing their memory)."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, lr: float) -> float | None:
        """Set ``lr`` on every group, clip to optim.max_grad_norm (unless null), step, zero the
        grads. Returns the pre-clip global grad norm (unscaled under 16-mixed)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.strategy == "ddp":  # fsdp reduce-scattered them in backward already
            from finetune.backends.cuda.distributed import sum_gradients

            sum_gradients([p for g in self.optimizer.param_groups for p in g["params"]])
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip and report the true (unscaled) norm
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        max_norm = self._max_norm
        if not params:
            norm = None
        elif max_norm is None:
            norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))  # measures, scales by 1
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)  # skipped when the fp16 grads overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        self.zero_grad()
        if self.host_trim is not None:
            # On the CPU (or with the optimizer on the host, cpu_offload) the step's activations,
            # gathered weights and gradients were host memory, and glibc keeps the freed pages
            # mapped: without this the RSS after a step was 485 / 413 MiB above the load on the
            # 110M Qwen2 of benchmarks/results/fsdp_sharded_load_cpu.txt where 224 MiB is live
            # (its cost: section 4 there, benchmarks/host_trim_cost.py)
            self.host_trim.after_step()
        if norm is not None and hasattr(norm, "full_tensor"):  # fsdp: a DTensor over the shards
            norm = norm.full_tensor()
        return None if norm is None else float(norm)

    def eval_loss(self, batch: Batch) -> float:
        """Loss sum of ``batch`` in eval mode (no dropout), without gradients."""
        self.model.eval()  # no dropout
        try:
            with torch.no_grad():
                return float(self._loss_sum(batch, compiled=False))
        finally:
            self.model.train()


    def generate(self, model_dir: Path, adapter: Path | None, prompt: Prompt, max_new_tokens: int, temperature: float,
                 seed: int, trust_remote_code: bool = False, allow_pickle: bool = False) -> str:
        """``mode=generate`` with the library's own generation (backends/cuda/generate.py)."""
        from finetune.backends.cuda.generate import generate

        return generate(model_dir, adapter, prompt, max_new_tokens, temperature, seed,
                        trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)

    def eval_model(self, model_dir: Path, adapter: Path | None, batch_size: int, trust_remote_code: bool = False,
                   allow_pickle: bool = False) -> Any:
        """``mode=eval``: an lm-eval model (``lm_eval.api.model.LM``) on the base plus the adapter."""
        from finetune.backends.cuda.evaluate import eval_model

        return eval_model(model_dir, adapter, batch_size, trust_remote_code=trust_remote_code,
                          allow_pickle=allow_pickle)


BACKEND = CudaBackend  # what finetune.backends.runtimes.get_backend instantiates
