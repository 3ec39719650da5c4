"""``finetune mode=generate`` on the cuda backend: transformers' own ``generate``, with a PEFT
adapter when one is given (``CudaBackend.generate`` calls it; finetune/generate.py holds the
shared CLI and mode logic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from finetune.errors import UserError
from finetune.export.basemodel import check_remote_code
from finetune.model.source import load_causal_lm
from finetune.prompting import Prompt, end_token_ids


def generate(model_dir: Path, adapter: Path | None, prompt: Prompt, max_new_tokens: int, temperature: float,
             seed: int, trust_remote_code: bool = False, allow_pickle: bool = False) -> str:
    """The completion of ``prompt`` by the base in ``model_dir`` plus the PEFT ``adapter``:
    greedy at ``temperature`` 0, plain temperature sampling seeded with ``seed`` otherwise;
    up to the first end token (finetune/prompting.py ``end_token_ids``), special tokens left out."""
    from transformers import AutoTokenizer

    check_remote_code(model_dir, trust_remote_code, "set model.trust_remote_code=true")
    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    # use_safetensors=True: transformers refuses pickle weights rather than falling back to them
    # a multimodal checkpoint: its language model alone, as training loaded it
    model = load_causal_lm(model_dir, trust_remote_code, dtype="auto", use_safetensors=None if allow_pickle else True)
    if adapter is not None:
        from peft import PeftModel

        # the adapter is adapter_model.safetensors (detect_format refuses a pickle-only one;
        # a converted one is written so), which PEFT prefers over any .bin beside it
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)
    if prompt.chat:
        if not tok.chat_template:
            raise UserError(f"the tokenizer in {model_dir} has no chat template; set generate.chat_template=false")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt.text, return_tensors="pt", add_special_tokens=prompt.special_tokens)["input_ids"]
    torch.manual_seed(seed)
    sample = temperature > 0
    ends = end_token_ids(tok, model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (ends[0] if ends else None)
    kwargs: dict[str, Any] = {"do_sample": sample, "max_new_tokens": max_new_tokens, "eos_token_id": ends or None,
                              "pad_token_id": pad}
    if sample:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)  # plain temperature sampling, as mlx's sampler
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)  # greedy: no sampling knobs from generation_config
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device), **kwargs)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
