"""GSM8K in the form each side of benchmarks/vs_peers.py reads, and the check that every side
trains the same tokens.

``text``: ``{"text": "Question: ...\\nAnswer: ..."}`` for every side, every token in the loss.

``chat``: the question is the user turn, the answer the assistant turn, rendered by the model
tokenizer's own chat template (the tiny builder's ChatML: ``<|im_start|>user\\n{q}<|im_end|>\\n
<|im_start|>assistant\\n{a}<|im_end|>\\n``); only the assistant part counts in the loss:

- ours: ``{"messages": [user, assistant]}``; ours applies the template and, with
  ``data.mask_prompt=true``, counts the assistant span and the EOS it appends.
- HF Trainer + PEFT and TRL: ``{"prompt": P, "completion": C}`` with P the template of the user
  turn plus the generation prompt and C the rest of the whole conversation's template, so
  P + C is the text ours renders; both add the EOS (TRL appends it to a string completion; the
  Trainer script appends it), the Trainer sets the labels of P's tokens to -100, TRL uses
  ``completion_only_loss``. (TRL's conversational form, lists of messages, would add no EOS:
  one token fewer per sample than ours.)
- mlx_lm lora: its completions format ``{"prompt": question, "completion": answer}`` with
  ``--mask-prompt``; it applies the same template itself and appends no EOS, so it holds one
  token fewer per sample. Its loss mask (``steps <= length`` in ``default_loss``) admits the
  position one past each sample's end, a pad of id 0, which on the tiny tokenizer is
  ``<|endoftext|>``: it trains the same targets as ours, on one input token fewer.

``token_check`` tokenizes the whole data set the way each side does and returns, per side, the
samples, the tokens (after truncation to the max length) and the loss positions, so the run
prints what each side trains instead of asserting it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

GSM8K_KEYS = ("question", "answer")


def gsm8k_rows(path: Path, n: int) -> list[dict[str, str]]:
    """The first ``n`` GSM8K records (question, answer)."""
    rows = []
    with path.open() as f:
        for line in f:
            if len(rows) == n:
                break
            r = json.loads(line)
            rows.append({k: r[k] for k in GSM8K_KEYS})
    return rows


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _messages(r: dict[str, str]) -> list[dict[str, str]]:
    return [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]


def split_chat(tokenizer: Any, r: dict[str, str]) -> tuple[str, str]:
    """(P, C): the template of the user turn with the generation prompt, and the rest of the
    whole conversation's template (the answer and the template's end of turn)."""
    full = tokenizer.apply_chat_template(_messages(r), tokenize=False)
    p = tokenizer.apply_chat_template(_messages(r)[:1], tokenize=False, add_generation_prompt=True)
    if not full.startswith(p):
        raise ValueError("the chat template renders the prompt differently alone and in the conversation")
    return p, full[len(p):]


def write_data(work: Path, rows: list[dict[str, str]], kind: str, tokenizer: Any) -> dict[str, Path]:
    """Write the data each side reads; return {side: path} (a .jsonl file, or for mlx_lm the
    folder holding train.jsonl and valid.jsonl, as ``mlx_lm lora --data`` takes)."""
    d = work / f"data_{kind}"
    if kind == "text":
        recs = [{"text": f"Question: {r['question']}\nAnswer: {r['answer']}"} for r in rows]
        f = _write(d / "train.jsonl", recs)
        _write(d / "valid.jsonl", recs[:16])  # mlx_lm insists on one; 1 batch at its first and last step
        return {"ours": f, "trainer": f, "trl": f, "mlx_lm": d}
    if kind != "chat":
        raise ValueError(f"data kind {kind!r}: text or chat")
    pc = [dict(zip(("prompt", "completion"), split_chat(tokenizer, r))) for r in rows]
    raw = [{"prompt": r["question"], "completion": r["answer"]} for r in rows]
    _write(d / "mlx" / "valid.jsonl", raw[:16])
    return {"ours": _write(d / "ours.jsonl", [{"messages": _messages(r)} for r in rows]),
            "trainer": _write(d / "prompt_completion.jsonl", pc), "trl": d / "prompt_completion.jsonl",
            "mlx_lm": _write(d / "mlx" / "train.jsonl", raw).parent}


def token_check(rows: list[dict[str, str]], kind: str, tokenizer: Any, seq: int) -> dict[str, dict[str, int]]:
    """Per side, over the whole data: samples, tokens (after truncation to ``seq``) and loss
    positions (targets), each side tokenized as it does it.

    Loss positions: ours, its mask past each sample's first token; the Trainer, labels other
    than -100 after the shift (in text, ``DataCollatorForLanguageModeling`` also sets the EOS's
    label to -100, as the pad is the EOS); TRL, the same after its packing collator masks each
    sample's first token; mlx_lm, its own ``default_loss`` mask, which admits one position past
    each sample's end (a pad) unless the sample fills the row."""
    from finetune.data import tokenize

    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    out: dict[str, dict[str, int]] = {}
    if kind == "text":
        texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]
        ours = tokenize(({"text": t} for t in texts), tokenizer, seq, True)
        hf = [x[:seq] for x in tokenizer([t + eos for t in texts], add_special_tokens=False)["input_ids"]]
        trainer_t = sum(sum(1 for t in x[1:] if t != eos_id) for x in hf)
        trl_t = sum(len(x) - 1 for x in hf)
        mlx_lens = [min(len(x), seq) for x in hf]  # TextDataset: its encoding plus the EOS, as hf
        mlx_t = sum(n if n < seq else n - 1 for n in mlx_lens)
    else:
        ours = tokenize(({"messages": _messages(r)} for r in rows), tokenizer, seq, True)
        pcs = [split_chat(tokenizer, r) for r in rows]
        full = tokenizer([p + c + eos for p, c in pcs], add_special_tokens=False)["input_ids"]
        plen = [len(x) for x in tokenizer([p for p, _ in pcs], add_special_tokens=False)["input_ids"]]
        hf = [x[:seq] for x in full]
        trainer_t = trl_t = sum(max(len(x) - max(p, 1), 0) for x, p in zip(hf, plen))
        mlx_lens, mlx_t = [], 0
        for r in rows:
            ids = tokenizer.apply_chat_template(_messages(r), return_dict=False)
            off = len(tokenizer.apply_chat_template(_messages(r)[:1], add_generation_prompt=True, return_dict=False))
            n = min(len(ids), seq)
            mlx_lens.append(n)
            mlx_t += max((n if n < seq else n - 1) - max(off, 1) + 1, 0)
    out["ours"] = {"samples": len(ours.ids), "tokens": int(ours.lengths.sum()), "targets": int(ours.targets().sum())}
    for side, t in (("trainer", trainer_t), ("trl", trl_t)):
        out[side] = {"samples": len(hf), "tokens": sum(map(len, hf)), "targets": int(t)}
    out["mlx_lm"] = {"samples": len(mlx_lens), "tokens": sum(mlx_lens), "targets": int(mlx_t)}
    return out


def trl_rows_per_step(rows: list[dict[str, str]], kind: str, tokenizer: Any, seq: int,
                      samples_per_step: int) -> dict[str, float]:
    """TRL's packed rows per optimizer step that train ``samples_per_step`` samples on average:
    the data packed by TRL's own ``pack_dataset(..., "bfd")`` into rows of at most ``seq``
    tokens, rows = round(samples_per_step / samples per row). Returns the rows and the packing's
    samples and tokens per row."""
    import datasets
    from trl import pack_dataset

    datasets.disable_progress_bars()

    eos = tokenizer.eos_token
    if kind == "text":
        texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" + eos for r in rows]
    else:
        texts = ["".join(split_chat(tokenizer, r)) + eos for r in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    packed = pack_dataset(datasets.Dataset.from_dict({"input_ids": ids}), seq, "bfd")
    lens = packed["seq_lengths"]
    per_row = float(np.mean([len(x) for x in lens]))
    return {"rows": max(1, round(samples_per_step / per_row)), "samples_per_row": per_row,
            "tokens_per_row": float(np.mean([sum(x) for x in lens]))}
