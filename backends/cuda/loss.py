"""The token loss of the ``cuda`` backend, whole or a chunk of tokens at a time (``train.loss_chunk``).

The largest tensor of a large-vocabulary step is the logits: [B, T, V] in fp32, with Qwen2's
152,064-entry vocabulary 4 x 2048 x 152,064 x 4 B = 4.6 GiB for one micro-batch of 4 x 2048, and
cross-entropy keeps a second tensor of that size (its log-softmax) for backward. With
``chunk > 0`` the model runs its body only and the head + fp32 cross-entropy run ``chunk``
target tokens at a time, so at most one chunk's [chunk, V] logits exist at once:

- Where Liger Kernel is importable and the tensors are on CUDA, its fused linear cross-entropy
  (Triton; ``liger_kernel.transformers.functional.liger_fused_linear_cross_entropy``) does it.
  Not exercised here: this project's test machines have no GPU, and Liger needs one.
- Everywhere else, ``_ChunkedHeadLoss`` below does in torch what Liger does in Triton: each
  chunk's gradient (with respect to the hidden states and the head's trainable parameters) is
  taken right there in the forward pass, while its logits exist, and only those gradients
  ([N, H] for the hidden states, the head's own parameter shapes) are kept for backward, which
  scales them by the incoming gradient. The head's matmul runs three times per token as in the
  unchunked loss (one forward, two backward), none recomputed: checkpointing each chunk
  instead would add a fourth.

Only target tokens (loss mask 1) go through the head, chunked or not (``target_head``): the
model runs its body, the hidden states of target positions are gathered, and the head and
cross-entropy run on those alone. A masked position adds 0 to the sum and nothing to any
gradient, so skipping it changes no number and saves its share of the head's matmul and of
the [N, V] logits (prompts and padding: often more than half the tokens of chat data).

What a model does to its logits after the head, position by position, the head's chunks do too
(``post_head``: Gemma-2/3's final soft-capping, Granite's ``logits_scaling``, Cohere's
``logit_scale``, read from its config), so those models get the target-only head and the
chunked loss as well. Every model is checked once (``_check_head``): its logits must equal
that transform of its head applied to its hidden states; one that does something else
computes every position's logits as before, and ``head_fallback`` says why.

Both paths follow the convention of ``backends/base.py``: the sum of fp32 per-token
cross-entropy over targets ``input_ids[:, 1:]`` weighted by ``loss_mask[:, 1:]``.
"""

from __future__ import annotations

import importlib.util
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from finetune.errors import UserError

AutocastFactory = Callable[[], AbstractContextManager]
_HEAD_CHECKED: weakref.WeakSet = weakref.WeakSet()  # models whose logits are exactly head(hidden)
_HEAD_REFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model: why its head runs everywhere
_LIGER = importlib.util.find_spec("liger_kernel") is not None



class UnsupportedModel(ValueError):
    """``chunk > 0`` on a model the chunked loss cannot reproduce exactly (its logits are not its
    head applied to the hidden states it feeds the head). The message names the fix."""

