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
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from finetune.backends.base import Batch, Comm, ModelInfo, OutOfMemory, PhaseHook
from finetune.backends.cuda.capabilities import CAPABILITIES
from finetune.backends.cuda import varlen
from finetune.backends.cuda.memory import FSDP_OPTIMIZERS, packed_path, resolved_alloc_conf

from finetune.errors import UserError
from finetune import precision as precision_mod
from finetune.accounting.probes import NvmlProbe
from finetune.model_source import TOKENIZER_FILES, load_causal_lm
from finetune.records import CENSUS_KEYS, Census, CensusKey
from finetune.planner.describe import EXPERTS, check_targets, lora_keys
from finetune.planner.model import attention, model_handle
from finetune.spec import MethodSpec, OptimSpec, RunSpec
from finetune.prompting import Prompt

log = logging.getLogger("finetune")

OPTIMIZERS = CAPABILITIES.optimizers
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":  # under a launcher, each rank its own GPU (LOCAL_RANK)
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"backend.device={name} but no CUDA device is visible; "
                        "use backend.device=auto or cpu")
    return dev


def _measure_cuda_contexts(indices: list[int]) -> dict[int, int | None]:
    """Bytes the CUDA context took on each device when this process created it: NVML's used
    memory on the device just before and just after ``torch.cuda.mem_get_info`` (which creates
    the primary context and allocates nothing through torch's allocator).

    None for a device where NVML cannot say, or where torch had already initialized CUDA (a
    context may exist already, so the difference would not be the context). A lower bound:
    kernels loaded later (CUDA lazy module loading) and library handles add to the context
    after this; another process allocating on the device at the same moment would be counted.
    """
    out: dict[int, int | None] = dict.fromkeys(indices)
    if torch.cuda.is_initialized():
        return out

    nvml = NvmlProbe()
    for i in indices:
        before = nvml.read(i, processes=False)["device_used"]
        if before is None:
            continue
        torch.cuda.mem_get_info(i)
        after = nvml.read(i, processes=False)["device_used"]
        if after is not None and after >= before:
            out[i] = after - before - torch.cuda.memory_reserved(i)
    return out


def _check_architecture(model_dir: Path, trust_remote_code: bool) -> None:
    """UserError, naming the fix, for a config.json whose model_type transformers cannot build."""
    import json

    from transformers import CONFIG_MAPPING

    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return  # model_source has already named an unreadable config.json
    if model_type in CONFIG_MAPPING or trust_remote_code:
        return
    raise UserError(f"{model_dir}: architecture model_type={model_type!r} is not one transformers can load; "
                    "upgrade transformers, use a supported model, or set model.trust_remote_code=true if the "
                    "repository ships its own code and you trust it")


def _check_loadable(spec: RunSpec, model_dir: Path, quantization: dict[str, Any] | None) -> None:
    """UserError, naming the fix, for a model this backend cannot train as asked: packing
    under the repository's own modeling code, an MLX-quantized checkpoint (``quantization``:
    the run's model handle's, located at the downloaded directory), an architecture
    transformers cannot build (read from that directory)."""
    if spec.train.packing and spec.model.trust_remote_code:
        raise UserError("train.packing with model.trust_remote_code=true: the model's own code may not keep "
                        "attention within a packed sample (transformers' position_ids path); set "
                        "train.packing=false")
    if quantization:
        raise UserError(f"{model_dir} is MLX-quantized (config.json 'quantization'), which transformers "
                        "cannot load; use backend=mlx, or the unquantized checkpoint with method=qlora")
    _check_architecture(model_dir, spec.model.trust_remote_code)


