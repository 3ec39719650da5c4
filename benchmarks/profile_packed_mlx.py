"""Where an MLX packed step's time goes against the same samples unpacked (issue 23's profile).

    python benchmarks/profile_packed_mlx.py                  # tiny, 8 GSM8K chat samples, 5 repeats
    python benchmarks/profile_packed_mlx.py --model medium --repeats 3

One forward + backward (``nn.value_and_grad`` of ``token_loss_sum``, target-only head, LoRA r8 on
q/v as vs_peers.py) of the same 8 samples, the loss and gradients evaluated, timed per variant
with the variants interleaved; medians:

- ``unpacked``: the 8 samples as one [8, T] batch right-padded to the longest (what ours
  unpacked runs: lengths grouped, causal mask).
- ``packed``: one row of the 8 samples end to end, positions restarting per sample; attention per
  sample (``backends/mlx/loss.py`` ``packed``, the path training takes).
- ``packed_block_mask``: the same row through the [N, N] block-diagonal mask instead.
- ``alone``: each sample as its own [1, n] batch, the 8 summed: the compute a perfect packed
  row would do.

Then the parts in isolation on the packed row's shapes: RoPE at per-token offsets (what
``_PackedRoPE`` does) against one offset per row, and attention per sample against the whole
row's causal kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from mlx_footprint import GSM8K
from peers_data import _messages, gsm8k_rows
from vs_peers import MODELS, SEQ


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()

    from finetune.backends.base import pack
    from finetune.backends.mlx import loss as L
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load
    from transformers import AutoTokenizer

    from finetune.config import compose
    from finetune.data import tokenize
    from finetune.data.batches import collate
    from finetune.model.source import resolve_model_dir

    model_dir = resolve_model_dir(compose("/tmp/unused", *MODELS[a.model]).model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model, _ = load(str(model_dir))
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 2.0, "dropout": 0.0,
                                                     "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    model.train()
    # the samples exactly as ours trains them (finetune.data: chat template, EOS, the prompt out of
    # the loss), one padded batch (collate) and the same batch packed into one row (pack)
    data = tokenize(({"messages": _messages(r)} for r in gsm8k_rows(GSM8K, a.samples)), tok, SEQ, True)
    samples = [np.asarray(x) for x in data.ids]
    masks = [np.asarray(m) for m in data.masks]
    lens = [len(x) for x in samples]
    batch = collate(samples, masks, np.arange(len(samples)), pad_id=0)
    row = pack(batch, sum(lens))[0]
    ids_u, mask_u = batch.input_ids, batch.loss_mask.astype(np.float32)
    ids_p, mask_p, pos_p = row.input_ids, row.loss_mask.astype(np.float32), row.position_ids
    T = ids_u.shape[1]
    print(f"model {a.model} ({model_dir.name}); {len(samples)} GSM8K chat samples, lengths {lens} "
          f"({sum(lens)} tokens; unpacked [{len(samples)}, {T}] = {len(samples) * T} positions, "
          f"{100 * (1 - sum(lens) / (len(samples) * T)):.0f}% pads)")

    vg = nn.value_and_grad(model, lambda i, m, c: L.token_loss_sum(model, i, m, 0, grad=True, cache=c))

    def run(ids: np.ndarray, mask: np.ndarray, pos: np.ndarray | None, block: bool = False) -> None:
        if block:
            L._PER_SAMPLE_REFUSED[id(model)] = __import__("weakref").ref(model)
        try:
            with L.packed(model, None if pos is None else mx.array(pos)) as cache:
                loss, grads = vg(mx.array(ids), mx.array(mask), cache)
                mx.eval(loss, grads)
        finally:
            L._PER_SAMPLE_REFUSED.pop(id(model), None)

    variants = {
        "unpacked": lambda: run(ids_u, mask_u, None),
        "packed": lambda: run(ids_p, mask_p, pos_p),
        "packed_block_mask": lambda: run(ids_p, mask_p, pos_p, block=True),
        "alone": lambda: [run(s[None], m[None].astype(np.float32), None) for s, m in zip(samples, masks)],
    }
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.repeats):
        for k, fn in variants.items():
            times[k] += _timed(fn, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"forward + backward, median of {a.repeats} (interleaved):")
    for k, v in med.items():
        print(f"  {k:18} {v * 1e3:9.1f} ms   {v / med['unpacked']:.2f}x unpacked   "
              f"{sum(lens) / v:8.0f} real tok/s")

    # the parts, in isolation, on the packed row's shapes (first layer's attention)
    attn = model.layers[0].self_attn
    H, D = attn.n_heads, attn.head_dim if hasattr(attn, "head_dim") else model.args.hidden_size // attn.n_heads
    N = int(ids_p.shape[1]) - 1
    x = mx.random.normal((1, H, N, D))
    xu = mx.random.normal((len(samples), H, T - 1, D))
    pos = mx.array(pos_p.reshape(-1)[:N])
    rope = attn.rope

    def g(f):
        return lambda: mx.eval(mx.grad(lambda y: f(y).sum())(x))

    def gu(f):
        return lambda: mx.eval(mx.grad(lambda y: f(y).sum())(xu))

    parts = {
        "rope per token (packed row)": g(lambda y: rope(y.swapaxes(0, 2), offset=pos).swapaxes(0, 2)),
        "rope offset 0 (packed row)": g(lambda y: rope(y)),
        "rope offset 0 ([8, T] batch)": gu(lambda y: rope(y)),
        "sdpa per sample (packed row)": g(lambda y: mx.concatenate(
            [mx.fast.scaled_dot_product_attention(y[:, :, s:e], y[:, :, s:e], y[:, :, s:e], scale=D ** -0.5,
                                                  mask="causal")
             for s, e in L._PackedCache(mx.array(pos_p[:, :N])).spans], axis=2)),
        "sdpa causal ([8, T] batch)": gu(lambda y: mx.fast.scaled_dot_product_attention(y, y, y, scale=D ** -0.5,
                                                                                           mask="causal")),
    }
    for fn in parts.values():
        fn()
    pt = {k: statistics.median(_timed(fn, a.repeats)) for k, fn in parts.items()}
    print(f"one layer's parts, forward + backward, median of {a.repeats} ([1, {H}, {N}, {D}] packed; "
          f"[{len(samples)}, {H}, {T - 1}, {D}] unpacked):")
    for k, v in pt.items():
        print(f"  {k:30} {v * 1e3:8.2f} ms")
    print(f"trainable parameters: {sum(p.size for _, p in tree_flatten(model.trainable_parameters())):,}")


if __name__ == "__main__":
    main()
