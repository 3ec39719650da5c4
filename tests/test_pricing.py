"""The planner's pure pricing functions, by hand: bytes of one quantized weight, of one
tensor's optimizer state, the GPU split, and the error arithmetic of plan_error. Each case
is worked from the rule the function's docstring cites (bitsandbytes, mlx, torch, accelerate),
so a changed constant or branch shows up as a wrong byte count, not a shifted tolerance."""

from __future__ import annotations

import pytest

from finetune import planner
from finetune.errors import UserError


def test_bnb4_bytes_by_hand():
    # 4096 weights, blocks of 64: 2048 packed bytes (two 4-bit codes a byte), 64 blocks;
    # every QuantState holds the 16-entry fp32 code (64 B)
    assert planner.bnb4_bytes(4096, double_quant=False) == (2048, 64 * 4 + 64)  # fp32 absmax per block
    # double quant: uint8 absmax per block (64), fp32 absmax per 256 of them (1 -> 4 B), the
    # nested 256-entry fp32 code (1024 B) and the 0-d fp32 offset (4 B)
    assert planner.bnb4_bytes(4096, double_quant=True) == (2048, 64 + 4 + 1024 + 4 + 64)
    # an odd count rounds the packing and the blocks up: 65 blocks
    assert planner.bnb4_bytes(4097, double_quant=True) == (2049, 65 + 4 + 1024 + 4 + 64)
    # 257 blocks need two nested blocks
    assert planner.bnb4_bytes(64 * 257, double_quant=True) == (32 * 257, 257 + 2 * 4 + 1024 + 4 + 64)
    assert planner.bnb4_bytes(4096, double_quant=False, blocksize=128) == (2048, 32 * 4 + 64)


