"""The tiny model's config.json, as transformers and mlx-lm read it: head_dim written out
(hidden / heads when the architecture leaves it unset). Written for survivors of the mutation
run (benchmarks/mutation/)."""

from __future__ import annotations

from finetune.tiny import hf_config

ARCH = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": None,
        "intermediate_size": 128, "vocab_size": 512, "tie_embeddings": True, "attn_bias": True,
        "max_position": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def test_head_dim_is_hidden_over_heads_unless_given():
    c = hf_config(ARCH)
    assert (c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]) == (16, 4, 2, 64)
    assert hf_config({**ARCH, "head_dim": 32})["head_dim"] == 32  # a wider head than hidden / heads