def _check_packing(hf: Any, device: torch.device, packed_impl: str | None = None) -> None:
    """train.packing, once before training: two short samples side by side in one row, positions
    restarting at the second, must give each sample's own logits, or the model's attention in
    transformers does not keep a packed row's samples apart (its packed-sequence path is per
    family: in transformers 5.24 gpt-oss's leaks). 12 and 10 tokens: past the 8-token sliding
    windows of the test families, so the window's mask is composed with the samples' too. Uses
    its own generator: the run's random state (adapter init, dropout) is untouched. ``packed_impl``:
    the attention implementation the packed row runs through (left set), checked against each
    sample alone through the model's own."""
    g = torch.Generator().manual_seed(0)
    vocab = int(hf.get_input_embeddings().weight.shape[0])
    a, b = (torch.randint(1, vocab, (1, n), generator=g) for n in (12, 10))
    was = hf.training
    hf.eval()
    try:
        with torch.no_grad():
            alone = torch.cat([hf(input_ids=x.to(device), use_cache=False).logits.float() for x in (a, b)], dim=1)
            if packed_impl:  # each sample alone through the model's own attention, the row through packed_impl
                hf.set_attn_implementation(packed_impl)
            pos = torch.cat([torch.arange(12), torch.arange(10)])[None].to(device)
            packed = hf(input_ids=torch.cat([a, b], dim=1).to(device), position_ids=pos,
                        use_cache=False).logits.float()  # a cache turns transformers' packed masking off
    finally:
        hf.train(was)
    scale = max(1.0, float(alone.abs().max()))
    tol = 1e-4 if next(hf.parameters()).dtype == torch.float32 else 3e-2
    diff = float((packed - alone).abs().max())
    if not diff <= tol * scale:
        raise UserError(f"train.packing: {hf.config.model_type}'s attention in transformers does not keep a packed "
                        f"row's samples apart (two samples packed differ from each alone by {diff:.3g} in the "
                        "logits); set train.packing=false")


def _packed_attention(hf: Any, device: torch.device) -> str:
    """train.packing: where the model runs sdpa, its packed rows go through ``varlen`` (each
    sample through sdpa alone: no [T, T] block mask, whose masked sdpa computes every pair of
    the row); checked against each sample alone, and back to transformers' block mask where the
    model's attention does not take it (no ``position_ids`` reach it, soft-capping). Returns the
    path in words; UserError where neither keeps the samples apart."""
    impl = getattr(hf.config, "_attn_implementation", None)
    if impl == "sdpa":
        try:
            _check_packing(hf, device, packed_impl=varlen.register())
            return packed_path(impl)
        except (UserError, varlen.NoPositions, ValueError, TypeError) as e:
            log.debug("packed sdpa per sample refused (%s): transformers' block mask instead", e)
            hf.set_attn_implementation("sdpa")
    _check_packing(hf, device)
    return packed_path(str(impl), per_sample=False)


def _compile_loss(device: torch.device, chunk: int, strategy: str | None) -> Callable:
    """``token_loss_sum`` through ``torch.compile`` (inductor: the model's forward, the fp32
    cross-entropy and, through AOTAutograd, their backward), or UserError naming what is
    missing where inductor cannot build kernels: a C++ compiler on the CPU, Triton on CUDA.
    Shapes vary per micro-batch: torch compiles the first length static, and on the second
    length a dynamic-shape graph that the later ones reuse."""
    import importlib.util
    import sysconfig

    if strategy == "fsdp":
        raise UserError("train.compile is not supported with backend.strategy=fsdp here (FSDP2's hooks around "
                        "a compiled loss are untested); use train.compile=false or backend.strategy=ddp")
    if chunk:
        raise UserError("train.compile with train.loss_chunk > 0 is not supported on backend=cuda (the chunked "
                        "loss picks rows on the host and runs its own autograd function); set one of them off")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise UserError("train.compile on a CUDA device needs Triton (inductor's GPU kernels): "
                        "pip install triton, or set train.compile=false")
    if device.type == "cpu":
        import torch._inductor.config as inductor_config
        from torch._inductor import cpp_builder
        from torch._inductor.exc import InvalidCxxCompiler

        try:
            cpp_builder.get_cpp_compiler()
        except InvalidCxxCompiler:
            raise UserError(f"train.compile on the CPU needs a C++ compiler for inductor's kernels and none of "
                            f"{[c for c in inductor_config.cpp.cxx if c]} was found; install g++ (apt-get install "
                            "g++) or point CXX at one, or set train.compile=false") from None
        include = Path(sysconfig.get_paths()["include"]) / "Python.h"
        if not include.is_file():
            raise UserError(f"train.compile on the CPU builds kernels against Python's headers, and {include} is "
                            "missing; install them (apt-get install python3-dev) or set train.compile=false")
    from finetune.backends.cuda.loss import token_loss_sum

    return torch.compile(token_loss_sum)


