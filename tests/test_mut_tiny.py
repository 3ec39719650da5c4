"""The tiny model's config.json, as transformers and mlx-lm read it: head_dim written out
(hidden / heads when the architecture leaves it unset). Written for survivors of the mutation
run (benchmarks/mutation/)."""

from __future__ import annotations

from types import SimpleNamespace

from finetune.model.tiny import preset_config, tiny_config

ARCH = dict(preset_config("tiny") or ())


def test_head_dim_is_hidden_over_heads_unless_given():
    assert ARCH["head_dim"] is None  # the preset leaves it to hidden / heads
    c = tiny_config(SimpleNamespace(config=ARCH))
    assert (c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]) == (16, 4, 2, 64)
    assert tiny_config(SimpleNamespace(config={**ARCH, "head_dim": 32}))["head_dim"] == 32  # a wider head than hidden / heads
