"""The memory models' pieces on their edges, priced on tensors whose bytes are chosen so the
edge is met exactly."""

from __future__ import annotations

from pathlib import Path

from finetune.backends.cuda.memory import DDP_BUCKET_BYTES, collective_buffers

from finetune import planner
from finetune.config import compose
from finetune.planner import Tensor
from finetune.resolver import resolve

MiB = 1 << 20


def _grad(name: str, nbytes: int) -> Tensor:
    return Tensor(name, (nbytes // 4,), 0, "linear", True, 4)  # fp32


def test_ddp_packs_gradients_that_fill_a_bucket_exactly_into_one(tmp_path: Path) -> None:
    # torch DDP's bucket_cap_mb=25: 20 MiB + 5 MiB of gradients make one full 25 MiB bucket
    _, s = planner.resolve(resolve(compose(tmp_path / "run", "backend=cuda", "backend.num_devices=2")))
    assert (s.strategy, s.world_size, DDP_BUCKET_BYTES) == ("ddp", 2, 25 * MiB)
    full = collective_buffers([_grad("a", 20 * MiB), _grad("b", 5 * MiB)], s)
    assert full == {"ddp_bucket": {"bytes": 25 * MiB, "phase": "grad_sync"}}
    over = collective_buffers([_grad("a", 20 * MiB), _grad("b", 5 * MiB + 4)], s)
    assert over == {"ddp_bucket": {"bytes": 20 * MiB, "phase": "grad_sync"}}


def test_a_chunked_loss_prices_one_chunk_of_logits_only_below_the_step_tokens(tmp_path: Path) -> None:
    # cuda: the whole fp32 logits, softmax and grad are 3 x 4 B per (token, vocab entry); a chunk
    # of 64 tokens holds that for 64 tokens plus the hidden states' fp32 gradient [n, h]
    def logits(chunk: int) -> tuple[int, int, int]:
        p = planner.plan(resolve(compose(tmp_path / f"c{chunk}", "backend=cuda", "train.batch_size=2", "train.seq_len=128",
                                 f"train.loss_chunk={chunk}")), recommend=False)
        return p["bytes"]["logits"], p["model"]["vocab"], p["model"]["hidden"]

    whole, V, h = logits(0)
    n = 2 * 128  # the step's tokens
    assert whole == 12 * n * V
    assert logits(64)[0] == 12 * 64 * V + 4 * n * h  # LoRA: the head does not train
    assert logits(100_000)[0] == whole  # a chunk as long as the step: the whole logits


def test_lora_under_bf16_autocast_keeps_bf16_copies_for_its_adapters(tmp_path: Path) -> None:
    # per adapted Linear (q_proj, v_proj: 64 -> ..., rank 8) and token: autocast's bf16 copy of
    # the fp32 input for lora_A (64 x 2 B) and lora_A's bf16 output kept for lora_B (8 x 2 B)
    p = planner.plan(resolve(compose(tmp_path / "run", "backend=cuda", "precision=bf16-mixed", "train.batch_size=2",
                             "train.seq_len=64")), recommend=False)
    tokens = 2 * 64
    assert p["lora"] == {"rank": 8, "keys": ["q_proj", "v_proj"], "layers": 2}
    assert p["activations_detail"]["per_layer_adapters"] == 2 * (tokens * 64 * 2 + tokens * 8 * 2)


def test_allocator_rounding_is_priced_on_a_gpu_and_not_on_the_cpu(tmp_path: Path) -> None:
    def rounding(device: str) -> int:
        p = planner.plan(resolve(compose(tmp_path / device, "backend=cuda", f"backend.device={device}")), recommend=False)
        return p["per_device"][0]["overhead_detail"]["allocator_rounding_512B"]

    assert rounding("cpu") == 0
    assert 0 < rounding("cuda") < 512 * 64  # under 512 B per persistent tensor


def test_qlora_backward_holds_the_largest_dequantized_weight(tmp_path: Path) -> None:
    # bitsandbytes dequantizes one 4-bit weight at a time to the compute dtype (fp32 here):
    # the largest is gate/up_proj, 64 x 128 elements x 4 B
    def workspace(method: str) -> int:
        p = planner.plan(resolve(compose(tmp_path / method, "backend=cuda", "backend.device=cuda", f"method={method}",
                                 "train.batch_size=2", "train.seq_len=64")), recommend=False)
        assert p["dtypes"]["compute"] == "float32"
        return p["activations_detail"]["backward_workspace"]

    assert workspace("qlora") - workspace("lora") == 64 * 128 * 4


def test_the_packed_attention_path_is_said_per_implementation(tmp_path: Path) -> None:
    """The cuda plan names the path a packed row takes, as the runtime does: sdpa per sample
    (backends/cuda/varlen.py), eager through transformers' block mask, flash's varlen; and the
    runtime's fallback from sdpa (per_sample=False) is the block mask too."""
    from finetune.backends.cuda.memory import packed_path

    def said(attn: str) -> str:
        cfg = compose(tmp_path / "run", "backend=cuda", "train.packing=true", f"backend.attn_implementation={attn}")
        return planner.plan(resolve(cfg), recommend=False)["packing"]["attention"]

    assert said("sdpa") == "sdpa per sample (positions from position_ids; no block mask)"
    assert said("eager") == "eager with transformers' [1, 1, T, T] block-diagonal causal mask built from position_ids"
    assert said("flash_attention_2") == "flash_attention_2 varlen (cu_seqlens from position_ids)"
    assert packed_path("sdpa", per_sample=False) == ("sdpa with transformers' [1, 1, T, T] block-diagonal causal "
                                                     "mask built from position_ids")