def _is_compile_failure(err: Exception) -> bool:
    """Whether ``err`` is torch.compile failing to build (not the step failing to run)."""
    from torch._dynamo.exc import BackendCompilerFailed

    return isinstance(err, BackendCompilerFailed) or type(err).__module__.startswith("torch._inductor")


def _linear_names(model: torch.nn.Module) -> set[str]:
    """The leaf names of a transformers model's linear layers (``nn.Linear`` and its bitsandbytes
    subclasses, GPT-2's ``Conv1D``) but its head: what PEFT's ``target_modules`` can name in its blocks."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    return {name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
            if name and isinstance(mod, (torch.nn.Linear, Conv1D)) and mod is not head}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _logical_numel(p: torch.Tensor) -> int:
    """Elements a parameter stands for: a bitsandbytes Params4bit stores two 4-bit values per
    uint8, so its own numel() is half the weight's; the quant_state keeps the real shape."""
    qs = getattr(p, "quant_state", None)
    if type(p).__name__ == "Params4bit" and qs is not None:
        return int(torch.Size(qs.shape).numel())
    return p.numel()


def _quant_tensors(qs: Any) -> list[torch.Tensor]:
    """Every tensor a bitsandbytes QuantState holds (absmax, code, offset, nested state2)."""
    out = []
    for v in vars(qs).values():
        if torch.is_tensor(v):
            out.append(v)
        elif type(v).__name__ == "QuantState":
            out.extend(_quant_tensors(v))
    return out


def _adafactor(params: list[torch.nn.Parameter], o: OptimSpec) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    # Fixed lr from the loop's schedule; eps = (regularizer of the squared grad, of the scale).
    return Adafactor(params, lr=o.lr, eps=(o.eps, 1e-3), weight_decay=o.weight_decay, scale_parameter=False,
                     relative_step=False, warmup_init=False)


def _bnb(name: str) -> Callable[[list[torch.nn.Parameter], OptimSpec], torch.optim.Optimizer]:
    # Paged optimizers put state >= 1e5 elements in CUDA unified memory; on CPU bitsandbytes
    # warns and falls back to ordinary tensors.
    def make(params: list[torch.nn.Parameter], o: OptimSpec) -> torch.optim.Optimizer:
        import bitsandbytes as bnb

        return getattr(bnb.optim, name)(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)

    return make


def _set_alloc_conf(configured: str | None) -> None:
    """PYTORCH_CUDA_ALLOC_CONF as the plan priced it (backends/cuda/memory.py
    resolved_alloc_conf: backend.alloc_conf, else the environment's, else finetune's default),
    set before the allocator's first CUDA allocation reads it (connect runs before anything
    allocates); where CUDA is already initialized in this process, through torch's own setter
    (later allocations follow it)."""
    conf = resolved_alloc_conf(configured)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(conf)


def _fused(params: list[torch.nn.Parameter], o: OptimSpec) -> dict[str, Any]:
    """``fused=True`` for Adam/AdamW whose parameters are all plain floating tensors on the CPU or
    a CUDA device: one kernel per tensor (CPU: 0.44 -> 0.10 ms per step for the 16 LoRA tensors
    of benchmarks/vs_peers.py's model) and, on CUDA, no workspace: torch's default foreach path
    allocates one more copy of every trainable tensor in its step (``_foreach_sqrt`` of
    exp_avg_sq; +6 GiB at a 3B full fine-tune in bf16), the fused kernel none. HF Trainer's
    default since torch 2.8 is this kernel (adamw_torch_fused) and torchtune's configs set
    fused=True. ``optim.fused=false`` and FSDP's DTensor shards keep torch's default (foreach), as the planner prices
    (backends/cuda/memory.py adam_fused)."""
    ok = o.fused and bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                              and type(p.data) is torch.Tensor for p in params)
    return {"fused": True} if ok else {}


