"""The mlx DPO step's forward and value_and_grad, padded rows against the shared-prompt row, on MLX's CPU backend.

    python benchmarks/profile_dpo_step_mlx.py                 # timings: padded, padded compiled, shared
    python benchmarks/profile_dpo_step_mlx.py --rss auto      # peak RSS of 4 steps; modes: auto small clear stepclear both

One process, the tiny Qwen2 of vs_peers.py (``--model tiny``) loaded by mlx-lm in fp32, LoRA r8 / scale 2
on q_proj and v_proj of every layer (random non-zero adapters), one micro-batch of 4 pairs: 8 rows of
380 tokens, each pair's rows sharing a prompt of 150-180 random tokens, completions of 170-200.

Timings (seconds, the mean of 2 calls after one warm-up): the forward of the rows' summed log-probs
(``preference.row_logps``: every position's whole logits; ``shared_prompt``: each prompt once, the
head on targets only), and ``nn.value_and_grad`` of a DPO sigmoid loss over them, evaluated; the
padded one also through ``mx.compile``. Printed too: the two paths' largest log-prob and gradient
differences.

``--rss MODE``: 4 steps (a no-grad reference pass with the adapters off, then value_and_grad) of
shared-prompt rows of 350-380 tokens, under ``mx.set_cache_limit`` 300 MiB (what
memory.cache_limit=auto sets after step 1 here) or 32 MiB (``small``), MLX's cache released after the
reference pass (``clear``), after the step (``stepclear``) or both; the process's peak RSS
(``ru_maxrss``) and MLX's peak.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def _model() -> Any:
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load
    from mlx.utils import tree_map
    from vs_peers import MODELS

    from finetune.config import compose
    from finetune.model.source import resolve_model_dir

    model, _ = load(str(resolve_model_dir(compose("/tmp/unused", *MODELS["tiny"]).model)))
    model.set_dtype(mx.float32)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 2.0, "dropout": 0.0,
                                                     "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    mx.random.seed(0)
    model.update(tree_map(lambda x: mx.random.normal(x.shape) * 0.05, model.trainable_parameters()))
    model.train()
    return model


def _batch(rng: Any, T: int, prompts: list[int], completions: list[tuple[int, int]]) -> tuple[Any, Any]:
    import numpy as np

    P = len(prompts)
    ids = rng.integers(1, 2000, (2 * P, T)).astype(np.int32)
    mask = np.zeros((2 * P, T), np.float32)
    for k, (p, (lc, lr)) in enumerate(zip(prompts, completions)):
        ids[2 * k + 1, :p] = ids[2 * k, :p]
        for row, n in ((2 * k, lc), (2 * k + 1, lr)):
            end = min(p + n, T)
            mask[row, p:end] = 1
            ids[row, end:] = 0
    return ids, mask


def timings() -> None:
    import mlx.core as mx
    import numpy as np
    from mlx import nn
    from mlx.utils import tree_flatten

    from finetune.backends.mlx.preference import row_logps
    from finetune.backends.mlx.shared_prompt import Layout, shared_rows

    model = _model()
    ids, mask = _batch(np.random.default_rng(0), 380, [150, 160, 170, 180],
                       [(180, 170), (185, 177), (190, 184), (195, 191)])
    I, M = mx.array(ids), mx.array(mask)
    lay = Layout(ids, mask)
    print(f"8 rows x 380 = {ids.size} padded positions; shared-prompt row {lay.ids.shape[1]} positions "
          f"({lay.shared} prompt positions run once)")

    def t(name: str, f: Any, n: int = 2) -> None:
        f()
        s = time.perf_counter()
        for _ in range(n):
            f()
        print(f"  {name:38} {(time.perf_counter() - s) / n:7.2f} s", flush=True)

    def dpo(lp: mx.array) -> mx.array:
        return -nn.log_sigmoid(0.1 * (lp[0::2] - lp[1::2])).sum()

    padded = nn.value_and_grad(model, lambda: dpo(row_logps(model, I, M)[0]))
    with shared_rows(model, ids, mask) as run:
        shared = nn.value_and_grad(model, lambda: dpo(run()))
        a, (_, g_s) = run(), shared()
        mx.eval(a, g_s)
        t("shared: forward (log-probs)", lambda: mx.eval(run()))
        t("shared: value_and_grad", lambda: mx.eval(shared()))
    b = row_logps(model, I, M)[0]
    _, g_p = padded()
    mx.eval(b, g_p)
    t("padded: forward (log-probs)", lambda: mx.eval(row_logps(model, I, M)[0]))
    t("padded: value_and_grad", lambda: mx.eval(padded()))
    state = [model.state, mx.random.state]
    compiled = mx.compile(padded, inputs=state, outputs=state)
    t("padded: value_and_grad, mx.compile", lambda: mx.eval(compiled()))
    gd = max(float(mx.abs(x - y).max()) for (_, x), (_, y) in zip(tree_flatten(g_s), tree_flatten(g_p)))
    print(f"  largest difference: log-probs {float(mx.abs(a - b).max()):.3g}, gradients {gd:.3g}")


def rss(mode: str) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx import nn

    from finetune.backends.mlx.preference import adapters_off
    from finetune.backends.mlx.shared_prompt import shared_rows

    model = _model()
    rng = np.random.default_rng(0)

    def loss(run: Any, ref: mx.array) -> mx.array:
        lp = run()
        return -nn.log_sigmoid(0.1 * ((lp[0::2] - lp[1::2]) - (ref[0::2] - ref[1::2]))).sum()

    vg = nn.value_and_grad(model, loss)
    mx.set_cache_limit((32 if mode == "small" else 300) << 20)
    peak = 0
    for T in (370, 350, 380, 360):
        ids, mask = _batch(rng, T, [T // 2] * 4, [(T // 2 - 3, T // 2 - 1 - k) for k in range(4)])
        mx.reset_peak_memory()
        with shared_rows(model, ids, mask) as run:
            with adapters_off(model):
                ref = mx.stop_gradient(run())
                mx.eval(ref)
            if mode in ("clear", "both"):
                mx.clear_cache()
            mx.eval(vg(run, ref))
        if mode in ("stepclear", "both"):
            mx.clear_cache()
        peak = max(peak, mx.get_peak_memory())
    print(f"--rss {mode}: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, "
          f"MLX peak {peak / 2 ** 20:.0f} MiB, cache at the end {mx.get_cache_memory() / 2 ** 20:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rss", choices=("auto", "small", "clear", "stepclear", "both"))
    a = ap.parse_args()
    rss(a.rss) if a.rss else timings()


if __name__ == "__main__":
    main()
