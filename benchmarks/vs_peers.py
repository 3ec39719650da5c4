"""`finetune` against what users would run instead, side by side on the same job.

    python benchmarks/vs_peers.py --backends cuda --data text --out benchmarks/results/vs_peers_cpu.json
    python benchmarks/vs_peers.py --backends cuda --data chat --model medium --runs 3 --steps 40
    python benchmarks/vs_peers.py --backends mlx --data chat --sides ours,ours_packed,mlx_lm --runs 2 --steps 20
    python benchmarks/vs_peers.py --backends cuda --sides ours,trl --runs 1 --steps 12 --samples 200   # smoke

The TRL side needs ``pip install '.[bench]'`` (trl); ``--tokens-per-micro N`` sets ours packed's
``train.tokens_per_micro`` (on a CPU a packed row's attention is quadratic in its length: see
RESULTS.md).

Sides (``--sides``, each where its backend is chosen):

- ``ours``: ``finetune`` unpacked: micro-batch 8 samples, each padded to the longest of the 8.
- ``ours_packed``: ``train.packing=true``: the same 8 samples a step, end to end in micro-batches
  of ``train.tokens_per_micro`` tokens (left at its default, micro-batch x max length = 4096, so a
  step's 8 samples, at most 8 x 512 tokens, are one row); positions restart per sample, no token
  attends across a boundary (cuda: transformers' position_ids path; mlx: a block-diagonal mask);
  the head runs only at target positions.
- ``trainer`` (cuda): Hugging Face ``Trainer`` + PEFT, the usual recipe: ``get_peft_model``, per-batch
  dynamic padding (text: ``DataCollatorForLanguageModeling(mlm=False)``; chat: labels -100 on the
  prompt's tokens and ``DataCollatorForSeq2Seq``), micro-batch 8.
- ``trl`` (cuda): TRL ``SFTTrainer`` with ``packing=True`` (``packing_strategy="bfd"``, which turns on
  its padding-free collator: a batch's rows become one row with position_ids; transformers derives
  the block-diagonal mask from them), ``max_length`` 512, ``peft_config`` the same LoRA, text as a
  language-modeling data set, chat as a prompt-completion one with ``completion_only_loss``;
  ``gradient_checkpointing`` and ``bf16`` set off (SFTConfig turns both on by default).
- ``mlx_lm`` (mlx): ``mlx_lm lora`` through its ``main()`` (its trainer, its batching), ``--mask-prompt``
  with its completions format for chat; AdamW weight decay set to 0 (its default is 0.01, ours 0).

Same on every side: the model (``--model tiny``: a random Qwen2 of ~3.7 M parameters, hidden 256,
4 layers, intermediate 704, vocab 2048; ``--model medium``: ~27 M, hidden 512, 8 layers, 8 heads, 2
KV heads, intermediate 1408, vocab 8192, where the step is compute-bound on a CPU; both built by
finetune's own builder, whose byte-level BPE reaches 728 tokens on its built-in data, so both
tokenize GSM8K alike: ~390 tokens a text sample, 19% of them longer than 512), the first
``--samples`` GSM8K records (``--data text``: every token in the loss; ``--data chat``: question as
the prompt, answer as the completion, only the completion in the loss; see peers_data.py for how
each side reads them and why their tokens agree), max length 512 on every side (a longer sample
is truncated to its first 512 tokens everywhere), LoRA rank 8 / alpha 16 / dropout 0 on q_proj and
v_proj of every layer, AdamW lr 1e-4 constant, no warm-up, no weight decay, fp32 on CPU, no
evaluation, no checkpoints, the same optimizer steps. The run prints the token check: per side,
the samples, tokens and loss positions of the whole data as that side tokenizes it.

Like with like, per optimizer step: ours, ours packed, the Trainer and mlx-lm train 8 samples a
step. TRL's packing makes a step of ``per_device_train_batch_size`` rows of up to 512 tokens, each
holding whole samples (BFD), so its samples per step vary; the script packs the data with TRL's own
``pack_dataset(..., "bfd")`` first and sets the rows per step to round(8 / samples per packed row)
(7 rows on the first 200 records, ~1.15 samples and ~450 tokens a row), so a TRL step holds about
the tokens and samples of ours' (8 samples, ~3,000 tokens); each side's measured tokens and samples
per step are printed beside its speed. Matching TRL's rows to ours' samples, not ours to TRL, keeps
ours' settings the ones its other benchmarks use.

Runs alternate (the sides in order, then reversed, ...); each run is a fresh process; every side
skips its first ``--skip`` steps (10 by default; ``--steps`` must exceed it; on MLX's reference
BLAS, where a step takes 15-160 s, a few: the warm-up there is the first step's graph and
buffers); medians over runs; every ratio is printed.
What a token is: the real (non-pad) tokens of the trained samples after truncation, on every
side: ours from metrics.jsonl ``tokens`` / ``step_seconds``; the Trainer from its batches'
attention masks, TRL from its packed rows' length (no pad: padding-free), both timed from
``on_step_begin`` to ``on_step_end``; mlx-lm from the rows its own ``iterate_batches`` yields (the
script records them) over the time of its reports. mlx-lm's own count (its ``trained_tokens``,
the positions of its loss mask) is printed too: text: ours is converted to it as mlx_footprint.py
does (real tokens minus one per sample), though its mask (``steps <= length``) also admits the pad
position one past each sample's end, so it counts about one token per sample more than that
conversion (see the token check); chat: its completion tokens plus that one, printed alone. Peak
RSS is each process's (``wait4``). Memory per step, ours packed vs unpacked: on mlx the per-step
peak of MLX's allocator (metrics.jsonl ``step_peak_allocated_bytes``); torch on CPU has no
allocator figure, so on cuda the RSS at each step's optimizer-phase sample (``rss_bytes``).

The mlx_lm side used to be mlx_footprint.py's, with max length 2048 against ours' 512: 19% of
these samples are longer than 512 tokens, so it trained longer rows than ours (the mlx half of
results/vs_peers_cpu.txt); it now runs at 512 with weight decay 0, like ours.

Time on a 2-core CPU, from 12-step smoke runs on a busy box (load 2-4.5), so upper figures: a
cuda-side run is 25-40 s of start-up plus, on tiny, 1.7-8 s a step (ours 3.9, ours packed 1.7,
Trainer 5.8, TRL 2-8.5) and, on medium, ours 2.8 s a step; a quiet box runs tiny at ~0.5 s a
step (results/vs_peers_cpu.txt). The MLX sides run on mlx[cpu]'s reference BLAS, on tiny about
19 s a step for ours, 32 for mlx-lm and 40 for ours packed (its block-diagonal mask over a
~3,000-token row), so 3 runs x 40 steps of the three is ~3 hours: use --runs 2 --steps 20 there.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from mlx_footprint import GSM8K, _run
from peers_data import gsm8k_rows, token_check, trl_rows_per_step, write_data

GIB = 2**30
SEQ = 512  # max tokens per sample, every side
MICRO = 8  # samples per step (ours, the Trainer, mlx-lm); TRL's rows are chosen to match it
SKIP = 10  # warm-up steps every side leaves out (--skip; MLX's reference BLAS: 15-160 s a step, so fewer there)
MODELS = {
    "tiny": ["model.config.hidden_size=256", "model.config.num_hidden_layers=4", "model.config.num_attention_heads=4",
             "model.config.num_key_value_heads=2", "model.config.intermediate_size=704", "model.config.vocab_size=2048"],
    "medium": ["model.config.hidden_size=512", "model.config.num_hidden_layers=8", "model.config.num_attention_heads=8",
               "model.config.num_key_value_heads=2", "model.config.intermediate_size=1408",
               "model.config.vocab_size=8192"],
}
ARCH = MODELS["tiny"]
SIDES = {"cuda": ("ours", "ours_packed", "trainer", "trl"), "mlx": ("ours", "ours_packed", "mlx_lm")}
LABEL = {"ours": "ours", "ours_packed": "ours packed", "trainer": "HF Trainer + PEFT",
         "trl": "TRL SFTTrainer packing", "mlx_lm": "mlx_lm lora"}
COUNTS = {
    "ours": "real tokens (metrics.jsonl tokens: the samples' tokens, no pad)",
    "ours_packed": "real tokens (metrics.jsonl tokens; a packed row has no pad)",
    "trainer": "real tokens (attention_mask sum of each batch)",
    "trl": "real tokens (length of each padding-free packed row; no pad)",
    "mlx_lm": "real tokens (lengths of the rows its iterate_batches yields); its own count (trained_tokens) "
              "is its loss mask's positions",
}


@dataclass
class Job:
    """What every side of one invocation shares."""

    work: Path
    model: Path
    arch: list[str]
    kind: str  # text | chat
    data: dict[str, Path]  # side -> its data file (mlx_lm: its data folder)
    steps: int
    trl_rows: int
    tokens_per_micro: int | None = None  # ours packed: train.tokens_per_micro (None: its default)
    skip: int = SKIP  # warm-up steps every side leaves out


def _measured(tokens: list[int], samples: list[int], secs: list[float], skip: int) -> dict[str, float]:
    """Rates over the steps after the first ``skip``: real tokens/s, and per-step means."""
    t, s, d = tokens[skip:], samples[skip:], secs[skip:]
    return {"tps": sum(t) / sum(d), "tokens_per_step": sum(t) / len(t), "samples_per_step": sum(s) / len(s),
            "step_seconds": sum(d) / len(d)}


def ours(job: Job, backend: str, side: str, i: int) -> dict[str, Any]:
    run = job.work / f"{side}_{backend}_{i}"
    cmd = [sys.executable, "-m", "finetune", f"backend={backend}", *job.arch, "data=jsonl",
           f"data.path={job.data['ours']}", "data.mask_prompt=true", "data.val_fraction=0", "train.eval_every=0",
           f"train.steps={job.steps}", f"train.batch_size={MICRO}", f"train.seq_len={SEQ}", "train.warmup_steps=0",
           "train.schedule=constant", "optim.lr=1e-4", "optim.weight_decay=0", "method.lora.rank=8",
           "method.lora.alpha=16", "method.lora.dropout=0", "train.progress=false", f"hydra.run.dir={run}"]
    if side == "ours_packed":
        cmd.append("train.packing=true")  # tokens_per_micro: its default unless --tokens-per-micro
        if job.tokens_per_micro:
            cmd.append(f"train.tokens_per_micro={job.tokens_per_micro}")
    _, rss, wall = _run(cmd, job.work)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.startswith('{"step"')]
    r = _measured([x["tokens"] for x in recs], [x["samples"] for x in recs], [x["step_seconds"] for x in recs], job.skip)
    tail = recs[job.skip:]
    # mlx_footprint.py's conversion to mlx-lm's count: one target fewer than tokens per sample
    r["tps_mlx_count"] = (sum(x["tokens"] - x["samples"] for x in tail)) / sum(x["step_seconds"] for x in tail)
    key = next((k for k in ("step_peak_allocated_bytes", "rss_bytes") if any(x.get(k) is not None for x in recs)), None)
    r["mem_key"] = key
    r["mem_steps"] = [x[key] for x in recs if key and x.get(key) is not None]
    return {**r, "rss": rss, "wall": wall}


TORCH_PEER = r'''
import json, sys, time
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
kind, model_dir, data, steps, out, seq, rows, fmt = sys.argv[1:9]
steps, seq, rows = int(steps), int(seq), int(rows)
tok = AutoTokenizer.from_pretrained(model_dir)
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
recs = [json.loads(x) for x in open(data)]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
common = dict(output_dir=out, per_device_train_batch_size=rows, max_steps=steps, learning_rate=1e-4,
              lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=10 ** 6,
              save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0)
tokens, samples, times = [], [], []
class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.t)
def counted(cls):
    class Counted(cls):
        def training_step(self, model, inputs, *a, **k):
            if "attention_mask" in inputs:  # padded rows: the mask's ones are the real tokens
                tokens.append(int(inputs["attention_mask"].sum()))
                samples.append(int(inputs["input_ids"].shape[0]))
            else:  # padding-free packed row: every position is real; a sample starts at position 0
                tokens.append(int(inputs["position_ids"].numel()))
                samples.append(int((inputs["position_ids"] == 0).sum()))
            return super().training_step(model, inputs, *a, **k)
    return Counted
if kind == "trainer":
    from peft import get_peft_model
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, Trainer, TrainingArguments
    if fmt == "text":
        enc = tok([r["text"] + tok.eos_token for r in recs], truncation=True, max_length=seq)
        ds = [{"input_ids": i, "attention_mask": m} for i, m in zip(enc["input_ids"], enc["attention_mask"])]
        collator = DataCollatorForLanguageModeling(tok, mlm=False)
    else:  # labels -100 on the prompt's tokens
        full = tok([r["prompt"] + r["completion"] + tok.eos_token for r in recs], truncation=True, max_length=seq)
        plen = [len(x) for x in tok([r["prompt"] for r in recs])["input_ids"]]
        ds = [{"input_ids": x, "attention_mask": [1] * len(x), "labels": [-100] * min(p, len(x)) + x[p:]}
              for x, p in zip(full["input_ids"], plen)]
        collator = DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)
    trainer = counted(Trainer)(model=get_peft_model(model, lora), args=TrainingArguments(**common), train_dataset=ds,
                               data_collator=collator, callbacks=[Clock()])
else:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    cfg = SFTConfig(**common, packing=True, packing_strategy="bfd", max_length=seq,
                    completion_only_loss=fmt == "chat", gradient_checkpointing=False, bf16=False)
    trainer = counted(SFTTrainer)(model=model, args=cfg, train_dataset=Dataset.from_list(recs), processing_class=tok,
                                  peft_config=lora, callbacks=[Clock()])
trainer.train()
json.dump({"tokens": tokens, "samples": samples, "times": times}, open(out + "/counts.json", "w"))
'''


def torch_peer(job: Job, backend: str, side: str, i: int) -> dict[str, Any]:
    out = job.work / f"{side}_{i}"
    out.mkdir()
    rows = job.trl_rows if side == "trl" else MICRO
    cmd = [sys.executable, "-c", TORCH_PEER, side, str(job.model), str(job.data[side]), str(job.steps), str(out),
           str(SEQ), str(rows), job.kind]
    _, rss, wall = _run(cmd, job.work, env={"TOKENIZERS_PARALLELISM": "false"})
    c = json.loads((out / "counts.json").read_text())
    return {**_measured(c["tokens"], c["samples"], c["times"], job.skip), "rss": rss, "wall": wall}


MLX_DRIVER = r'''
import json, sys
import mlx_lm.lora as L
import mlx_lm.tuner.trainer as T
from mlx_lm.tuner.callbacks import TrainingCallback
reports, rows = sys.argv[1], sys.argv[2]
class Rec(TrainingCallback):  # each report as JSON: its console UI rounds the figures
    def on_train_loss_report(self, info):
        open(reports, "a").write(json.dumps(info) + "\n")
def recorded(*a, **k):  # its own iterate_batches; the training stream's rows written as [offset, length]
    for batch, lengths in T.iterate_batches(*a, **k):
        if k.get("loop"):
            open(rows, "a").write(json.dumps(lengths.tolist()) + "\n")
        yield batch, lengths
train = L.train
L.train = lambda *a, **k: train(*a, iterate_batches=recorded, **k)
L.get_reporting_callbacks = lambda *a, **k: Rec()
sys.argv = ["mlx_lm.lora"] + sys.argv[3:]
L.main()
'''


def mlx_lm(job: Job, backend: str, side: str, i: int) -> dict[str, Any]:
    cfg = job.work / "mlx_lm.yaml"
    cfg.write_text(json.dumps({"lora_parameters": {"rank": 8, "scale": 2.0, "dropout": 0.0,
                                                   "keys": ["self_attn.q_proj", "self_attn.v_proj"]},
                               "optimizer_config": {"adamw": {"weight_decay": 0.0}}}))
    reports, rows_file = job.work / f"mlx_lm_{i}.jsonl", job.work / f"mlx_lm_{i}_rows.jsonl"
    never = str(10 * job.steps)
    cmd = [sys.executable, "-c", MLX_DRIVER, str(reports), str(rows_file), "--model", str(job.model), "--train",
           "--data", str(job.data["mlx_lm"]), "--batch-size", str(MICRO), "--iters", str(job.steps),
           "--max-seq-length", str(SEQ), "--num-layers", "-1", "--learning-rate", "1e-4", "--steps-per-report",
           str(job.skip), "--steps-per-eval", never, "--val-batches", "1", "--adapter-path", str(job.work / f"mlx_lm_{i}"),
           "--save-every", never, "--optimizer", "adamw", "-c", str(cfg)]
    if job.kind == "chat":
        cmd.append("--mask-prompt")
    out, rss, wall = _run(cmd, job.work)
    reps = [json.loads(x) for x in reports.read_text().splitlines()] if reports.exists() else []
    if len(reps) < 2:
        sys.exit(f"could not read mlx_lm's reports:\n{out[-2000:]}")
    batches = [json.loads(x) for x in rows_file.read_text().splitlines()]
    own = real = samples = 0
    secs = 0.0
    for prev, r in itertools.pairwise(reps):  # the windows after its first report (its first job.skip steps)
        d = r["trained_tokens"] - prev["trained_tokens"]
        own, secs = own + d, secs + d / r["tokens_per_second"]
        window = batches[prev["iteration"]:r["iteration"]]
        real += sum(n for b in window for _, n in b)
        samples += sum(len(b) for b in window)
    n = reps[-1]["iteration"] - reps[0]["iteration"]
    return {"tps": real / secs, "tps_own": own / secs, "tokens_per_step": real / n, "samples_per_step": samples / n,
            "step_seconds": secs / n, "rss": rss, "wall": wall, "mlx_peak": reps[-1]["peak_memory"] * 1e9}


RUNNERS = {"ours": ours, "ours_packed": ours, "trainer": torch_peer, "trl": torch_peer, "mlx_lm": mlx_lm}


def _med(rs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def _gib(x: float) -> str:
    return f"{x / GIB:.3f}"


def summarize(backend: str, res: dict[str, list[dict[str, Any]]], kind: str) -> tuple[list[str], dict[str, Any]]:
    """Table, ratios and memory lines for one backend's runs; and the same as a dict for --out."""
    lines = [f"{'side':24}{'real tok/s':>12}{'tokens/step':>13}{'samples/step':>14}{'s/step':>8}{'peak RSS GiB':>14}"]
    med: dict[str, dict[str, float]] = {}
    for side, rs in res.items():
        m = med[side] = {k: _med(rs, k) for k in ("tps", "tokens_per_step", "samples_per_step", "step_seconds", "rss")}
        lines.append(f"{LABEL[side]:24}{m['tps']:12,.0f}{m['tokens_per_step']:13,.0f}{m['samples_per_step']:14.2f}"
                     f"{m['step_seconds']:8.2f}{_gib(m['rss']):>14}")
    ratios = []
    mine = [s for s in ("ours", "ours_packed") if s in res]
    for a in mine:
        for b in [s for s in res if s != a and (s not in mine or a == "ours_packed")]:
            t, m = med[a]["tps"] / med[b]["tps"], med[a]["rss"] / med[b]["rss"]
            ratios.append({"side": a, "vs": b, "tokens_per_sec": t, "peak_rss": m})
            lines.append(f"  {LABEL[a]:12} vs {LABEL[b]:24} real tokens/s {med[a]['tps']:,.0f} vs {med[b]['tps']:,.0f}"
                         f" = {t:.2f}x; peak RSS {_gib(med[a]['rss'])} vs {_gib(med[b]['rss'])} GiB = {m:.2f}x")
    if "mlx_lm" in res:
        own = _med(res["mlx_lm"], "tps_own")
        med["mlx_lm"]["tps_own"] = own
        lines.append(f"  mlx_lm lora in its own count (trained_tokens, its loss mask): {own:,.0f} tok/s, "
                     f"mlx peak {_gib(_med(res['mlx_lm'], 'mlx_peak'))} GiB")
        if kind == "text":
            for a in mine:
                o = _med(res[a], "tps_mlx_count")
                ratios.append({"side": a, "vs": "mlx_lm", "tokens_per_sec_mlx_count": o / own})
                lines.append(f"  {LABEL[a]:12} vs mlx_lm lora in that count (ours: real tokens minus one per sample, "
                             f"mlx_footprint.py's conversion): {o:,.0f} vs {own:,.0f} = {o / own:.2f}x")
    memory = {}
    for a in mine:
        vals = [v for r in res[a] for v in r["mem_steps"]]
        key = res[a][0]["mem_key"]
        if not vals:
            lines.append(f"  memory per step, {LABEL[a]}: metrics.jsonl has no per-step memory figure")
            continue
        memory[a] = {"key": key, "min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}
        what = ("the step's peak of MLX's allocator" if key == "step_peak_allocated_bytes" else
                "RSS at the step's optimizer-phase sample (torch on CPU has no allocator figure)")
        lines.append(f"  memory per step, {LABEL[a]:11} ({key}: {what}; every step of every run): "
                     f"min {_gib(memory[a]['min'])} / median {_gib(memory[a]['median'])} / max {_gib(memory[a]['max'])} GiB")
    if "ours" in memory and "ours_packed" in memory:
        lines.append(f"  memory per step, packed / unpacked (medians): "
                     f"{memory['ours_packed']['median'] / memory['ours']['median']:.2f}x")
    return lines, {"medians": med, "ratios": ratios, "memory_per_step": memory}


def versions() -> str:
    out = []
    for p in ("torch", "transformers", "peft", "trl", "mlx", "mlx-lm"):
        try:
            out.append(f"{p} {md.version(p)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="cuda,mlx", help="comma list of cuda, mlx")
    ap.add_argument("--sides", default=",".join(LABEL), help="comma list of " + ", ".join(LABEL))
    ap.add_argument("--runs", type=int, default=3, help="runs per side, alternating")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run; the first --skip are not measured")
    ap.add_argument("--skip", type=int, default=SKIP, help="warm-up steps every side leaves out (default %(default)s)")
    ap.add_argument("--samples", type=int, default=2000, help="GSM8K records")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--data", choices=("text", "chat"), default="text")
    ap.add_argument("--out", type=Path, help="write the results as JSON here too")
    ap.add_argument("--tokens-per-micro", type=int, default=None,
                    help="ours packed: train.tokens_per_micro (default: finetune's own)")
    a = ap.parse_args()
    backends = a.backends.split(",")
    chosen = a.sides.split(",")
    if bad := [b for b in backends if b not in SIDES] + [s for s in chosen if s not in LABEL]:
        sys.exit(f"unknown backend or side: {bad}; backends {list(SIDES)}, sides {list(LABEL)}")
    if a.skip < 1 or a.steps <= a.skip:
        sys.exit(f"--steps must exceed --skip ({a.skip}, at least 1): every side leaves its first {a.skip} steps out")
    if not GSM8K.is_file():
        sys.exit(f"{GSM8K} not found: set FINETUNE_GSM8K=/path/to/gsm8k/train.jsonl")
    from transformers import AutoTokenizer

    from finetune.config import compose
    from finetune.model.source import resolve_model_dir

    arch = MODELS[a.model]
    model = resolve_model_dir(compose("/tmp/unused", *arch).model)
    tok = AutoTokenizer.from_pretrained(model)
    rows = gsm8k_rows(GSM8K, a.samples)
    check = token_check(rows, a.data, tok, SEQ)
    print(f"token check ({a.data}, {len(rows)} GSM8K records, max length {SEQ}): per side, samples / tokens / loss positions")
    for side, c in check.items():
        print(f"  {side:8} {c['samples']:6} {c['tokens']:10,} {c['targets']:10,}")
    trl = {"rows": 0}
    if "cuda" in backends and "trl" in chosen:
        trl = trl_rows_per_step(rows, a.data, tok, SEQ, MICRO)
        print(f"TRL: {trl['rows']} packed rows per step (BFD packs {trl['samples_per_row']:.2f} samples, "
              f"{trl['tokens_per_row']:.0f} tokens a row here): ~{trl['rows'] * trl['samples_per_row']:.1f} samples "
              f"a step vs {MICRO}")
    report: dict[str, Any] = {
        "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores", "versions": versions(),
        "model": {"name": a.model, "dir": model.name, "arch": arch}, "data": a.data, "samples": a.samples,
        "steps": a.steps, "runs": a.runs, "skip": a.skip, "seq": SEQ, "micro_batch": MICRO, "trl": trl,
        "token_check": check, "counts": COUNTS, "backends": {}}
    lines: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        job = Job(work, model, arch, a.data, write_data(work, rows, a.data, tok), a.steps, int(trl["rows"]), a.tokens_per_micro,
                  a.skip)
        for backend in backends:
            sides = [s for s in SIDES[backend] if s in chosen]
            if not sides:
                continue
            res: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
            for i in range(a.runs):
                for side in (sides if i % 2 == 0 else sides[::-1]):
                    r = RUNNERS[side](job, backend, side, i)
                    res[side].append(r)
                    print(f"{backend} run {i} {LABEL[side]}: {r['tps']:,.0f} real tok/s, {r['tokens_per_step']:,.0f} "
                          f"tokens and {r['samples_per_step']:.2f} samples a step, {r['step_seconds']:.2f} s/step, "
                          f"peak RSS {_gib(r['rss'])} GiB, {r['wall']:.0f} s wall", flush=True)
            ls, summary = summarize(backend, res, a.data)
            lines += [f"\nbackend={backend}, model {a.model}, data {a.data}: medians of {a.runs} runs", *ls]
            report["backends"][backend] = {"runs": res, **summary}
    print(f"\nmachine: {report['machine']}; {report['versions']}; {a.runs} runs each, {a.steps} steps "
          f"(first {a.skip} not measured), micro-batch {MICRO} samples (TRL: {trl['rows']} packed rows), "
          f"max length {SEQ}, {a.samples} GSM8K records as {a.data}, model {a.model} ({model.name}); "
          f"{report['date']}; {time.perf_counter() - t0:.0f} s")
    for ln in lines:
        print(ln)
    print("what each side counts as a token:")
    for side in [s for s in LABEL if s in chosen]:
        print(f"  {LABEL[side]}: {COUNTS[side]}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