def token_loss_sum(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   loss_mask: torch.Tensor, chunk: int, autocast_ctx: AutocastFactory,
                   liger: bool = True, position_ids: torch.Tensor | None = None,
                   target_head: bool = True) -> torch.Tensor:
    """Sum of fp32 token cross-entropy over target positions, as a 0-dim fp32 tensor.

    Args:
        model: a transformers causal LM, or a PEFT model wrapping one (what ``CudaBackend.model``
            holds); called with ``input_ids``, ``attention_mask`` and ``use_cache=False``.
        input_ids: [B, T] int64 on the model's input device; targets are ``input_ids[:, 1:]``.
        attention_mask: [B, T], 1 for real tokens; None for right-padded rows of a causal model
            (a pad comes after every real token of its row, so no real token sees it).
        loss_mask: [B, T] (the batch's own ``loss_mask``, any device; float or int): the weight
            of each position as a target; column 0 is never a target and is ignored.
        chunk: target tokens per chunk of the head + cross-entropy; 0 computes the full
            [B, T, V] logits as the unchunked loss always did.
        autocast_ctx: a zero-argument factory of the autocast context (``CudaBackend._autocast``),
            entered around the model body and around each chunk's head, as the unchunked forward
            runs the head under it.
        liger: use Liger's fused kernel where it can run (CUDA tensors, a plain ``nn.Linear``
            head, 0/1 mask, gradients wanted); False forces the torch path.
        position_ids: [1, N] for a packed row (``Batch.position_ids``), restarting at 0 at each
            sample, with ``attention_mask`` None: transformers then builds the block-diagonal
            causal mask from them (masking_utils ``find_packed_sequence_indices``; sdpa and
            eager get it as a 4-D mask, flash-attention varlen as cu_seqlens). None: positions
            0..T-1 in every row.
        target_head: with ``chunk = 0``, run the head on target positions only (the loss and
            gradients are the same within float rounding) where the model allows it
            (``head_fallback``); False computes every position's logits.

    Raises:
        UnsupportedModel: (a ValueError) ``chunk > 0`` on a model whose logits are not its head
            applied to the hidden states (soft-capping, a logit scale): the chunked path
            cannot reproduce them.
    """
    if chunk <= 0 and not (target_head and _head_applies(model, input_ids, attention_mask, autocast_ctx)):
        return _full_loss_sum(model, input_ids, attention_mask, loss_mask, autocast_ctx, position_ids)
    hook = output_head(model)
    hidden = _body(model, hook, input_ids, attention_mask, autocast_ctx, position_ids)
    head = head_call(model, hook)
    flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # position t predicts token t + 1
    targets = input_ids[:, 1:].reshape(-1)
    weights = loss_mask[:, 1:].reshape(-1).float()
    # The mask comes from the host (numpy) in CudaBackend, so choosing rows costs no device sync.
    rows = weights.nonzero().squeeze(1)
    if rows.numel() == 0:
        return flat[:0].float().sum()  # 0, still part of the graph so backward() runs
    unit = bool((weights[rows] == 1).all())  # on the host too: Liger has no per-token weights
    rows = rows.to(flat.device)
    flat = flat.index_select(0, rows)
    targets = targets.to(flat.device).index_select(0, rows)
    weights = weights.to(flat.device).index_select(0, rows)
    if chunk <= 0:  # the target rows' logits at once, autograd keeping them as the full loss does
        return _chunk_loss(head, flat, targets, weights, autocast_ctx)
    if liger and unit and _liger_can_run(head, flat):
        return _liger_loss_sum(head, flat, targets, autocast_ctx)
    params = [p for p in head.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (flat.requires_grad or params):
        return _chunks_no_grad(head, flat, targets, weights, chunk, autocast_ctx)
    return _ChunkedHeadLoss.apply(head, autocast_ctx, chunk, targets, weights, flat, *params)


def head_fallback(model: torch.nn.Module) -> str | None:
    """Why ``model``'s head runs on every position although ``target_head`` asked for targets
    only (its logits are not its head applied to its hidden states), once checked; else None."""
    return _HEAD_REFUSED.get(model)


def _head_applies(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  autocast_ctx: AutocastFactory) -> bool:
    """Whether the head may run on target rows only: the check ``_check_head`` makes for the
    chunked loss, made once per model; a refusal is kept (``head_fallback``) and not retried."""
    if model in _HEAD_CHECKED:
        return True
    if model in _HEAD_REFUSED:
        return False
    try:
        _check_head(model, output_head(model), input_ids[:1, :8],
                    None if attention_mask is None else attention_mask[:1, :8], autocast_ctx)
    except UnsupportedModel as e:
        _HEAD_REFUSED[model] = str(e).replace("train.loss_chunk: ", "").split("; set ")[0]
        return False
    return True


def check_chunkable(model: torch.nn.Module, device: torch.device, autocast_ctx: AutocastFactory) -> None:
    """Raise UnsupportedModel unless the chunked loss reproduces ``model``'s loss: it names an
    output head, and its logits are that head applied to the hidden states (checked once per
    model, on 8 tokens in eval mode). For a caller turning the chunked loss on mid-run."""
    head = output_head(model)
    if model not in _HEAD_CHECKED:
        ids = torch.arange(8, device=device)[None, :]
        _check_head(model, head, ids, torch.ones_like(ids), autocast_ctx)


# config fields of transformers models whose forward transforms the head's output position by
# position, and the transform (modeling_gemma2.py / gemma3: logits / cap, tanh, * cap;
# modeling_granite.py: logits / logits_scaling; modeling_cohere.py: logits * logit_scale)
_POST_HEAD: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "final_logit_softcapping": lambda x, cap: torch.tanh(x / cap) * cap,
    "logits_scaling": lambda x, v: x / v,
    "logit_scale": lambda x, v: x * v,
}


class _PostHead(torch.nn.Module):
    """The head followed by what the model does to its logits (``post_head``); its parameters
    are the head's own."""

    def __init__(self, head: torch.nn.Module, field: str, value: float):
        super().__init__()
        self.head, self.field, self.value = head, field, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _POST_HEAD[self.field](self.head(x), self.value)


