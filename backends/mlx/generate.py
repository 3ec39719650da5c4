"""``finetune mode=generate`` on the mlx backend: ``mlx_lm.generate``, with an mlx-lm adapter
when one is given (``MlxBackend.generate`` calls it; finetune/generate.py holds the shared CLI
and mode logic)."""

from __future__ import annotations

from pathlib import Path

from finetune.errors import UserError
from finetune.backends.mlx.hfconfig import model_config
from finetune.prompting import Prompt, end_token_ids


def generate(model_dir: Path, adapter: Path | None, prompt: Prompt, max_new_tokens: int, temperature: float,
             seed: int, trust_remote_code: bool = False, allow_pickle: bool = False) -> str:
    """The completion of ``prompt`` by the base in ``model_dir`` plus the mlx-lm ``adapter``:
    greedy at ``temperature`` 0, sampled with ``seed`` otherwise; up to the first end token
    (finetune/prompting.py ``end_token_ids``, the cuda backend's), special tokens left out."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    if not any(model_dir.glob("*.safetensors")):
        raise UserError(f"model.path={model_dir} has only pickle weights, which mlx-lm does not load (even with "
                        "model.allow_pickle=true); convert them to safetensors, or use backend=cuda")
    # mlx-lm reads model*.safetensors only; the tokenizer's own code runs only when trusted

    model, tok = load(str(model_dir), adapter_path=str(adapter) if adapter is not None else None,
                      model_config=model_config(model_dir),
                      tokenizer_config={"trust_remote_code": trust_remote_code}, trust_remote_code=trust_remote_code)
    if prompt.chat:
        if not tok.chat_template:
            raise UserError(f"the tokenizer in {model_dir} has no chat template; set generate.chat_template=false")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True)
    else:
        ids = tok.encode(prompt.text, add_special_tokens=prompt.special_tokens)
    # mlx-lm stops at its own eos ids only (not <|im_end|>) and its detokenizer prints special
    # tokens: it stops here at the cuda backend's end tokens, and the text is decoded as there
    tok.eos_token_ids = end_token_ids(tok, model_dir)
    mx.random.seed(seed)
    out = [r.token for r in stream_generate(model, tok, ids, max_tokens=max_new_tokens,
                                            sampler=make_sampler(temp=temperature))]
    return tok.decode([t for t in out if t not in tok.eos_token_ids], skip_special_tokens=True)
