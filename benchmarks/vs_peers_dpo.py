"""`finetune` DPO against TRL's DPOTrainer (cuda) and mlx-lm-lora's DPO (mlx), side by side on the same pairs.

    python benchmarks/vs_peers_dpo.py --backends cuda --runs 2 --steps 16 --skip 4 --out benchmarks/results/vs_peers_dpo_cuda_cpu.json
    python benchmarks/vs_peers_dpo.py --backends mlx --runs 2 --steps 6 --skip 2 --out benchmarks/results/vs_peers_dpo_mlx_cpu.json

vs_peers.py's method (its helpers are reused), for the preference step:

Sides (``--sides``, each where its backend is chosen):

- ``ours``: ``finetune objective=dpo`` (loss_type sigmoid, beta 0.1), ``train.batch_size`` pairs a step,
  chosen and rejected through the model as one batch, the reference the same model with the LoRA
  adapters off (no grad).
- ``trl`` (cuda): TRL ``DPOTrainer`` with ``peft_config`` the same LoRA and no ``ref_model``: its
  reference is the PEFT model under ``disable_adapter()``, as ours; ``DPOConfig`` with
  ``loss_type=["sigmoid"]``, the same beta, ``max_length``, batch (pairs), lr; ``gradient_checkpointing``
  and ``bf16`` off (its config turns both on by default), no precomputed reference log-probs.
- ``mlx_lm_lora`` (mlx): mlx-lm-lora's ``--train-mode dpo`` through its ``main()``
  (``--dpo-cpo-loss-type sigmoid``, the same beta), its trainer and its batching. Its reference is a
  second copy of the weights (``load_reference_model`` loads the model again and freezes it; it has no
  adapters-off reference), so its process holds the base weights twice: on the tiny model that is
  ~15 MB, small beside the peak RSS. Its LoRA config has no ``keys`` (it would adapt every linear
  layer), so the driver passes q_proj and v_proj to mlx-lm's ``linear_to_lora_layers``; AdamW weight
  decay 0. On mlx[cpu] its ``train_dpo`` stops at ``mx.device_info()["max_recommended_working_set_size"]``
  (a Metal key); the driver gives it 0 there (no wired memory, a no-op on the CPU).

Same on every side: the model (``--model tiny`` of vs_peers.py: a random Qwen2 of ~3.7 M parameters;
or ``medium``), LoRA rank 8 / alpha 16 (mlx scale 2.0) / dropout 0 on q_proj and v_proj of every
layer, AdamW lr 1e-4 constant, no warm-up, no weight decay, fp32 on CPU, beta 0.1, sigmoid loss,
max length 512, ``--batch`` pairs a step (4), no evaluation, no checkpoints, the same optimizer steps.
The pairs: the first GSM8K records whose chosen and rejected fit in the max length on every side
(so no side truncates anything): the question as the user turn, the answer as the chosen assistant
turn, the same answer with its final number changed (n -> n + 1) as the rejected; rendered by the
tokenizer's chat template on every side (ours and TRL read ``{"prompt": [user], "chosen":
[assistant], "rejected": [assistant]}``, mlx-lm-lora reads strings and builds the same messages
itself). Order: each side's own (ours groups pairs of like length, mlx-lm-lora batches pairs sorted
by chosen length in a random order, TRL shuffles): their padding differs, their real tokens do not.

What a token is, on every side: the real (non-pad) tokens of the prompt + completion of each chosen
and each rejected sequence that goes through the model (the reference pass reads the same tokens
again and is not counted twice). Ours: metrics.jsonl ``tokens`` (ours appends the EOS to each
completion after the template's end of turn: one token a sequence more than the peers, printed in
the token check); TRL: the ``attention_mask`` sum of each collated batch (its 2B rows); mlx-lm-lora:
per row, one past the last position of its completion mask (its rows are prompt + completion from
position 0). Time: ours ``step_seconds``; TRL ``on_step_begin`` to ``on_step_end``; mlx-lm-lora between
the requests of consecutive batches (its loop evaluates each step before asking for the next), since
its own report window is wrong at the last step (its validation there resets the clock after the
window's tokens were counted). Each run is a fresh process; runs alternate (A B, then B A); the first
``--skip`` steps of each run are left out; medians over runs; peak RSS is each process's (``wait4``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from mlx_footprint import GSM8K, _run
from peers_data import gsm8k_rows
from vs_peers import MODELS, SEQ, Job, _gib, _measured, _med, versions

BATCH = 4  # pairs a step: 8 sequences through the policy, 8 through the reference
BETA = 0.1
SIDES = {"cuda": ("ours", "trl"), "mlx": ("ours", "mlx_lm_lora")}
LABEL = {"ours": "ours (objective=dpo)", "trl": "TRL DPOTrainer + PEFT", "mlx_lm_lora": "mlx-lm-lora dpo"}
COUNTS = {
    "ours": "real tokens (metrics.jsonl tokens: prompt + completion of chosen and rejected, no pad; EOS included)",
    "trl": "real tokens (attention_mask sum of each collated batch: chosen and rejected rows)",
    "mlx_lm_lora": "real tokens (per row, one past the last position of its completion mask)",
}


def rejected_answer(answer: str) -> str | None:
    """The answer with its final number (after ``####``) changed to n + 1; None if it has none."""
    m = re.search(r"####\s*(-?[\d,]+)\s*$", answer)
    if not m:
        return None
    n = int(m.group(1).replace(",", "")) + 1
    return answer[:m.start(1)] + str(n) + answer[m.end(1):]


def build_pairs(tok: Any, n: int, seq: int) -> tuple[list[dict[str, str]], int]:
    """The first ``n`` GSM8K pairs whose chosen and rejected, chat-rendered, fit in ``seq`` tokens
    with one to spare (ours' EOS); and how many records were passed over for length."""
    out, skipped = [], 0
    for r in gsm8k_rows(GSM8K, 4 * n):
        rej = rejected_answer(r["answer"])
        if rej is None:
            continue
        user = [{"role": "user", "content": r["question"]}]
        longest = max(len(tok.apply_chat_template(user + [{"role": "assistant", "content": a}], return_dict=False))
                      for a in (r["answer"], rej))
        if longest + 1 > seq:
            skipped += 1
            continue
        out.append({"prompt": r["question"], "chosen": r["answer"], "rejected": rej})
        if len(out) == n:
            break
    return out, skipped


def write_pairs(work: Path, pairs: list[dict[str, str]]) -> dict[str, Path]:
    """ours and TRL: conversational pairs (one file); mlx-lm-lora: a folder of train/valid.jsonl of strings."""
    d = work / "pairs"
    (d / "mlx").mkdir(parents=True)
    conv = [{"prompt": [{"role": "user", "content": p["prompt"]}],
             "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in pairs]
    (d / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conv))
    (d / "mlx" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (d / "mlx" / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs[:BATCH]))
    return {"ours": d / "conv.jsonl", "trl": d / "conv.jsonl", "mlx_lm_lora": d / "mlx"}


def token_check(pairs: list[dict[str, str]], tok: Any, seq: int) -> dict[str, dict[str, int]]:
    """Per side, over every pair: sequences (2 a pair), tokens (prompt + completion) and completion
    tokens, each side's tokenization."""
    from finetune.data import tokenize

    conv = [{"prompt": [{"role": "user", "content": p["prompt"]}],
             "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in pairs]
    ours = tokenize(conv, tok, seq, True, pairs=True)
    seqs = tokens = targets = 0
    for p in pairs:  # TRL's conversational path and mlx-lm-lora's DPODataset: the template, no EOS added
        user = [{"role": "user", "content": p["prompt"]}]
        plen = len(tok.apply_chat_template(user, add_generation_prompt=True, return_dict=False))
        for a in (p["chosen"], p["rejected"]):
            n = len(tok.apply_chat_template(user + [{"role": "assistant", "content": a}], return_dict=False))
            seqs, tokens, targets = seqs + 1, tokens + n, targets + n - plen
    peer = {"sequences": seqs, "tokens": tokens, "completion_tokens": targets}
    return {"ours": {"sequences": len(ours.ids), "tokens": int(ours.lengths.sum()),
                     "completion_tokens": int(ours.targets().sum())}, "trl": peer, "mlx_lm_lora": peer}


# ours through the CLI, the backend's optimizer_step clocked: the process's CPU seconds and the wall
# clock after each step (a harness patch, as the mlx-lm-lora driver's batch clock)
OURS_DRIVER = r'''
import importlib, json, sys, time
clock, backend = sys.argv[1], sys.argv[2]
cls = importlib.import_module(f"finetune.backends.{backend}.runtime").BACKEND
step = cls.optimizer_step
def clocked(self, *a, **k):
    out = step(self, *a, **k)
    open(clock, "a").write(json.dumps({"cpu": time.process_time(), "t": time.perf_counter()}) + "\n")
    return out
cls.optimizer_step = clocked
sys.argv = ["finetune"] + sys.argv[3:]
from finetune.cli import main
main()
'''


def _cpu_tps(tokens: list[int], cpu: list[float | None], skip: int) -> float:
    """Real tokens per CPU second of the process over the steps after the first ``skip``
    (``cpu``: each step's CPU seconds, None where not known): less moved by other jobs on a
    shared box than tokens per wall second (a process waiting for a core accrues none)."""
    t, c = tokens[skip:], cpu[skip:]
    assert all(x is not None for x in c), "a measured step without its CPU seconds"
    return sum(t) / sum(c)  # type: ignore[arg-type]


def ours(job: Job, backend: str, side: str, i: int) -> dict[str, Any]:
    run = job.work / f"ours_{backend}_{i}"
    clock = job.work / f"ours_{backend}_{i}_clock.jsonl"
    cmd = [sys.executable, "-c", OURS_DRIVER, str(clock), backend, f"backend={backend}", *job.arch, "objective=dpo",
           "objective.loss_type=sigmoid", f"objective.beta={BETA}", "data=jsonl", f"data.path={job.data['ours']}",
           "data.val_fraction=0", "train.eval_every=0", f"train.steps={job.steps}", f"train.batch_size={job.trl_rows}",
           f"train.seq_len={SEQ}", "train.warmup_steps=0", "train.schedule=constant", "optim.lr=1e-4",
           "optim.weight_decay=0", "method.lora.rank=8", "method.lora.alpha=16", "method.lora.dropout=0",
           "train.progress=false", f"hydra.run.dir={run}"]
    _, rss, wall = _run(cmd, job.work)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.startswith('{"step"')]
    r = _measured([x["tokens"] for x in recs], [x["samples"] for x in recs], [x["step_seconds"] for x in recs], job.skip)
    ticks = [json.loads(x)["cpu"] for x in clock.read_text().splitlines()]
    r["cpu_tps"] = _cpu_tps([x["tokens"] for x in recs], [None, *(b - a for a, b in itertools.pairwise(ticks))],
                            job.skip)
    peaks = [x["peak_allocated_bytes"] for x in recs if x.get("mlx_peak_bytes") is not None]
    return {**r, "rss": rss, "wall": wall, "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"],
            "mlx_peak": max(peaks) if peaks else None}  # mlx: MLX's allocator peak of the run so far


TRL_PEER = r'''
import json, sys, time
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer
model_dir, data, steps, out, seq, batch, beta = sys.argv[1:8]
tok = AutoTokenizer.from_pretrained(model_dir)
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
cfg = DPOConfig(output_dir=out, per_device_train_batch_size=int(batch), max_steps=int(steps), learning_rate=1e-4,
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1, save_strategy="no",
                report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0, max_length=int(seq),
                beta=float(beta), loss_type=["sigmoid"], gradient_checkpointing=False, bf16=False,
                precompute_ref_log_probs=False)
tokens, samples, times, losses = [], [], [], []
class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.t)
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            losses.append(logs["loss"])
class Counted(DPOTrainer):
    def training_step(self, model, inputs, *a, **k):
        tokens.append(int(inputs["attention_mask"].sum()))  # chosen and rejected rows, pad excluded
        samples.append(int(inputs["input_ids"].shape[0]) // 2)
        return super().training_step(model, inputs, *a, **k)
recs = [json.loads(x) for x in open(data)]
trainer = Counted(model=model, args=cfg, train_dataset=Dataset.from_list(recs), processing_class=tok,
                  peft_config=lora, callbacks=[Clock()])
trainer.train()
json.dump({"tokens": tokens, "samples": samples, "times": times, "losses": losses}, open(out + "/counts.json", "w"))
'''


def trl(job: Job, backend: str, side: str, i: int) -> dict[str, Any]:
    out = job.work / f"trl_{i}"
    out.mkdir()
    cmd = [sys.executable, "-c", TRL_PEER, str(job.model), str(job.data["trl"]), str(job.steps), str(out), str(SEQ),
           str(job.trl_rows), str(BETA)]
    _, rss, wall = _run(cmd, job.work, env={"TOKENIZERS_PARALLELISM": "false"})
    c = json.loads((out / "counts.json").read_text())
    return {**_measured(c["tokens"], c["samples"], c["times"], job.skip), "rss": rss, "wall": wall,
            "loss_first": c["losses"][0], "loss_last": c["losses"][-1]}


MLX_LORA_DRIVER = r'''
import json, sys, time
import numpy as np
import mlx_lm_lora.train as L
import mlx_lm_lora.utils as U
import mlx_lm_lora.trainer.dpo_trainer as D
import mlx.core as mx
from mlx_lm.tuner.callbacks import TrainingCallback
reports, rows = sys.argv[1], sys.argv[2]
info = mx.device_info
# train_dpo wires Metal memory (set_wired_limit(device_info()["max_recommended_working_set_size"])); the CPU
# device has no such key: 0 there, no wiring (what mx.set_wired_limit(0) means)
mx.device_info = lambda: {"max_recommended_working_set_size": 0, **info()}
to_lora = U.linear_to_lora_layers
def q_v(model, num_layers, config, use_dora=False):  # its config has no keys: every linear layer otherwise
    return to_lora(model, num_layers, {**config, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}, use_dora=use_dora)
U.linear_to_lora_layers = q_v
batches = D.iterate_dpo_batches
def recorded(*a, **k):  # each training batch: when it was asked for, and each row's real length
    for b in batches(*a, **k):
        if k.get("train"):
            lens = [int(np.flatnonzero(np.array(m))[-1]) + 1 for ms in (b[2], b[3]) for m in ms]
            open(rows, "a").write(json.dumps({"t": time.perf_counter(), "cpu": time.process_time(), "lengths": lens}) + "\n")
        yield b
D.iterate_dpo_batches = recorded
class Rec(TrainingCallback):
    def on_train_loss_report(self, info):
        open(reports, "a").write(json.dumps(info, default=lambda v: v.tolist()) + "\n")  # some are mx arrays
run = L.run
L.run = lambda args, training_callback=None: run(args, Rec())
sys.argv = ["mlx_lm_lora.train"] + sys.argv[3:]
L.main()
'''


def mlx_lm_lora(job: Job, backend: str, side: str, i: int) -> dict[str, Any]:
    cfg = job.work / "mlx_lm_lora.yaml"
    cfg.write_text(json.dumps({"lora_parameters": {"rank": 8, "scale": 2.0, "dropout": 0.0},
                               "optimizer_config": {"adamw": {"weight_decay": 0.0}}}))
    reports, rows_file = job.work / f"mlx_lora_{i}.jsonl", job.work / f"mlx_lora_{i}_rows.jsonl"
    layers = next(int(x.split("=")[1]) for x in job.arch if x.startswith("model.config.num_hidden_layers="))
    never = str(10 * job.steps)
    cmd = [sys.executable, "-c", MLX_LORA_DRIVER, str(reports), str(rows_file), "--model", str(job.model), "--train",
           "--train-mode", "dpo", "--train-type", "lora", "--dpo-cpo-loss-type", "sigmoid", "--beta", str(BETA),
           "--data", str(job.data["mlx_lm_lora"]), "--batch-size", str(job.trl_rows), "--iters", str(job.steps),
           "--max-seq-length", str(SEQ), "--num-layers", str(layers), "--learning-rate", "1e-4",
           "--steps-per-report", never, "--steps-per-eval", never, "--val-batches", "1",
           "--adapter-path", str(job.work / f"mlx_lora_{i}"), "--save-every", never, "--optimizer", "adamw",
           "-c", str(cfg)]
    out, rss, wall = _run(cmd, job.work)
    recs = [json.loads(x) for x in rows_file.read_text().splitlines()] if rows_file.exists() else []
    reps = [json.loads(x) for x in reports.read_text().splitlines()] if reports.exists() else []
    if len(recs) != job.steps or not reps:
        sys.exit(f"could not read mlx-lm-lora's batches and report:\n{out[-3000:]}")
    # step k (1-based) runs between the requests of batches k and k + 1; the last step (with its
    # validation) has no next request and is not measured
    secs = [b["t"] - a["t"] for a, b in itertools.pairwise(recs)]
    r = _measured([sum(x["lengths"]) for x in recs[:-1]], [len(x["lengths"]) // 2 for x in recs[:-1]], secs, job.skip)
    r["cpu_tps"] = _cpu_tps([sum(x["lengths"]) for x in recs[:-1]],
                            [b["cpu"] - a["cpu"] for a, b in itertools.pairwise(recs)], job.skip)
    return {**r, "rss": rss, "wall": wall, "mlx_peak": reps[-1]["peak_memory"] * 1e9, "loss_last": reps[-1]["train_loss"]}


RUNNERS = {"ours": ours, "trl": trl, "mlx_lm_lora": mlx_lm_lora}


def summarize(res: dict[str, list[dict[str, Any]]]) -> tuple[list[str], dict[str, Any]]:
    """Table and ratios (ours vs each peer) of one backend's runs; and the same as a dict."""
    lines = [f"{'side':26}{'real tok/s':>12}{'tokens/step':>13}{'pairs/step':>12}{'s/step':>8}{'peak RSS GiB':>14}"]
    keys = ("tps", "tokens_per_step", "samples_per_step", "step_seconds", "rss", "cpu_tps")
    med = {side: {k: _med(rs, k) for k in keys if all(k in r for r in rs)} for side, rs in res.items()}
    for side, m in med.items():
        lines.append(f"{LABEL[side]:26}{m['tps']:12,.0f}{m['tokens_per_step']:13,.0f}{m['samples_per_step']:12.2f}"
                     f"{m['step_seconds']:8.2f}{_gib(m['rss']):>14}")
    ratios = []
    for b in [s for s in res if s != "ours"]:
        t, m = med["ours"]["tps"] / med[b]["tps"], med["ours"]["rss"] / med[b]["rss"]
        ratios.append({"side": "ours", "vs": b, "tokens_per_sec": t, "peak_rss": m})
        lines.append(f"  ours vs {LABEL[b]}: real tokens/s {med['ours']['tps']:,.0f} vs {med[b]['tps']:,.0f} = {t:.2f}x; "
                     f"peak RSS {_gib(med['ours']['rss'])} vs {_gib(med[b]['rss'])} GiB = {m:.2f}x")
        if "cpu_tps" in med["ours"] and "cpu_tps" in med[b]:
            c = med["ours"]["cpu_tps"] / med[b]["cpu_tps"]
            ratios[-1]["tokens_per_cpu_sec"] = c
            lines.append(f"  ours vs {LABEL[b]}: real tokens per CPU second (each process's own) "
                         f"{med['ours']['cpu_tps']:,.0f} vs {med[b]['cpu_tps']:,.0f} = {c:.2f}x")
    if "mlx_lm_lora" in res:
        lines.append(f"  MLX allocator peak (mx.get_peak_memory over the run, both sides; ours: metrics.jsonl "
                     f"peak_allocated_bytes): ours {_gib(_med(res['ours'], 'mlx_peak'))} vs mlx-lm-lora "
                     f"{_gib(_med(res['mlx_lm_lora'], 'mlx_peak'))} GiB")
    return lines, {"medians": med, "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="cuda,mlx", help="comma list of cuda, mlx")
    ap.add_argument("--runs", type=int, default=2, help="runs per side, alternating")
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per run; the first --skip are not measured")
    ap.add_argument("--skip", type=int, default=4, help="warm-up steps every side leaves out")
    ap.add_argument("--pairs", type=int, default=400, help="GSM8K pairs (records that fit in the max length)")
    ap.add_argument("--batch", type=int, default=BATCH, help="pairs per optimizer step, every side")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--out", type=Path, help="write the results as JSON here too")
    a = ap.parse_args()
    backends = a.backends.split(",")
    if bad := [b for b in backends if b not in SIDES]:
        sys.exit(f"unknown backend: {bad}; backends {list(SIDES)}")
    # mlx-lm-lora's last step carries its validation and is not measured: one more step than the skip at least
    if a.skip < 1 or a.steps <= a.skip + 1:
        sys.exit(f"--steps must exceed --skip + 1 ({a.skip + 1}): every side leaves its first {a.skip} steps out")
    if not GSM8K.is_file():
        sys.exit(f"{GSM8K} not found: set FINETUNE_GSM8K=/path/to/gsm8k/train.jsonl")
    from transformers import AutoTokenizer

    from finetune.config import compose
    from finetune.model.source import resolve_model_dir

    arch = MODELS[a.model]
    model = resolve_model_dir(compose("/tmp/unused", *arch).model)
    tok = AutoTokenizer.from_pretrained(model)
    pairs, skipped = build_pairs(tok, a.pairs, SEQ)
    check = token_check(pairs, tok, SEQ)
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"pairs: {len(pairs)} GSM8K records (chosen: the answer; rejected: its final number + 1), {skipped} passed "
          f"over as longer than {SEQ} tokens; uptime at start: {load}")
    print("token check (every pair, each side's tokenization): sequences / tokens / completion tokens")
    for side, c in check.items():
        print(f"  {side:12} {c['sequences']:6} {c['tokens']:10,} {c['completion_tokens']:10,}")
    report: dict[str, Any] = {
        "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S"), "uptime_start": load,
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
        "versions": versions() + f", mlx-lm-lora {_version('mlx-lm-lora')}",
        "model": {"name": a.model, "dir": model.name, "arch": arch}, "pairs": len(pairs), "steps": a.steps,
        "runs": a.runs, "skip": a.skip, "seq": SEQ, "batch_pairs": a.batch, "beta": BETA, "loss_type": "sigmoid",
        "token_check": check, "counts": COUNTS, "backends": {}}
    lines: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # Job.trl_rows carries the pairs per step here (every side's batch)
        job = Job(work, model, arch, "dpo", write_pairs(work, pairs), a.steps, a.batch, None, a.skip)
        for backend in backends:
            sides = SIDES[backend]
            res: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
            for i in range(a.runs):
                for side in (sides if i % 2 == 0 else sides[::-1]):
                    r = RUNNERS[side](job, backend, side, i)
                    res[side].append(r)
                    cpu = f", {r['cpu_tps']:,.0f} real tok per CPU s" if "cpu_tps" in r else ""
                    print(f"{backend} run {i} {LABEL[side]}: {r['tps']:,.0f} real tok/s{cpu}, {r['tokens_per_step']:,.0f} "
                          f"tokens and {r['samples_per_step']:.2f} pairs a step, {r['step_seconds']:.2f} s/step, "
                          f"peak RSS {_gib(r['rss'])} GiB, {r['wall']:.0f} s wall, last loss {r['loss_last']:.4f}",
                          flush=True)
            ls, summary = summarize(res)
            lines += [f"\nbackend={backend}, model {a.model}, DPO sigmoid beta {BETA}: medians of {a.runs} runs", *ls]
            report["backends"][backend] = {"runs": res, **summary}
    report["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"\nmachine: {report['machine']}; {report['versions']}; {a.runs} runs each, {a.steps} steps (first "
          f"{a.skip} not measured), {a.batch} pairs a step, max length {SEQ}, {len(pairs)} pairs, model {a.model} "
          f"({model.name}); {report['date']}; {time.perf_counter() - t0:.0f} s; uptime at end: {report['uptime_end']}")
    for ln in lines:
        print(ln)
    print("what each side counts as a token:")
    for side in dict.fromkeys(s for b in backends for s in SIDES[b]):
        print(f"  {LABEL[side]}: {COUNTS[side]}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.out}")


def _version(pkg: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    main()