def post_head(model: torch.nn.Module) -> tuple[str, float] | None:
    """(config field, value) of the transform ``model``'s forward applies to its head's output
    (``_POST_HEAD``), or None. The one-time ``_check_head`` proves it numerically."""
    inner = getattr(model, "module", model)
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    cfg = getattr(inner, "config", None)
    for field in _POST_HEAD:
        v = getattr(cfg, field, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and float(v) != 1.0:
            return field, float(v)
    return None


def head_call(model: torch.nn.Module, head: torch.nn.Module) -> torch.nn.Module:
    """What maps hidden states to the model's logits: ``head``, or ``head`` and the model's
    transform of its output (``post_head``)."""
    post = post_head(model)
    return head if post is None else _PostHead(head, *post)


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The module that maps the last hidden states to logits (``lm_head``, or the embedding
    when tied, as transformers resolves it), through DDP and PEFT wrappers. A LoRA adapter on
    the head is part of the module returned."""
    inner = getattr(model, "module", model)  # DistributedDataParallel
    if hasattr(inner, "get_base_model"):  # peft.PeftModel
        inner = inner.get_base_model()
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise UnsupportedModel(f"train.loss_chunk: {type(inner).__name__} names no output head "
                         "(get_output_embeddings); set train.loss_chunk=0")
    return head


def _full_loss_sum(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   loss_mask: torch.Tensor, autocast_ctx: AutocastFactory,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    # The unchunked loss, op for op as CudaBackend._loss_sum computed it before chunking existed.
    with autocast_ctx():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                       **_positions(position_ids)).logits
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:].to(logits.device)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    mask = loss_mask[:, 1:].float()
    return (ce.view_as(targets) * mask.to(ce.device)).sum()


def _positions(position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The model's keyword for a packed row's positions; none for an unpacked batch (the model
    counts 0..T-1 itself, as it always did)."""
    return {} if position_ids is None else {"position_ids": position_ids}


def _body(model: torch.nn.Module, head: torch.nn.Module, input_ids: torch.Tensor,
          attention_mask: torch.Tensor | None, autocast_ctx: AutocastFactory,
          position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, H]: what the model feeds its head, from the model's own forward.

    A pre-hook on the head keeps its input and hands the head the last position only, so the
    model computes [B, 1, V] logits instead of [B, T, V] and everything before the head (final
    norm, any scaling, PEFT, DDP) stays the model's own. The model's [B, 1, V] output is dropped.
    """
    if model not in _HEAD_CHECKED:
        _check_head(model, head, input_ids[:1, :8], None if attention_mask is None else attention_mask[:1, :8],
                    autocast_ctx)
    hidden, _ = _forward_keeping_head_input(model, head, input_ids, attention_mask, autocast_ctx, position_ids)
    return hidden


def _forward_keeping_head_input(model: torch.nn.Module, head: torch.nn.Module, input_ids: torch.Tensor,
                                attention_mask: torch.Tensor | None, autocast_ctx: AutocastFactory,
                                position_ids: torch.Tensor | None = None) -> tuple:
    kept: dict[str, torch.Tensor] = {}

    def keep_last(module: torch.nn.Module, args: tuple) -> tuple:
        kept["hidden"] = args[0]
        return (args[0][:, -1:], *args[1:])

    handle = head.register_forward_pre_hook(keep_last)
    try:
        with autocast_ctx():
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                        **_positions(position_ids))
    finally:
        handle.remove()
    hidden = kept.get("hidden")
    if hidden is None or hidden.dim() != 3 or hidden.shape[:2] != input_ids.shape:
        raise UnsupportedModel("train.loss_chunk: the model did not call its output head on [B, T, H] "
                         "hidden states; set train.loss_chunk=0")
    return hidden, out


def _check_head(model: torch.nn.Module, head: torch.nn.Module, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, autocast_ctx: AutocastFactory) -> None:
    """Once per model, on a few tokens in eval mode (no dropout, no RNG drawn): the model's
    logits must be its head applied to what it feeds the head. A model that transforms logits
    after the head (soft-capping, a logit scale) is refused rather than trained on a different
    loss."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            hidden, out = _forward_keeping_head_input(model, head, input_ids, attention_mask, autocast_ctx)
            with autocast_ctx():
                again = head_call(model, head)(hidden[:, -1:])
    finally:
        model.train(was_training)
    if not torch.allclose(again.float(), out.logits.float(), rtol=1e-5, atol=1e-6):
        post = post_head(model)
        how = f"then {post[0]}={post[1]:g}" if post else "nor a soft-cap or logit scale finetune knows after it"
        raise UnsupportedModel("train.loss_chunk: this model's logits are not its output head applied "
                               f"to the hidden states ({how}), which the chunked loss would not "
                               "reproduce; set train.loss_chunk=0")
    _HEAD_CHECKED.add(model)


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                weights: torch.Tensor, autocast_ctx: AutocastFactory) -> torch.Tensor:
    with autocast_ctx():
        logits = head(hidden)
    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    return (ce * weights).sum()


def _chunks_no_grad(head: torch.nn.Module, flat: torch.Tensor, targets: torch.Tensor,
                    weights: torch.Tensor, chunk: int, autocast_ctx: AutocastFactory) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    for s in range(0, flat.shape[0], chunk):
        total += _chunk_loss(head, flat[s:s + chunk], targets[s:s + chunk], weights[s:s + chunk],
                             autocast_ctx)
    return total


