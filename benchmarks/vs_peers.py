"""`finetune` against what users would run instead, side by side on the same job.

    python benchmarks/vs_peers.py                      # both backends, 3 alternating runs each
    python benchmarks/vs_peers.py --backends cuda --runs 5 --steps 60
    python benchmarks/vs_peers.py --backends mlx --runs 2 --steps 20   # ~30 min on a 2-core CPU

Time it on a CPU: the cuda half takes about a minute a run; the MLX half, on mlx[cpu]'s
reference BLAS, 10-20 s a step (~10 min for one 40-step run of ours, about twice that for
mlx-lm's), so the default 3 x 40 steps is an hour there. Both sides skip their first 10 steps.

The same local model on both sides: a random Qwen2-architecture model of ~3.7 M parameters
(hidden 256, 4 layers, intermediate 704, vocab 2048, built by finetune's own builder with a
byte-level BPE trained on its built-in data), GSM8K as text records (every token in the loss),
the same number of samples, max length 512 on both sides (no side truncates what the other does
not: GSM8K texts are shorter), LoRA rank 8 / alpha 16 on q_proj and v_proj of every layer,
AdamW lr 1e-4, micro-batch 8, fp32 on CPU, the same optimizer steps. Runs alternate (ours,
peer, peer, ours, ...); each run is a fresh process; medians; the ratio is printed.

- `backend=cuda` vs Hugging Face `Trainer` + PEFT, the usual recipe: `get_peft_model`,
  dynamic padding to the longest in the batch (`DataCollatorForLanguageModeling(mlm=False)`,
  which pads per batch), `Trainer.train()` for the same steps, no evaluation.
- `backend=mlx` vs `mlx_lm lora` (its own trainer through its `main()`; see mlx_footprint.py).

Tokens, after the first 10 steps on both sides: against the Trainer, real (non-pad) input tokens
(ours from metrics.jsonl `tokens` / `step_seconds`; the Trainer's from its batches' attention
masks, timed from on_step_begin to on_step_end); against mlx-lm, its own count, target positions
(ours converted: real tokens minus one per sample). Peak memory is each
process's peak RSS (`wait4`), which on CPU is where the allocator's memory lives.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from mlx_footprint import GSM8K, _run, make_data, peer as mlx_peer  # noqa: E402

GIB = 2**30
ARCH = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
        "model.intermediate_size=704", "model.vocab_size=2048"]
SEQ = 512


def model_dir() -> Path:
    from finetune.config import compose
    from finetune.model_source import resolve_model_dir

    return resolve_model_dir(compose("/tmp/unused", *ARCH).model)


def ours(backend: str, work: Path, data: Path, steps: int, i: int) -> dict:
    run = work / f"ours_{backend}_{i}"
    cmd = [sys.executable, "-m", "finetune", f"backend={backend}", *ARCH, "data=jsonl",
           f"data.path={data / 'train.jsonl'}", "data.val_fraction=0", "train.eval_every=0", f"train.steps={steps}",
           "train.batch_size=8", f"train.seq_len={SEQ}", "train.warmup_steps=0", "train.schedule=constant",
           "optim.lr=1e-4", "method.lora.rank=8", "method.lora.alpha=16", "train.progress=false",
           f"hydra.run.dir={run}"]
    _, rss, _ = _run(cmd, work)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.startswith('{"step"')]
    tail = recs[10:]
    secs = sum(r["step_seconds"] for r in tail)
    real = sum(r["tokens"] for r in tail)
    return {"rss": rss, "tps": real / secs, "tps_targets": (real - sum(r["samples"] for r in tail)) / secs}


TRAINER = r'''
import json, sys, time
import torch
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainerCallback, TrainingArguments)
model_dir, data, steps, out, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
tok = AutoTokenizer.from_pretrained(model_dir)
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
rows = [json.loads(x)["text"] for x in open(data)]
enc = tok([t + tok.eos_token for t in rows], truncation=True, max_length=seq)
ds = [{"input_ids": ids, "attention_mask": m} for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                         task_type="CAUSAL_LM"))
tokens, times = [], []
class Count(Trainer):
    def training_step(self, model, inputs, *a, **k):
        tokens.append(int(inputs["attention_mask"].sum()))
        return super().training_step(model, inputs, *a, **k)
class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.t)
args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=steps, learning_rate=1e-4,
                         lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=10 ** 6,
                         save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                         disable_tqdm=True, seed=0)
Count(model=model, args=args, train_dataset=ds, callbacks=[Clock()],
      data_collator=DataCollatorForLanguageModeling(tok, mlm=False)).train()
json.dump({"tokens": tokens, "times": times}, open(out + "/counts.json", "w"))
'''


def trainer(work: Path, data: Path, model: Path, steps: int, i: int) -> dict:
    out = work / f"trainer_{i}"
    out.mkdir()
    _, rss, _ = _run([sys.executable, "-c", TRAINER, str(model), str(data / "train.jsonl"), str(steps), str(out), str(SEQ)],
                  work, env={"TOKENIZERS_PARALLELISM": "false"})
    c = json.loads((out / "counts.json").read_text())
    tok, t = c["tokens"][10:], c["times"][10:]
    return {"rss": rss, "tps": sum(tok) / sum(t)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="cuda,mlx")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--samples", type=int, default=2000)
    a = ap.parse_args()
    if not GSM8K.is_file():
        sys.exit(f"{GSM8K} not found: set FINETUNE_GSM8K=/path/to/gsm8k/train.jsonl")
    model = model_dir()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_data(work, a.samples)
        for backend in a.backends.split(","):
            res: dict[str, list[dict]] = {"ours": [], "peer": []}
            for i in range(a.runs):
                for side in (("ours", "peer") if i % 2 == 0 else ("peer", "ours")):
                    if side == "ours":
                        r = ours(backend, work, data, a.steps, i)
                        if backend == "mlx":  # compared in mlx-lm's own count: target positions
                            r = {**r, "tps": r["tps_targets"]}
                    elif backend == "cuda":
                        r = trainer(work, data, model, a.steps, i)
                    else:
                        p = mlx_peer(work, data, model, argparse.Namespace(steps=a.steps), i)
                        r = {"rss": p["rss"], "tps": p["tps_targets"]}
                    res[side].append(r)
                    unit = "real" if backend == "cuda" else "target"
                    print(f"{backend} run {i} {side}: {r['tps']:,.0f} {unit} tok/s, peak RSS {r['rss'] / GIB:.3f} GiB",
                          flush=True)
            peer = "HF Trainer + PEFT" if backend == "cuda" else "mlx_lm lora"
            o_t, p_t = (statistics.median(x["tps"] for x in res[s]) for s in ("ours", "peer"))
            o_m, p_m = (statistics.median(x["rss"] for x in res[s]) for s in ("ours", "peer"))
            unit = "real" if backend == "cuda" else "target"
            lines += [f"backend={backend} vs {peer}: {unit} tokens/s {o_t:,.0f} vs {p_t:,.0f} = {o_t / p_t:.2f}x; "
                      f"peak RSS {o_m / GIB:.3f} vs {p_m / GIB:.3f} GiB = {o_m / p_m:.2f}x"]
    import torch

    print(f"\nmachine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"{a.runs} runs each, {a.steps} steps, micro-batch 8, max length {SEQ}, {a.samples} GSM8K texts, "
          f"model {model.name} (~3.7 M parameters); {time.strftime('%Y-%m-%d')}")
    for ln in lines:
        print(ln)


if __name__ == "__main__":
    main()
