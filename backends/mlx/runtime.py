"""MLX backend: mlx + mlx-lm behind the Protocol in ``backends.base``.

Loading, LoRA/DoRA layers, gradient checkpointing and the adapter format are mlx-lm's own
(``mlx_lm.utils.load``, ``tuner.utils.linear_to_lora_layers``, ``tuner.trainer.grad_checkpoint``),
so an adapter written here loads with ``mlx_lm.generate --adapter-path`` and
``mlx_lm.tuner.utils.load_adapters``. Runs on Apple GPUs (Metal) and on Linux CPU (mlx[cpu]).

What MLX cannot do that the cuda backend can: autocast (no bf16-mixed / 16-mixed), 8-bit or
paged optimizers, a reserved-bytes peak counter, and (on Linux CPU) a hard memory limit:
``mx.set_memory_limit`` is advisory there, allocations past it still succeed.

Under ``mlx.launch -n N`` (ring, or jaccl over Thunderbolt RDMA, or MPI) ``connect`` joins
``mx.distributed``: data parallel, every rank holding the whole model, gradients summed over
ranks before each update, rank 0 writing the saves.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from finetune.backends.base import Batch, Comm, ModelInfo, PhaseHook
from finetune.backends.mlx import distributed
from finetune.backends.mlx.capabilities import CAPABILITIES
from finetune.backends.mlx.distributed import sum_over_ranks
from mlx import nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from finetune.errors import UserError
from finetune import precision as precision_mod
from finetune.backends.mlx.generate import generate
from finetune.backends.mlx.preference import MlxPreference
from finetune.backends.mlx.hfconfig import MLX_TEXT_PREFIX, model_config as mlx_model_config
from finetune.records import Census, MemoryReading
from finetune.model.describe import EXPERTS, FAMILIES, check_targets, lora_keys
from finetune.planner.setup import model_handle
from finetune.prompting import Prompt
from finetune.spec import OptimSpec, RunSpec

log = logging.getLogger("finetune")

_SCALARS = ("step", "learning_rate")  # optimizer bookkeeping, not per-parameter state


def _mlx_lm_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")


def _nbytes(tree: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree)) if tree is not None else 0


def _check_architecture(model_dir: Path) -> None:
    """UserError, naming the fix, for a config.json whose model_type mlx-lm has no module for."""
    import importlib.util
    import json

    from mlx_lm.utils import MODEL_REMAPPING

    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return
    name = MODEL_REMAPPING.get(model_type, model_type)
    if isinstance(name, str) and name.isidentifier() and importlib.util.find_spec(f"mlx_lm.models.{name}"):
        return
    raise UserError(f"{model_dir}: architecture model_type={model_type!r} is not one mlx-lm can load; "
                    "use backend=cuda (transformers) or a model mlx-lm supports")


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # "mlx.core.float32" -> "float32"


def _is_oom(err: Exception) -> bool:
    msg = str(err).lower()
    return any(s in msg for s in ("out of memory", "insufficient memory", "malloc", "resource limit"))


def _metal() -> bool:
    return mx.metal.is_available()


def _adam(o: OptimSpec) -> optim.Optimizer:
    if o.weight_decay:
        raise UserError("optim=adam has no weight decay on mlx; use optim=adamw optim.weight_decay=...")
    return optim.Adam(float(o.lr), betas=[float(b) for b in o.betas], eps=float(o.eps), bias_correction=True)


# One constructor per name in CAPABILITIES.optimizers (tests/test_capabilities.py checks both
# ways). bias_correction=True: mlx defaults to False, torch/PEFT always correct; the same config
# must mean the same update on both backends. Adafactor: the loop owns the schedule, so no
# relative step or parameter scaling, as transformers' Adafactor(relative_step=False,
# scale_parameter=False). mlx SGD keeps a "v" buffer even at momentum 0 (4 bytes/param).
OPTIMIZER_BUILDERS: dict[str, Callable[[OptimSpec], optim.Optimizer]] = {
    "adamw": lambda o: optim.AdamW(float(o.lr), betas=[float(b) for b in o.betas], eps=float(o.eps),
                                   weight_decay=float(o.weight_decay), bias_correction=True),
    "adam": _adam,
    "sgd": lambda o: optim.SGD(float(o.lr), momentum=float(o.momentum), weight_decay=float(o.weight_decay)),
    "adafactor": lambda o: optim.Adafactor(float(o.lr), eps=(float(o.eps), 1e-3), weight_decay=float(o.weight_decay),
                                           relative_step=False, scale_parameter=False),
}


class MlxBackend(MlxPreference):
    """One model, its adapters and its optimizer on MLX. See ``backends.base.Backend``; its
    preference steps are ``MlxPreference``'s (preference.py)."""

    name = "mlx"
    is_oom = staticmethod(_is_oom)  # MlxPreference's steps read it (preference.py cannot import this module)

    def __init__(self) -> None:
        self.model: Any = None  # an mlx_lm model, set by setup() (Any: its layers are its own)
        self._grads: dict | None = None
        self._micro = 0  # forward_backward calls so far: seeds the RNG (see _reseed)
        self._loss_chunk = 0  # train.loss_chunk: tokens per chunk of head + loss (0: whole logits)
        self._cache: list | None = None  # a packed micro-batch's per-layer caches, while it runs
        self.packed_attention = ""  # train.packing: the attention path that keeps samples apart, in words
        self._head_said = False  # the head's fallback to every position is said once
        self._max_norm: float | None = None  # optim.max_grad_norm (None: no clipping)
        self._micro_at_step = 0  # _micro after the last optimizer step, for zero_grad
        self._compile = False  # train.compile: the step's two halves through mx.compile
        self._compiled: dict[str, Callable] = {}  # built on first use, dropped when what they traced changes
        self._ckpt_classes: dict[type, type] = {}
        self._wired_limit: int | None = None
        self._limits: dict[str, int | None] | None = None  # read once in memory(), then kept current
        self._device_info: dict[str, Any] = dict(mx.device_info())  # fixed for the process
        self.comm: Comm = Comm()
        self.spec: RunSpec | None = None  # the run, set by setup()

    # ---- ranks -------------------------------------------------------------------------
    def connect(self, spec: RunSpec) -> Comm:
        """Join ``mx.distributed`` when ``mlx.launch`` (or mpirun) started this process as one of
        several ranks; otherwise stay one process (``Comm()``) and change nothing."""
        self.comm = distributed.join()
        return self.comm

    # ---- setup -------------------------------------------------------------------------
    def setup(self, spec: RunSpec, model_dir: Path) -> ModelInfo:
        """Load ``model_dir`` with mlx-lm, cast, quantize, apply the method and checkpointing,
        build the optimizer and the step. ``spec`` is resolved and checked (finetune.resolver):
        its choices are ones this backend runs. The stages, in order: each refuses what it
        cannot run before the next one starts."""
        self._remember(spec, model_dir)
        self._load(spec, model_dir)
        self._cast(spec, model_dir)  # before quantizing, so the quantization scales get the dtype
        self._quantize(spec, model_dir)
        self._adapt(spec, model_dir)
        if spec.precision.name == "bf16-true":
            self.model.set_dtype(mx.bfloat16)  # floating params only: packed quant weights stay uint32
        if spec.train.packing:
            self.packed_attention = self._check_packed()
        mx.eval(self.model.parameters())
        if self.comm.world_size > 1:
            self._broadcast_trainable()
        self.model.train()
        self.optimizer = self._make_optimizer(spec.optim)
        self._setup_step(spec)
        self.set_grad_checkpointing(spec.train.grad_checkpointing)
        if _metal():  # MLX has no getter for the wired limit: read it once by a swap
            self._wired_limit = mx.set_wired_limit(0)
            mx.set_wired_limit(self._wired_limit)
        return self._model_info(spec)

    def _remember(self, spec: RunSpec, model_dir: Path) -> None:
        """The run and what the step reads at every call (clipping, the seed), then seeding:
        LoRA init draws from the global key."""
        if spec.backend.resolved != self.name:  # the resolver checked its choices against that backend
            raise ValueError(f"a spec resolved for backend={spec.backend.resolved} was handed to backend={self.name}")
        self.spec, self.model_dir, self.method = spec, Path(model_dir), spec.method.name
        self.handle = model_handle(spec, model_dir)  # the run's model, described once (RunSpec.model_handle)
        mn = spec.optim.max_grad_norm
        self._max_norm = None if mn is None else float(mn)  # read once, not every step
        self.seed = spec.train.seed
        mx.random.seed(self.seed)  # LoRA init draws from the global key

    def _load(self, spec: RunSpec, model_dir: Path) -> None:
        """The base model and tokenizer through ``mlx_lm.load`` (a pre-quantized checkpoint
        comes back with its quantized layers), after refusing an architecture mlx-lm has no
        module for."""
        from mlx_lm.utils import load

        _check_architecture(model_dir)
        trust = spec.model.trust_remote_code  # the tokenizer's own code runs only when set
        # transformers-5 keys (rope_parameters, ...) in mlx-lm's words; refuses before any weights
        hf_keys = mlx_model_config(model_dir, seq_len=spec.train.seq_len)
        self.desc = desc = self.handle.desc  # what the planner priced; _adapt reads it too
        try:
            model, self.tokenizer, self.model_config = load(str(model_dir), return_config=True, model_config=hf_keys,
                                                            tokenizer_config={"trust_remote_code": trust},
                                                            trust_remote_code=trust)
        except (TypeError, ValueError, SystemExit) as e:
            # mlx-lm cannot build or fill this checkpoint's model: its ModelArgs want keys this
            # config.json names otherwise (TypeError), its module builds other weights than the
            # file holds (ValueError: "parameters not in model", "Expected shape"), or its module
            # exits on import for a package it lacks (SystemExit, after printing which)
            fix = "use backend=cuda" + ("" if desc.described else
                                        f", or a model of a described family: {', '.join(sorted(FAMILIES))}")
            why = (f"its module exited on import (status {e.code}), needing what it printed above"
                   if isinstance(e, SystemExit) else " ".join(str(e).split())[:200])
            raise UserError(f"{model_dir}: mlx-lm {_mlx_lm_version()} cannot load model_type={desc.model_type} from "
                            f"this checkpoint ({why}); {fix}") from None
        if not desc.described:  # tests/test_families_mlx.py checks mlx-lm against transformers per described family
            log.warning("model_type=%s: mlx-lm's %s module builds it, and finetune has not checked that it computes "
                        "what transformers does for this family (a RoPE variant or a config key it does not read "
                        "would change the model); compare a few steps' loss with backend=cuda before a long run",
                        desc.model_type, type(model).__module__.rsplit(".", 1)[-1])
        # A multimodal checkpoint (Gemma 3 from 4B up): mlx-lm's wrapper holds the language model
        # (its sanitize drops the vision tower's weights) as `language_model`; the run trains that
        # model, and the files mlx-lm reads back (adapters, a full model) keep the wrapper's names.
        self.outer, self.prefix = model, ""
        inner = getattr(model, "language_model", None)
        if inner is not None and not hasattr(model, "model") and hasattr(inner, "model"):
            model, self.prefix = inner, MLX_TEXT_PREFIX
        self.model = model

    def _cast(self, spec: RunSpec, model_dir: Path) -> None:
        """The weights' dtype the planner priced (finetune/precision.py)."""
        prec, method = spec.precision.name, spec.method.name
        if prec == "32-true":
            # mlx_lm.load keeps a checkpoint's stored dtype (often bf16 on the hub); 32-true
            # means fp32 weights, and the planner counts them so. Before quantizing, so the
            # quantization scales are fp32 too. precision=auto keeps what was stored.
            self.model.set_dtype(mx.float32)
        elif prec == "auto" and method == "full":
            # the planner's rule (finetune/precision.py): an fp16 checkpoint trains in bf16
            if precision_mod.resolve("mlx", prec, method, self.handle.stored_dtype[0]).weights == "bfloat16":
                self.model.set_dtype(mx.bfloat16)
        self._block_classes = [type(layer) for layer in self.model.layers]

    def _quantize(self, spec: RunSpec, model_dir: Path) -> None:
        """A pre-quantized checkpoint stays as stored; method=qlora quantizes the base here."""
        self.quant: dict[str, int] | None = None
        stored_q = self.handle.quantization
        self.pre_quantized = stored_q is not None
        if stored_q:
            # A pre-quantized checkpoint (mlx_lm.convert -q, the mlx-community repos):
            # mlx_lm.load rebuilt its QuantizedLinear layers; LoRA trains on top of them, and
            # method=qlora has nothing more to quantize.
            self.quant = {"bits": stored_q["bits"], "group_size": stored_q["group_size"]}
        elif spec.method.name == "qlora":
            self.quant = {"bits": spec.method.quant.bits, "group_size": spec.method.quant.group_size}
            g = self.quant["group_size"]
            # As mlx_lm.utils.quantize_model: layers whose input width the group does not
            # divide stay in full precision.
            nn.quantize(self.model, g, self.quant["bits"],
                        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % g == 0)

    def _adapt(self, spec: RunSpec, model_dir: Path) -> None:
        """method=full trains every weight; the others freeze the base and add mlx-lm's LoRA or
        DoRA layers on the keys the model description resolves."""
        from mlx_lm.tuner.utils import linear_to_lora_layers

        model, method = self.model, spec.method.name
        self.lora: dict[str, Any] | None = None
        if method == "full":
            model.unfreeze()
            return
        lc = spec.method.lora
        n = lc.num_layers
        # the keys the model description resolves (null: the model's default ones), as the
        # planner counted them
        desc = self.desc
        keys = lora_keys(desc, lc.keys)
        if not desc.described:  # priced as a Llama-style decoder: its blocks may not be one
            check_targets(desc, keys, {k.rsplit(".", 1)[-1] for k in self._block_linears()}, f"mlx-lm {_mlx_lm_version()}")
        if n > len(model.layers):
            raise UserError(f"method.lora.num_layers={n} but the model has {len(model.layers)} layers")
        self.lora_layers = n
        self.lora = {"rank": lc.rank, "scale": float(lc.alpha) / lc.rank,
                     "dropout": float(lc.dropout), "keys": self._block_keys(keys)}
        model.freeze()
        linear_to_lora_layers(model, n, self.lora, use_dora=(method == "dora"))

    def _setup_step(self, spec: RunSpec) -> None:
        """The step's loss (train.loss_chunk) and gradient function, and train.compile."""
        self._loss_chunk = spec.train.loss_chunk
        self._vg = nn.value_and_grad(self.model, self._loss)
        self._compile = spec.train.compile
        self._compiled = {}
        if self._compile and spec.train.packing:
            raise UserError("train.compile with train.packing on backend=mlx: every packed micro-batch has its own "
                            "length and sample boundaries, so mx.compile would trace each one anew; set one of them off")

    def _model_info(self, spec: RunSpec) -> ModelInfo:
        first = tree_flatten(self.model.parameters())[0][1]  # the embedding: the base's dtype
        dtype = f"int{self.quant['bits']}" if self.quant else _dtype_name(first.dtype)
        return ModelInfo(
            params_total=self._params_total(),
            params_trainable=sum(v.size for _, v in tree_flatten(self.model.trainable_parameters())),
            device="mlx:gpu" if mx.default_device().type == mx.DeviceType.gpu else "mlx:cpu",
            dtype=dtype,
            model_path=str(self.model_dir.resolve()),
            extra={"lora": self.lora, "quantization": self.quant and {"mode": "affine", **self.quant},
                   "adam_bias_correction": spec.optim.name in ("adam", "adamw")},
        )

    def _broadcast_trainable(self) -> None:
        """Give every rank rank 0's trainable weights (once, after setup): a sum of rank 0's
        values and every other rank's zeros, exact in any dtype. The seeded LoRA init already
        agrees on one machine; hosts with different mlx builds or checkpoints might not."""
        mine = self.model.trainable_parameters()
        if self.comm.rank != 0:
            mine = tree_map(mx.zeros_like, mine)
        self.model.update(sum_over_ranks(mine, self.comm.group))  # type: ignore[attr-defined]  # an MlxComm: several ranks
        mx.eval(self.model.parameters())

    def _block_keys(self, keys: tuple[str, ...]) -> list[str]:
        """Map the description's keys (transformers' module names: ``q_proj``, ``qkv_proj``,
        ``c_fc``; ``experts``) to mlx-lm's paths inside a block (``self_attn.q_proj``; an MoE's
        ``switch_mlp.gate_proj``, ``up_proj`` and ``down_proj``)."""
        linears = self._block_linears()
        out: list[str] = []
        for key in keys:
            hits = [k for k, sw in linears.items() if sw] if key == EXPERTS else [
                k for k, sw in linears.items() if not sw and (k == key or k.rsplit(".", 1)[-1] == key)]
            if not hits:
                raise UserError(f"method.lora.keys: {key} is a weight of this model, but mlx-lm "
                                f"{_mlx_lm_version()}'s {type(self.model).__module__.rsplit('.', 1)[-1]} module has no "
                                f"such layer to adapt; use backend=cuda, or keys among: "
                                f"{', '.join(sorted({k.rsplit('.', 1)[-1] for k, sw in linears.items() if not sw}))}")
            out += [h for h in hits if h not in out]
        return out

    def _block_linears(self) -> dict[str, bool]:
        """Each linear layer's path inside a block (``self_attn.q_proj``) -> whether it is a stacked
        experts' matrix (mlx-lm's SwitchLinear)."""
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

        switch = (SwitchLinear, QuantizedSwitchLinear)
        linears: dict[str, bool] = {}
        for layer in self.model.layers:
            for k, m in layer.named_modules():
                if k and (isinstance(m, (nn.Linear, nn.QuantizedLinear, *switch)) or hasattr(m, "to_lora")):
                    linears.setdefault(k, isinstance(m, switch))
        return linears

    def _make_optimizer(self, o: OptimSpec) -> optim.Optimizer:
        if o.name not in OPTIMIZER_BUILDERS:  # a lookup that misses raises, never falls through
            raise UserError(f"optim={o.name} is not supported by backend=mlx; "
                            f"choose one of: {', '.join(CAPABILITIES.optimizers)}")
        return OPTIMIZER_BUILDERS[o.name](o)

    def _params_total(self) -> int:
        """Logical elements, as mlx_lm.utils.get_total_parameters (a packed quantized weight
        counts 32/bits elements per uint32, scales/biases not at all), adapters included."""
        quant = {p: m.bits for p, m in self.model.named_modules() if hasattr(m, "bits") and "scales" in m}
        total = 0
        for name, v in tree_flatten(self.model.parameters()):
            mod, leaf = name.rsplit(".", 1)
            if mod in quant:
                total += v.size * 32 // quant[mod] if leaf == "weight" else v.size if leaf == "bias" else 0
            else:
                total += v.size
        return total

    # ---- step --------------------------------------------------------------------------
    def _loss(self, ids: mx.array, mask: mx.array, scale: float) -> tuple[mx.array, mx.array]:
        from finetune.backends.mlx.loss import UnsupportedModel, head_fallback, token_loss_sum

        # train.loss_chunk > 0: head + cross-entropy a chunk of tokens at a time, the full
        # [B, T, V] logits never built (backends/mlx/loss.py); 0: the whole logits
        try:
            loss_sum = token_loss_sum(self.model, ids, mask, self._loss_chunk, cache=self._cache)
        except UnsupportedModel as e:  # a model whose logits the chunked loss cannot reproduce
            raise UserError(str(e)) from None
        if not self._head_said and head_fallback(self.model):
            self._head_said = True
            log.info("the output head runs on every position, not only targets: %s", head_fallback(self.model))
        return loss_sum * scale, loss_sum  # grads of the first, the second rides along

    def _arrays(self, batch: Batch) -> tuple[mx.array, mx.array]:
        return mx.array(batch.input_ids.astype(np.int32)), mx.array(batch.loss_mask.astype(np.float32))

    def _check_packed(self) -> str:
        """train.packing, once before training: the path that keeps this model's packed samples
        apart (``backends/mlx/loss.py`` ``check_packed``), said in the log; UserError where none."""
        from finetune.backends.mlx.loss import UnsupportedModel, check_packed

        try:
            path = check_packed(self.model)
        except UnsupportedModel as e:
            raise UserError(str(e)) from None
        log.info("packed rows: %s", path)
        return path

    @contextmanager
    def _packed(self, batch: Batch) -> Iterator[None]:
        """A packed micro-batch (``Batch.position_ids``): the model's RoPE takes each token's
        own position and its attention a block-diagonal causal mask for the whole call,
        gradients included (``backends/mlx/loss.py`` ``packed``); an unpacked batch as before."""
        from finetune.backends.mlx.loss import UnsupportedModel, packed

        pos = None if batch.position_ids is None else mx.array(batch.position_ids.astype(np.int32))
        try:
            with packed(self.model, pos) as self._cache:
                yield
        except UnsupportedModel as e:
            raise UserError(str(e)) from None
        finally:
            self._cache = None

    def _reseed(self) -> None:
        # mx.random.state has no setter, so a saved key cannot be put back. Instead the key
        # is a function of (train.seed, micro-step): a resumed run draws the same dropout masks.
        # Under W ranks each rank draws its own keys (micro * W + rank; W = 1 is the plain count).
        w = self.comm.world_size
        mx.random.seed(self.seed * 1_000_003 + self._micro * w + self.comm.rank)

    # ---- compiled step (train.compile) ---------------------------------------------------
    # As mlx-lm's trainer (tuner/trainer.py ``step``): mx.compile with the state the function
    # reads and writes named as inputs and outputs, so a traced graph sees this call's weights,
    # optimizer state and random key rather than the ones of the call that traced it. Our loop
    # calls the two halves apart (gradients accumulate over micro-batches, the update comes
    # once per step), so each half is compiled on its own. MLX traces again for every new input
    # shape: with train.pad_multiple=1 every new micro-batch length is a new trace.
    def _compiled_vg(self) -> Callable:
        fn = self._compiled.get("vg")
        if fn is None:
            # the model is an output too: nn.value_and_grad puts the traced weights into it
            # (model.update) and the key, which _reseed sets before each micro-batch, is
            # split by every dropout
            state = [self.model.state, mx.random.state]
            fn = self._compiled["vg"] = mx.compile(self._vg, inputs=state, outputs=state)
        return fn

    def _compiled_update(self) -> Callable:
        fn = self._compiled.get("update")
        if fn is None:
            # the moments must exist before tracing: created inside the trace, they would be
            # outputs without a primitive ("Attempting to eval an array without a primitive")
            self.optimizer.init(self.model.trainable_parameters())  # keeps state already there
            state = [self.model.state, self.optimizer.state]
            fn = self._compiled["update"] = mx.compile(self._clip_and_update, inputs=state, outputs=state)
        return fn

    def _clip_and_update(self, grads: dict) -> mx.array:
        """Clip to optim.max_grad_norm (unless null), apply the update; the pre-clip norm."""
        if self._max_norm:
            grads, norm = optim.clip_grad_norm(grads, self._max_norm)
        else:
            norm = mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for _, g in tree_flatten(grads)))
        self.optimizer.update(self.model, grads)
        return norm

    def forward_backward(self, batch: Batch, loss_scale: float, on_phase: PhaseHook | None = None) -> float:
        """Accumulate grads of loss_sum * loss_scale; return loss_sum. value_and_grad fuses
        forward and backward, so only the "backward" phase is reported."""
        self._reseed()
        ids, mask = self._arrays(batch)

        def run() -> tuple[mx.array, Any]:
            with self._packed(batch):
                if self._compile:  # the scale as an array: a Python float would be traced as a constant
                    (_, loss_sum), grads = self._compiled_vg()(ids, mask, mx.array(loss_scale, mx.float32))
                else:
                    (_, loss_sum), grads = self._vg(ids, mask, loss_scale)
            return loss_sum, grads

        # the gradients added to the step's and evaluated; on OOM self._grads keeps the earlier sums
        return float(self._accumulate(run, on_phase))

    def optimizer_step(self, lr: float) -> float | None:
        """Under several ranks the accumulated gradients are first summed over them (every rank
        then holds the one-process gradient, bit for bit the same), so the norm, the clip and
        the update agree on every rank."""
        grads = self._grads
        if self.comm.world_size > 1:
            if grads is None:  # a rank with no rows this step still joins the sum
                grads = tree_map(mx.zeros_like, self.model.trainable_parameters())
            grads = sum_over_ranks(grads, self.comm.group)  # type: ignore[attr-defined]  # world_size > 1: an MlxComm
        if grads is None:
            return None
        self.optimizer.learning_rate = lr  # an array in the optimizer's state: no retrace per step
        norm = (self._compiled_update() if self._compile else self._clip_and_update)(grads)
        mx.eval(self.model.parameters(), self.optimizer.state, norm)
        self._grads = None
        self._micro_at_step = self._micro
        return float(norm)

    def zero_grad(self) -> None:
        """Drop accumulated grads; the redone step draws the same RNG keys again."""
        self._grads = None
        self._micro = self._micro_at_step

    def eval_loss(self, batch: Batch) -> float:
        ids, mask = self._arrays(batch)
        self.model.eval()  # no dropout
        try:
            with self._packed(batch):
                loss = self._loss(ids, mask, 1.0)[1]
            mx.eval(loss)
        finally:
            self.model.train()
        return float(loss)

    def set_grad_checkpointing(self, enabled: bool) -> None:
        """mlx-lm's grad_checkpoint patches ``__call__`` on a block's class, which would touch
        every model in the process and could not be undone. We give this model's blocks a
        private subclass and patch that, so switching off is restoring the original class."""
        from mlx_lm.tuner.trainer import grad_checkpoint

        for layer, base in zip(self.model.layers, self._block_classes):
            if not enabled:
                layer.__class__ = base
                continue
            if base not in self._ckpt_classes:
                self._ckpt_classes[base] = type(f"Checkpointed{base.__name__}", (base,), {})
                layer.__class__ = self._ckpt_classes[base]
                grad_checkpoint(layer)  # patches only the private subclass
            layer.__class__ = self._ckpt_classes[base]
        self.grad_checkpointing = enabled
        self._compiled = {}  # a traced forward would keep the blocks' previous __call__

    def set_activation_offload(self, enabled: bool) -> str | None:
        """No offload on MLX: memory is unified (Capabilities.no_activation_offload says so)."""
        return CAPABILITIES.no_activation_offload if enabled else None

    def offloaded_bytes(self) -> int | None:
        return None

    def set_loss_chunk(self, tokens: int) -> str | None:
        """The governor's lever: the following steps compute head + loss ``tokens`` target
        tokens at a time. None when applied, else why not (the loss is left as it was)."""
        from finetune.backends.mlx.loss import UnsupportedModel, check_chunkable

        if tokens > 0:
            try:
                check_chunkable(self.model)
            except UnsupportedModel as e:
                return str(e)
        self._loss_chunk = max(0, int(tokens))  # _loss reads it at every call
        self._compiled = {}  # a traced step would keep the loss it was traced with
        return None

    # ---- save / resume -----------------------------------------------------------------
    def save_adapter(self, path: Path | None) -> None:
        """Write the adapter (or, for method=full, an mlx-lm model directory) into ``path``;
        nothing when ``path`` is None (the ranks other than 0 under mlx.launch: every rank
        holds the same weights)."""
        if path is None:
            return
        path = Path(path)
        if self.method == "full":
            from mlx_lm.utils import save

            # A standalone mlx-lm model directory: `mlx_lm.generate --model PATH`.
            save(path, self.model_dir, self.outer, self.tokenizer, dict(self.model_config),
                 donate_model=False)
            return
        # in the names of the model mlx-lm loads (a multimodal wrapper's language_model.*)
        weights = {self.prefix + k: v for k, v in tree_flatten(self.model.trainable_parameters())}
        mx.save_safetensors(str(path / "adapters.safetensors"), weights)
        config = {
            "model": str(self.model_dir),
            # qlora is plain lora to mlx-lm (its base is what is quantized)
            "fine_tune_type": "dora" if self.method == "dora" else "lora",
            "num_layers": self.lora_layers,
            "lora_parameters": self.lora,
            # Informational: trained on this quantized base (mlx_lm.convert -q reproduces it).
            "quantization": self.quant,
            "pre_quantized": self.pre_quantized,  # the base checkpoint itself is quantized
        }
        (path / "adapter_config.json").write_text(json.dumps(config, indent=4))

    def save_state(self, path: Path | None) -> None:
        """Trainable weights, optimizer state and the RNG's micro-step count into ``path``;
        nothing when ``path`` is None (a rank other than 0: its state equals rank 0's)."""
        if path is None:
            return
        path = Path(path)
        params = dict(tree_flatten(self.model.trainable_parameters()))
        mx.save_safetensors(str(path / "trainable.safetensors"), params)
        # Includes "step" (bias correction) and "learning_rate".
        mx.save_safetensors(str(path / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
        meta = {"micro_steps": self._micro, "seed": self.seed}  # the RNG, see _reseed
        (path / "backend_state.json").write_text(json.dumps(meta))

    def load_state(self, path: Path) -> None:
        path = Path(path)
        params = mx.load(str(path / "trainable.safetensors"))
        expected = {k for k, _ in tree_flatten(self.model.trainable_parameters())}
        if set(params) != expected:
            raise ValueError(f"{path}: {len(params)} trainable tensors saved, this model has "
                             f"{len(expected)} (or other names): not its checkpoint")
        self.model.load_weights(list(params.items()), strict=False)
        state = mx.load(str(path / "optimizer.safetensors"))
        if set(state) - set(_SCALARS):  # per-parameter state exists: build its tree, then fill
            self.optimizer.init(self.model.trainable_parameters())
            self.optimizer.state = tree_map_with_path(lambda p, _: state[p], self.optimizer.state)
        else:
            for k, v in state.items():
                self.optimizer.state[k] = v
        meta = json.loads((path / "backend_state.json").read_text())
        self._micro = self._micro_at_step = int(meta["micro_steps"])
        self.seed = int(meta["seed"])
        self._grads = None
        self._compiled = {}  # the update traced the optimizer state dict this replaced
        mx.eval(self.model.parameters(), self.optimizer.state)

    # ---- memory ------------------------------------------------------------------------
    def memory(self) -> MemoryReading:
        if self._limits is None:
            # The limits change only through set_memory_limits, which keeps this current; read
            # once. There is no getter for the cache limit: swap in a harmless value and put the
            # old one back (each swap costs ~100 us).
            cache_limit = mx.set_cache_limit(mx.get_memory_limit())
            mx.set_cache_limit(cache_limit)
            info = self._device_info
            self._limits = {
                "device_total": info.get("memory_size") if _metal() else None,
                "mlx_memory_limit": mx.get_memory_limit(),
                "mlx_cache_limit": cache_limit,
                "mlx_wired_limit": self._wired_limit,  # None off Metal: nothing is wired on CPU
                "mlx_recommended_working_set": info.get("max_recommended_working_set_size"),
            }
        return MemoryReading(**self.peaks(), **self._limits)  # type: ignore[typeddict-item]

    def peaks(self) -> MemoryReading:
        """The allocator counters of memory(), without the limits and device facts: what the
        accountant folds into the run peak before reset_peak."""
        active, cache, peak = mx.get_active_memory(), mx.get_cache_memory(), mx.get_peak_memory()
        return {
            "allocated": active,
            "reserved": active + cache,
            # mx.reset_peak_memory() sets the peak to 0, not to the bytes still held; until the
            # next allocation the raw counter (mlx_peak) reads below active.
            "peak_allocated": max(peak, active),
            "peak_reserved": None,  # MLX keeps a peak of active bytes only
            "mlx_active": active,
            "mlx_cache": cache,
            "mlx_peak": peak,
        }

    def reset_peak(self) -> None:
        mx.reset_peak_memory()

    def census(self) -> Census:
        trainable = dict(tree_flatten(self.model.trainable_parameters()))
        quant_mods = {p for p, m in self.model.named_modules()
                      if hasattr(m, "bits") and "scales" in m}
        frozen = quant = 0
        for name, v in tree_flatten(self.model.parameters()):
            if name in trainable:
                continue
            mod, leaf = name.rsplit(".", 1)
            if mod in quant_mods and leaf in ("scales", "biases"):
                quant += v.nbytes
            else:
                frozen += v.nbytes  # packed quantized weights count here
        # Per-parameter state only: the 12 bytes of "step" (uint64) and "learning_rate"
        # (float32) scalars exist from construction and are left out, so this is 0 until
        # the first update creates the moments.
        state = sum(v.nbytes for k, v in tree_flatten(self.optimizer.state) if k not in _SCALARS)
        return {
            "frozen_weights": frozen,
            "trainable_weights": _nbytes(trainable),
            "grads": _nbytes(self._grads),
            "optimizer_state": state,
            "optimizer_state_paged": 0,
            "quant_buffers": quant,
        }

    def release_cache(self) -> None:
        mx.clear_cache()

    def set_memory_limits(self, budget_bytes: int) -> dict[str, Any]:
        """Apply ``budget_bytes`` as MLX's memory limit. The wired limit (Metal only) keeps up
        to the budget resident, never above the device's recommended working set. The cache
        limit is not derived from the budget (a quarter of a 192 GB Mac's budget is tens of
        GB of freed buffers held for reuse): the governor sets it from the measured step
        through ``set_cache_limit``."""
        budget = int(budget_bytes)
        out: dict[str, Any] = {"memory_limit": budget,
                               "memory_limit_prev": mx.set_memory_limit(budget)}
        out["wired_limit"] = out["wired_limit_prev"] = None
        if _metal():
            rec = mx.device_info().get("max_recommended_working_set_size") or budget
            out["wired_limit"] = min(budget, int(rec))
            out["wired_limit_prev"] = mx.set_wired_limit(out["wired_limit"])
            self._wired_limit = out["wired_limit"]
        self._limits = None  # memory() reads the new limits once
        return out

    def set_cache_limit(self, limit_bytes: int) -> int:
        """Cap the bytes of freed buffers MLX keeps for reuse; returns the previous cap. Buffers
        above the new cap are released now, not at the next free."""
        prev = int(mx.set_cache_limit(int(limit_bytes)))
        if mx.get_cache_memory() > limit_bytes:
            mx.clear_cache()
        self._limits = None
        return prev

    def generate(self, model_dir: Path, adapter: Path | None, prompt: Prompt, max_new_tokens: int, temperature: float,
                 seed: int, trust_remote_code: bool = False, allow_pickle: bool = False) -> str:
        """``mode=generate`` with the library's own generation (backends/mlx/generate.py)."""
        return generate(model_dir, adapter, prompt, max_new_tokens, temperature, seed,
                        trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)

    def eval_model(self, model_dir: Path, adapter: Path | None, batch_size: int, trust_remote_code: bool = False,
                   allow_pickle: bool = False) -> Any:
        """``mode=eval``: an lm-eval model (``lm_eval.api.model.LM``) on the base plus the adapter."""
        from finetune.backends.mlx.evaluate import eval_model

        return eval_model(model_dir, adapter, batch_size, trust_remote_code=trust_remote_code,
                          allow_pickle=allow_pickle)


BACKEND = MlxBackend  # what finetune.backends.runtimes.get_backend instantiates