# One constructor per name in CAPABILITIES.optimizers (tests/test_capabilities.py checks both ways)
OPTIMIZER_BUILDERS: dict[str, Callable[[list[torch.nn.Parameter], OptimSpec], torch.optim.Optimizer]] = {
    "adamw": lambda p, o: torch.optim.AdamW(p, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                            **_fused(p, o)),
    "adam": lambda p, o: torch.optim.Adam(p, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                          **_fused(p, o)),
    "sgd": lambda p, o: torch.optim.SGD(p, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay),
    "adafactor": _adafactor,
    "adamw_8bit": _bnb("AdamW8bit"),
    "paged_adamw_8bit": _bnb("PagedAdamW8bit"),
    "paged_adamw": _bnb("PagedAdamW32bit"),
}


def _build_optimizer(o: OptimSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if o.name not in OPTIMIZER_BUILDERS:  # a lookup that misses raises, never falls through
        raise UserError(f"optim={o.name} is not supported by backend=cuda; choose one of: {', '.join(OPTIMIZERS)}")
    return OPTIMIZER_BUILDERS[o.name](params, o)


class CudaBackend:
    """torch/transformers/PEFT/bitsandbytes backend; see the module docstring."""

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

    # ---- several processes -------------------------------------------------------------
    def connect(self, spec: RunSpec) -> Comm:
        """Join torchrun's (or accelerate's, or SLURM's) process group when one launched us:
        nccl on GPUs, gloo on the CPU (backend.device=cpu or no GPU visible)."""
        from finetune.backends.cuda import distributed

        _set_alloc_conf(spec.backend.alloc_conf)
        world = distributed.launched_world()
        if world is None:
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
            self.packed_attention = _packed_attention(self.hf, self.device)
            log.info("packed rows: %s", self.packed_attention)
        self._adapt(spec)
        self.model.train()  # dropout on; transformers checkpoints only in training mode
        self.set_grad_checkpointing(spec.train.grad_checkpointing)
        if self.comm.world_size > 1:
            self._distribute(spec)
        self._setup_loss(spec)
        trainable = self._setup_optimizer(spec)
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
        device = _resolve_device(spec.backend.device, self.comm.local_rank)
        if device.type == "cuda":  # before anything else touches CUDA in this process
            split_later = spec.backend.device_map == "auto"
            self._contexts = _measure_cuda_contexts(list(range(torch.cuda.device_count())) if split_later
                                                    else [device.index or 0])
        self.weight_dtype = _TORCH_DTYPES[self.dtypes.weights]
        self.autocast_dtype = _TORCH_DTYPES[self.dtypes.autocast] if self.dtypes.autocast else None
        self._check_precision("bf16-true" if prec == "auto" and self.dtypes.weights == "bfloat16" else prec, device)
        return device

    def _load(self, spec: RunSpec, model_dir: Path, device: torch.device) -> None:
        """The base model through ``from_pretrained`` on ``device`` (or split over the GPUs),
        4-bit quantized there for qlora; a multimodal checkpoint's language model alone."""
        m = spec.method
        _check_loadable(spec, model_dir, self.handle.quantization)
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
        kwargs["device_map"] = "auto" if split else {"": str(device)}
        if m.name == "qlora":
            kwargs["quantization_config"] = self._bnb_config(m, self.autocast_dtype or self.weight_dtype)

        try:
            hf = load_causal_lm(model_dir, **kwargs)  # a multimodal checkpoint: its language model alone
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

    def _adapt(self, spec: RunSpec) -> None:
        """method=full trains every weight; the others wrap the model in PEFT adapters."""
        m = spec.method
        if m.name == "full":
            self.hf.requires_grad_(True)
            self.model = self.hf
        else:
            self.model = self._add_adapters(self.hf, m, spec.precision.name, self.desc)

    def _setup_loss(self, spec: RunSpec) -> None:
        """train.loss_chunk (refused under FSDP shards) and train.compile's compiled loss."""
        self._loss_chunk = spec.train.loss_chunk
        if self._loss_chunk and self.sharded:
            raise UserError("train.loss_chunk calls the output head outside FSDP's forward, where its weights are "
                            "still sharded; use train.loss_chunk=0 with backend.strategy=fsdp (or strategy=ddp)")
        if spec.train.compile:
            self._compiled_loss = _compile_loss(self.device, self._loss_chunk, self.strategy)

    def _setup_optimizer(self, spec: RunSpec) -> list[torch.nn.Parameter]:
        """The optimizer over the trainable parameters (returned), and fp16's grad scaler."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = _build_optimizer(spec.optim, trainable)
        if self.autocast_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(self.device.type)
        return trainable

    def _model_info(self, spec: RunSpec, model_dir: Path, trainable: list[torch.nn.Parameter]) -> ModelInfo:
        m, prec = spec.method, spec.precision.name
        devices = sorted({str(p.device) for p in self.model.parameters()})
        return ModelInfo(
            params_total=sum(_logical_numel(p) for p in self.model.parameters()),
            params_trainable=sum(p.numel() for p in trainable),
            device=str(self.device),
            dtype=m.quant.type if m.name == "qlora" else _dtype_name(self.weight_dtype),
            model_path=str(Path(model_dir).resolve()),
            extra={"devices": devices, "precision": prec, "dtypes": self.dtypes.__dict__,
                   "optimizer": type(self.optimizer).__name__,
                   "autocast": _dtype_name(self.autocast_dtype) if self.autocast_dtype else None,
                   "grad_scaler": self.scaler is not None,
                   "grad_checkpointing": self.grad_checkpointing},
        )

    def _distribute(self, spec: RunSpec) -> None:
        """Several ranks: equal trainable weights everywhere (ddp), or FSDP2 shards (fsdp);
        then each rank its own dropout stream (seed + rank)."""
        from finetune.backends.cuda import distributed

        if self.strategy == "fsdp":
            if spec.method.name == "qlora":
                raise UserError("backend.strategy=fsdp cannot shard bitsandbytes 4-bit weights here; use "
                                "backend.strategy=ddp with method=qlora, or method=lora with fsdp")
            if spec.optim.name not in FSDP_OPTIMIZERS:
                raise UserError(f"optim={spec.optim.name} cannot update FSDP's sharded (DTensor) parameters; use "
                                "optim=adamw (or adam, sgd) with backend.strategy=fsdp, or backend.strategy=ddp")
            autocast = self.autocast_dtype
            comm = cast(distributed.TorchComm, self.comm)  # strategy=fsdp over ranks: connect() made a TorchComm
            self.units = distributed.shard_model(self.model, self.hf, comm, param_dtype=autocast,
                                                 reduce_dtype=torch.float32 if autocast is not None else None)
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

    @staticmethod
    def _bnb_config(m: MethodSpec, compute_dtype: torch.dtype) -> Any:
        from transformers import BitsAndBytesConfig

        q = m.quant
        if q.bits != 4 or q.type not in ("nf4", "fp4"):
            raise UserError(f"method=qlora on backend=cuda quantizes to 4 bits as nf4 or fp4, "
                            f"not {q.bits}-bit {q.type}; "
                            "set method.quant_bits=4 method.quant_type=nf4")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise UserError("method=qlora needs bitsandbytes: pip install '.[cuda]'") from e
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.type,
                                  bnb_4bit_use_double_quant=q.double_quant,
                                  bnb_4bit_compute_dtype=compute_dtype)

    @staticmethod
    def _add_adapters(hf: torch.nn.Module, m: MethodSpec, prec: str, desc: Any) -> torch.nn.Module:
        """PEFT adapters on exactly the block weights the model description resolves from
        ``method.lora.keys`` (what the planner counted): modules by name, and the stacked expert
        parameters of an MoE model through ``target_parameters`` when ``experts`` is asked for."""
        import transformers
        from peft import LoraConfig, get_peft_model

        lc = m.lora
        n_layers = hf.config.num_hidden_layers
        # num_layers N > 0: adapters only on the top N decoder layers (as mlx-lm's --num-layers).
        keys = lora_keys(desc, lc.keys)
        n = lc.num_layers
        top = list(range(n_layers - n, n_layers)) if 0 < n < n_layers else None
        experts = sorted({lin.path.split("mlp.", 1)[-1] for b in desc.blocks for lin in b.linears
                          if lin.key == EXPERTS}) if EXPERTS in keys else []
        if experts and m.name == "dora":
            raise UserError("method=dora: PEFT 0.21 has no DoRA for stacked expert parameters; "
                            "drop experts from method.lora.keys or use method=lora")
        modules = [k for k in keys if k != EXPERTS]
        check_targets(desc, tuple(modules), _linear_names(hf), f"transformers {transformers.__version__}")
        config = LoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                            target_modules=modules or None, target_parameters=experts or None,
                            layers_to_transform=top, bias="none", use_dora=m.name == "dora", task_type="CAUSAL_LM")
        # bf16-true keeps the adapters in bf16 too; otherwise PEFT holds them in fp32.
        return get_peft_model(hf, config, autocast_adapter_dtype=prec != "bf16-true")

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
            if self._compiled_loss is None or not _is_compile_failure(e):
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

    # ---- files -------------------------------------------------------------------------
    def save_adapter(self, path: Path | None) -> None:
        """PEFT adapter (safetensors) for lora/dora/qlora; for full, the HF model plus the base
        model's tokenizer files. Under fsdp every rank calls this (the full weights are
        gathered from the shards, a collective) and rank 0, whose ``path`` is set, writes."""
        state = None
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
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
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

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

    # ---- memory ------------------------------------------------------------------------
    def _cuda_indices(self) -> list[int]:
        # Placement is fixed after setup; walking every parameter per sample cost ~200 us.
        if getattr(self, "_indices", None) is None:
            self._indices = sorted({p.device.index or 0 for p in self.model.parameters() if p.device.type == "cuda"})
        return self._indices

    def memory(self) -> dict[str, Any]:
        """Allocator figures (bytes) per CUDA device the model uses, plus their sums. Sums of
        per-device peaks bound the simultaneous peak from above. All None on CPU."""
        keys = ("allocated", "reserved", "peak_allocated", "peak_reserved", "inactive_split",
                "alloc_retries", "num_ooms")
        indices = self._cuda_indices()
        if not indices:
            return {**dict.fromkeys(keys), "device_total": None, "devices": None}
        devices = []
        if self._totals is None:
            self._totals = {i: int(torch.cuda.get_device_properties(i).total_memory) for i in indices}
        for i in indices:
            # the nested form: memory_stats() flattens this same dict in Python, which costs
            # more than the allocator's own C++ call, at every sample
            s = torch.cuda.memory_stats_as_nested_dict(i)
            alloc, res, split = (s.get(k, {}).get("all", {}) for k in
                                 ("allocated_bytes", "reserved_bytes", "inactive_split_bytes"))
            devices.append({
                "index": i,
                "allocated": int(alloc.get("current", 0)),
                "reserved": int(res.get("current", 0)),
                "peak_allocated": int(alloc.get("peak", 0)),
                "peak_reserved": int(res.get("peak", 0)),
                "inactive_split": int(split.get("current", 0)),
                "alloc_retries": int(s.get("num_alloc_retries", 0)),
                "num_ooms": int(s.get("num_ooms", 0)),
                "total": self._totals[i],
                "cuda_context": self._contexts.get(i),  # measured at setup, see _measure_cuda_contexts
            })
        out: dict[str, Any] = {k: sum(d[k] for d in devices) for k in keys}
        out["device_total"] = sum(d["total"] for d in devices)
        ctx = [d["cuda_context"] for d in devices]
        out["cuda_context"] = None if None in ctx else sum(ctx)
        out["devices"] = devices
        return out

    def reset_peak(self) -> None:
        """Reset torch's peak counters on every CUDA device the model uses (every visible
        device before setup, so the load itself is inside the run's peak)."""
        if getattr(self, "model", None) is None:
            # Before the first CUDA allocation there is nothing to reset, and torch refuses
            # ("Invalid device argument") until its allocator exists (seen on an H200).
            indices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
        else:
            indices = self._cuda_indices()
        for i in indices:
            torch.cuda.reset_peak_memory_stats(i)

    def census(self) -> Census:
        """Bytes of live tensors by category, each tensor counted once (tied weights and the
        quantile maps bitsandbytes shares between parameters are deduplicated by address).
        optimizer_state counts state tensors on their parameter's device type (torch's Adam
        keeps its per-tensor ``step`` as a host scalar beside CUDA params: not allocator
        memory); optimizer_state_paged counts bitsandbytes paged (unified-memory) buffers."""
        out: dict[CensusKey, int] = dict.fromkeys(CENSUS_KEYS, 0)
        seen: set[tuple[str, int, int]] = set()

        from finetune.backends.cuda.distributed import local

        def add(key: CensusKey, t: Any) -> None:
            if not torch.is_tensor(t) or t.device.type == "meta":
                return
            t = local(t)  # fsdp: this rank's shard is what its memory holds
            nbytes = t.numel() * t.element_size()
            ident = (str(t.device), t.data_ptr(), nbytes)
            if nbytes and ident not in seen:
                seen.add(ident)
                out[key] += nbytes

        params = list(self.model.parameters())
        for p in params:
            add("trainable_weights" if p.requires_grad else "frozen_weights", p)
            if type(p).__name__ == "Params4bit" and p.quant_state is not None:
                for t in _quant_tensors(p.quant_state):
                    add("quant_buffers", t)
        for p in params:
            add("grads", p.grad)
        for p, state in self.optimizer.state.items():
            for v in state.values():
                if getattr(v, "is_paged", False):
                    add("optimizer_state_paged", v)
                elif torch.is_tensor(v) and v.device.type == p.device.type:
                    add("optimizer_state", v)
        return cast(Census, out)  # every census category, each an int

    def release_cache(self) -> None:
        """gc, then hand torch's cached CUDA blocks back to the driver (nothing to do on CPU)."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def set_memory_limits(self, budget_bytes: int) -> dict[str, Any]:
        """Cap torch's allocator on each CUDA device the model uses at ``budget_bytes`` (a
        per-device budget). Returns {} on CPU, where torch has no such limit."""
        fractions = {}
        for i in self._cuda_indices():
            total = torch.cuda.get_device_properties(i).total_memory
            fractions[f"cuda:{i}"] = min(1.0, budget_bytes / total)
            torch.cuda.set_per_process_memory_fraction(fractions[f"cuda:{i}"], i)
        if not fractions:
            return {}
        return {"per_process_memory_fraction": fractions, "budget_bytes": int(budget_bytes)}

    def set_cache_limit(self, limit_bytes: int) -> int:
        """torch's caching allocator has no cap on its cached blocks (``Capabilities.cache_limit``
        is False, so the governor never calls this)."""
        raise NotImplementedError("torch's caching allocator has no cache limit to set")

    def generate(self, model_dir: Path, adapter: Path | None, prompt: Prompt, max_new_tokens: int, temperature: float,
                 seed: int, trust_remote_code: bool = False, allow_pickle: bool = False) -> str:
        """``mode=generate`` with the library's own generation (backends/cuda/generate.py)."""
        from finetune.backends.cuda.generate import generate

        return generate(model_dir, adapter, prompt, max_new_tokens, temperature, seed,
                        trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)


BACKEND = CudaBackend  # what finetune.backends.runtimes.get_backend instantiates