class _ChunkedHeadLoss(torch.autograd.Function):
    """loss = sum_chunks sum_t w_t CE(head(h_t), y_t), with each chunk's gradient taken in forward.

    Inputs after the constants: ``flat`` [N, H] hidden states of the target tokens, then the
    head's trainable parameters (passed so autograd routes their gradients through backward).
    Saved for backward: d loss / d flat ([N, H], flat's dtype) and, per trainable head
    parameter, its gradient summed over chunks in fp32 (a bf16 weight would otherwise lose
    precision summing chunk by chunk); nothing [N, V].
    """

    @staticmethod
    def forward(ctx: Any, head: torch.nn.Module, autocast_ctx: AutocastFactory, chunk: int,
                targets: torch.Tensor, weights: torch.Tensor, flat: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        need_h = ctx.needs_input_grad[5]
        need_p = ctx.needs_input_grad[6:]
        wanted = [p for p, need in zip(params, need_p) if need]
        grad_h = torch.empty_like(flat) if need_h else None
        grad_p = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in wanted]
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for s in range(0, flat.shape[0], chunk):
            h = flat[s:s + chunk].detach().requires_grad_(need_h)
            with torch.enable_grad():
                part = _chunk_loss(head, h, targets[s:s + chunk], weights[s:s + chunk], autocast_ctx)
            grads = torch.autograd.grad(part, ([h] if need_h else []) + wanted)
            if grad_h is not None:  # need_h
                grad_h[s:s + chunk] = grads[0]
                grads = grads[1:]
            for acc, g in zip(grad_p, grads):
                acc += g
            total += part.detach()
        # saved as tensors (not ctx attributes), so saved-tensor hooks and offloading see them
        ctx.save_for_backward(*([grad_h] if need_h else []), *grad_p)
        ctx.layout = (need_h, tuple(need_p), tuple(p.dtype for p in wanted))
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        need_h, need_p, dtypes = ctx.layout
        saved = list(ctx.saved_tensors)
        grad_h = saved.pop(0) * grad_out if need_h else None  # a 0-dim factor keeps flat's dtype
        grads = iter((g * grad_out).to(dt) for g, dt in zip(saved, dtypes))
        grad_params = [next(grads) if need else None for need in need_p]
        return (None, None, None, None, None, grad_h, *grad_params)


def _liger_can_run(head: torch.nn.Module, flat: torch.Tensor) -> bool:
    """Liger's fused kernel reproduces this loss only for a plain linear head (no LoRA on it,
    not quantized), on CUDA, when gradients are wanted (under no_grad the torch path is as lean
    and needs no kernel). The caller has checked that every kept target weighs 1."""
    return _LIGER and flat.is_cuda and type(head) is torch.nn.Linear and torch.is_grad_enabled()


def _liger_loss_sum(head: torch.nn.Linear, flat: torch.Tensor, targets: torch.Tensor,
                    autocast_ctx: AutocastFactory) -> torch.Tensor:
    """Liger's fused linear cross-entropy over the kept targets, reduction "sum".

    Written against liger-kernel 0.5/0.6 (``liger_fused_linear_cross_entropy(input, weight,
    target, bias=..., ignore_index=..., reduction=...)``, keywords only, since the positional
    order changed between releases) and not run here: no GPU on this project's test machines.
    Masked targets never reach it (the caller keeps target rows only), so ``ignore_index`` is
    the default -100 that no token id takes. Autocast is applied by hand: under autocast the
    head's inputs are cast to the autocast dtype (what the unchunked head's matmul uses) and the
    kernel runs with autocast off, so its own matmuls are not autocast piecemeal; it upcasts the
    logits to fp32 for the cross-entropy itself.
    """
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    with autocast_ctx():
        on = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda") if on else head.weight.dtype
        with torch.autocast("cuda", enabled=False):
            bias = None if head.bias is None else head.bias.to(dtype)
            loss = liger_fused_linear_cross_entropy(flat.to(dtype), head.weight.to(dtype), targets,
                                                    bias=bias, ignore_index=-100, reduction="sum")
    loss = loss[0] if isinstance(loss, tuple) else loss  # (loss, z_loss) in some releases
    return loss.float()


# ---- train.compile ---------------------------------------------------------------------------

def compile_loss(device: torch.device, chunk: int, strategy: str | None) -> Callable:
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
    return torch.compile(token_loss_sum)


def is_compile_failure(err: Exception) -> bool:
    """Whether ``err`` is torch.compile failing to build (not the step failing to run)."""
    from torch._dynamo.exc import BackendCompilerFailed

    return isinstance(err, BackendCompilerFailed) or type(err).__module__.startswith("torch._inductor")
