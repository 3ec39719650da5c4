"""Tiny models whose forward transforms the logits after the head in a way finetune does not
know (doubling them): what the target-only head and the chunked loss must refuse or fall back
from, on both backends."""

from __future__ import annotations

from typing import Any

ODD_VOCAB = 64


def torch_doubled() -> Any:
    """A transformers Llama whose forward returns its logits times 2."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class Doubled(LlamaForCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    torch.manual_seed(0)
    return Doubled(LlamaConfig(vocab_size=ODD_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1))


def mlx_doubled() -> Any:
    """An mlx-lm Llama whose __call__ returns its logits times 2."""
    import mlx.core as mx
    from mlx_lm.models import llama

    class Doubled(llama.Model):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs) * 2

    mx.random.seed(0)
    return Doubled(llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                                   num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=ODD_VOCAB,
                                   num_key_value_heads=1))