def test_mlx_quant_bytes_by_hand():
    # 4 bits: 8 weights per uint32 word; a scale and a bias per group of 64, in fp32
    assert planner.mlx_quant_bytes(64, 128, bits=4, group=64, scale_bytes=4) == (64 * 128 // 2, 2 * 64 * 2 * 4)
    # 8 bits: one byte a weight; groups of 32 in bf16
    assert planner.mlx_quant_bytes(32, 64, bits=8, group=32, scale_bytes=2) == (32 * 64, 2 * 32 * 2 * 2)


@pytest.mark.parametrize("args,expected", [
    # Adam/AdamW: exp_avg + exp_avg_sq in the parameter's dtype; torch's host `step` scalar
    # beside CPU parameters is 4 more bytes, mlx keeps no per-tensor step
    (("adamw", "cuda", (64, 64), 4, False), (2 * 4096 * 4, 0)),
    (("adamw", "cuda", (64, 64), 4, False, 0.0, True), (2 * 4096 * 4 + 4, 0)),
    (("adamw", "mlx", (64, 64), 4, False, 0.0, True), (2 * 4096 * 4, 0)),
    (("adam", "cuda", (64, 64), 2, True), (2 * 4096 * 2, 0)),
    # SGD: torch keeps a momentum buffer only with momentum; mlx keeps "v" always
    (("sgd", "cuda", (64, 64), 4, True), (0, 0)),
    (("sgd", "cuda", (64, 64), 4, True, 0.9), (4096 * 4, 0)),
    (("sgd", "mlx", (64, 64), 2, False), (4096 * 2, 0)),
    # Adafactor, factored: a row and a column vector (64 + 128); 1-D: a full vector
    (("adafactor", "mlx", (64, 128), 2, False), ((64 + 128) * 2, 0)),
    (("adafactor", "mlx", (64,), 2, False), (64 * 2, 0)),
    # transformers' Adafactor keeps fp32 state and a 0-d fp32 RMS
    (("adafactor", "cuda", (64, 128), 2, True), ((64 + 128) * 4 + 4, 0)),
    (("adafactor", "cuda", (64,), 2, True), (64 * 4 + 4, 0)),
    # 8-bit: uint8 m and v + fp32 absmax per 256-element block, from 4096 elements up
    (("adamw_8bit", "cuda", (4096,), 2, True), (2 * 4096 + 2 * 16 * 4, 0)),
    (("adamw_8bit", "cuda", (4095,), 2, True), (2 * 4095 * 4, 0)),  # below: fp32 m and v
    # paged: the uint8 states of a tensor of >= 1e5 elements go to unified memory on a GPU
    (("paged_adamw_8bit", "cuda", (100_000,), 2, True), (2 * 391 * 4, 2 * 100_000)),
    (("paged_adamw_8bit", "cuda", (99_999,), 2, True), (2 * 391 * 4 + 2 * 99_999, 0)),
    (("paged_adamw_8bit", "cuda", (100_000,), 2, False), (2 * 391 * 4 + 2 * 100_000, 0)),  # CPU: no paging
    (("paged_adamw", "cuda", (100_000,), 2, True), (0, 2 * 100_000 * 4)),  # 32-bit, paged
    (("paged_adamw", "cuda", (4096,), 2, True), (2 * 4096 * 4, 0)),
])
def test_optimizer_state_bytes_by_hand(args, expected):
    assert planner.optimizer_state_bytes(*args) == expected


def test_optimizer_state_bytes_rejects_an_unknown_optimizer():
    with pytest.raises(UserError, match="optim=lion is not valid"):
        planner.optimizer_state_bytes("lion", "cuda", (4, 4), 4, False)


def test_split_layers_by_hand():
    """accelerate's balanced caps: total // N + 1.25 x max(largest layer, mean module), GPU 0
    keeping room for the largest layer, the last GPU taking the rest."""
    sizes = [("embed", 100)] + [(f"layer.{i}", 100) for i in range(4)] + [("head", 100)]
    assert planner._split_layers(sizes, 1) == dict.fromkeys(dict(sizes), 0)
    # N=2: cap = 600 // 2 + 125 = 425, GPU 0 gets 425 - 100 = 325: three modules of 100
    assert planner._split_layers(sizes, 2) == {"embed": 0, "layer.0": 0, "layer.1": 0,
                                               "layer.2": 1, "layer.3": 1, "head": 1}
    # N=3: cap = 200 + 125 = 325; GPU 0: 225 (two modules), GPU 1: 325 (three), GPU 2: the rest
    assert planner._split_layers(sizes, 3) == {"embed": 0, "layer.0": 0, "layer.1": 1,
                                               "layer.2": 1, "layer.3": 1, "head": 2}


def test_plan_error_arithmetic():
    plan = {"bytes": {"weights": 100, "trainable_weights": 10, "grads": 10, "optimizer_state": 0,
                      "optimizer_state_paged": 5},
            "steady_state_allocated_bytes": 150, "peak_allocated_bytes": None}
    census = {"frozen_weights": 60, "trainable_weights": 10, "quant_buffers": 10, "grads": 0,
              "optimizer_state": 0, "optimizer_state_paged": 0}
    err = planner.plan_error(plan, census, {"allocated": 120, "step_peak_allocated": 400})
    assert err["weights"] == {"predicted": 100, "measured": 80, "error_bytes": 20, "relative_error": 0.25}
    assert err["trainable_weights"]["relative_error"] == 0.0
    assert err["grads"] == {"predicted": 10, "measured": None, "error_bytes": None, "relative_error": None}
    assert err["optimizer_state"] == {"predicted": 0, "measured": 0, "error_bytes": 0, "relative_error": 0.0}
    assert err["optimizer_state_paged"] == {"predicted": 5, "measured": 0, "error_bytes": 5, "relative_error": None}
    assert err["steady_state_allocated"] == {"predicted": 150, "measured": 120, "error_bytes": 30,
                                             "relative_error": 0.25}
    assert err["peak_allocated"]["measured"] == 400 and err["peak_allocated"]["error_bytes"] is None
    # the step's own peak is measured where there is one; else the run's
    assert planner.plan_error(plan, census, {"peak_allocated": 300})["peak_allocated"]["measured"] == 300
    assert planner.plan_error(plan, {}, {})["weights"]["measured"] is None  # no census: unknown, not 0
