"""The GPU benchmark of issue 14, in one prepared script for a lent CUDA machine.

    bash benchmarks/gpu_bench.sh                 # the whole bench, ~7-8 min on one H200
    bash benchmarks/gpu_bench.sh --quick         # about half: micro-batch 4 only, 20 steps, half the grid
    bash benchmarks/gpu_bench.sh --smoke         # CPU end to end: tiny shape, 3 steps, 1 run per side
    bash benchmarks/gpu_bench.sh --parts grid    # one section (peers, chunk, grid; comma-separated)

The model: a random Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP
4864, vocabulary 151,936 so the logits are real-size, tied embeddings) built here by
finetune.model.tiny's builder (numpy weights, a byte-level BPE trained on the built-in data: its own
vocabulary is a few hundred tokens, every id below 151,936), then stored in bf16 with a
config.json that says so, so ``precision=auto`` trains bf16 weights. No download.

In the order they run:

1. Planner vs measured over a grid of 14 configurations (method, micro-batch, seq_len,
   checkpointing, optimizer), plus one row in every mode for issue 34's FSDP-QLoRA at world size 1
   with CPU offload and activation offload, on the same 0.5B shape, 3 steps each, records longer than seq_len
   so every sample is exactly seq_len tokens (what the planner plans for). The planner's
   ``peak_allocated_bytes`` predicts torch's max_memory_allocated, i.e. summary.json
   ``memory.peaks.allocated_bytes``: that pair carries the error and the targets. Issue 30's
   figures beside it: the planned steady reserved (the allocator replay) against
   ``memory.peaks.reserved_bytes``, step 1's planned reserved against step 1's measured (the run's
   own ``plan_error``), and the planned NVML used and host RSS against the run's peaks
   (``plan_error_run``). The grid's processes run a few at a time: each process has its own
   allocator, so its allocator peaks are its own (NVML's device figure is shared: run with
   ``--grid-workers 1`` to read it alone); no time is taken there.
2. Ours (``finetune backend=cuda precision=auto``, LoRA r=8 alpha 16 on q_proj/v_proj, AdamW lr
   1e-4 constant, micro-batch 4 and 8, seq_len 1024) against Hugging Face ``Trainer`` + PEFT on
   the same model directory, data, sample count, max length, LoRA shape and optimizer
   (``optim="adamw_torch"``: torch.optim.AdamW as ours; the Trainer's default would be the fused
   AdamW), with its usual recipe: ``bf16=True``, dynamic padding (DataCollatorForLanguageModeling).
   GSM8K as text records ("Question: ...\\nAnswer: ..."), every token in the loss, steps x
   micro-batch samples (one epoch: both sides see every sample once, so the same longest sample
   drives both peaks). Alternating fresh processes (ours, peer, peer, ours, ...), medians.
   Real (non-pad) tokens/s over the steps after the warm-up: ours from metrics.jsonl ``tokens``
   / ``step_seconds`` (the loop reads the loss every step, so a step's time includes its GPU
   work); the Trainer's from its batches' attention masks, counted in the collator on the host
   (no device sync), timed on_step_begin to on_step_end with a torch.cuda.synchronize() at both.
   Neither count holds the work between steps (ours: the memory sample after a step; the
   Trainer: its callbacks and logging), so a second figure, "loop tok/s", is every real token
   over the whole training loop's wall time, warm-up included (ours summary.json ``wall_s``; the
   Trainer's ``train_runtime``).
   Peak reserved: ours summary.json ``memory.peaks.reserved_bytes``; the peer's
   torch.cuda.max_memory_reserved() at on_train_end. Both are whole-process peaks.
3. Chunked loss: ours with ``train.loss_chunk=0`` (the runs of part 2) against
   ``train.loss_chunk=1024``, interleaved in the same rounds, at the largest micro-batch.

Time: the model build (~30 s), the grid (bounded: a few processes at once), then rounds of the
timed runs; no run starts that would end past ``--deadline-s`` (500 s; the lent machine's limit
is 600 s a command), so a slow machine loses its last rounds, never the summaries.

Targets (issue 14) are printed beside the figures and never asserted: the exit status is 1 only
when a run crashed or timed out. Output goes to stdout and, where $OUT is set (the device tool's
folder), to $OUT/gpu_bench.txt as it is produced. GiB = 2^30 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from mlx_footprint import GSM8K, make_data  # (GSM8K: $FINETUNE_GSM8K or ../shared/data/gsm8k)

GIB = 2**30
MODEL = ["model=qwen2-0.5b"]  # the preset holds the 0.5B shape; model.path points at the random build
SMOKE_ARCH = ["model.config.hidden_size=64", "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4",
              "model.config.num_key_value_heads=2", "model.config.intermediate_size=128", "model.config.vocab_size=2048"]
# (method, micro-batch, seq_len, grad checkpointing, optimizer): every level of each axis at least twice
GRID: list[tuple[str, int, int, int, str]] = [
    ("lora", 1, 512, 0, "adamw"), ("lora", 4, 1024, 0, "adamw"), ("lora", 4, 1024, 1, "adamw"),
    ("lora", 4, 512, 0, "adamw_8bit"), ("lora", 1, 1024, 1, "paged_adamw_8bit"),
    ("dora", 1, 1024, 0, "adamw"), ("dora", 4, 512, 1, "adamw"),
    ("qlora", 1, 512, 0, "adamw"), ("qlora", 4, 1024, 0, "adamw"), ("qlora", 4, 1024, 1, "paged_adamw_8bit"),
    ("full", 1, 512, 0, "adamw"), ("full", 4, 512, 0, "adamw"), ("full", 4, 1024, 1, "adamw_8bit"),
    ("full", 1, 1024, 0, "paged_adamw_8bit"),
]
# lora, dora, full with 32-bit AdamW: what a CPU runs without bitsandbytes' GPU kernels; shorter sequences
SMOKE_GRID = [GRID[0], GRID[6], GRID[10]]
# issue 34's row, in every mode: FSDP-QLoRA at world size 1 (FSDP2 over this one process) with CPU offload of
# the shards, gradients and optimizer state, and activation offload; planned device and host against measured
OFFLOAD_POINT = ("qlora", 1, 1024, 1, "adamw")
OFFLOAD_OVERRIDES = ["backend.strategy=fsdp", "backend.cpu_offload=true", "train.activation_offload=true"]
SMOKE_SEQ = {512: 64, 1024: 128}


def grid_points(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(row name, overrides) of the grid this mode runs."""
    points = SMOKE_GRID if a.smoke else (GRID[::2] if a.quick else GRID)
    out = []
    for (m, b, t, c, o), extra in [*((p, []) for p in points), (OFFLOAD_POINT, OFFLOAD_OVERRIDES)]:
        t = SMOKE_SEQ[t] if a.smoke else t
        out.append((f"{m:5s} b={b} T={t:<4d} ckpt={c} {o}" + (" fsdp1+offload" if extra else ""),
                    [f"method={m}", f"train.batch_size={b}", f"train.seq_len={t}",
                     f"train.grad_checkpointing={str(bool(c)).lower()}", f"optim={o}", *extra]))
    return out


# ---- output ----------------------------------------------------------------------------------------

class Report:
    """Lines to stdout and, where a path is given, to that file as they are produced (a run cut
    short by the machine's limit still leaves what it printed)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.f = path.open("w") if path else None

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()


def gib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / GIB:.3f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt_x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def med(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def machine_lines(argv: list[str]) -> list[str]:
    """GPU, driver, library versions, date and the command, without touching CUDA in this process."""
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    gpu = "no NVIDIA GPU visible (NVML)"
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        if n:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            total = pynvml.nvmlDeviceGetMemoryInfo(h).total
            drv = pynvml.nvmlSystemGetDriverVersion()
            drv = drv.decode() if isinstance(drv, bytes) else drv
            gpu = f"{n} x {name}, {total / GIB:.1f} GiB, driver {drv}"
    except Exception as e:  # noqa: BLE001  (no nvidia-ml-py, no driver: NVMLError's many kinds)
        gpu = f"no NVIDIA GPU visible ({type(e).__name__})"
    cmd = os.environ.get("GPU_BENCH_CMD") or " ".join([Path(sys.executable).name, *argv])
    env = " ".join(f"{k}={os.environ[k]}" for k in ("FINETUNE_GSM8K", "FINETUNE_CACHE", "OUT") if os.environ.get(k))
    return [f"command: {cmd}" + (f"   (env: {env})" if env else ""),
            f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            (f"machine: {gpu}; {platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores; "
             f"python {platform.python_version()}"),
            (f"versions: torch {v('torch')}, transformers {v('transformers')}, peft {v('peft')}, "
             f"bitsandbytes {v('bitsandbytes')}, accelerate {v('accelerate')}, liger-kernel {v('liger-kernel')}")]


# ---- processes -------------------------------------------------------------------------------------

@dataclass
class Proc:
    rc: int | None  # None: killed at its timeout
    wall_s: float
    rss_bytes: int | None
    log: Path
    timed_out: bool = False

    def tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def run_proc(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> Proc:
    """Run ``cmd`` in its own session, output to ``log``; wall seconds and the process's peak RSS
    (``wait4``). Killed with its children past ``timeout_s``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    # not installed (a lent machine): the children import finetune from this checkout
    pp = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": pp, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    t0 = time.perf_counter()
    with log.open("w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout_s:
                os.killpg(p.pid, 9)
                os.wait4(p.pid, 0)
                p.returncode = -9  # reaped here: Popen must not wait for it again
                return Proc(None, time.perf_counter() - t0, None, log, timed_out=True)
            time.sleep(0.1)
    p.returncode = os.waitstatus_to_exitcode(status)
    rss = int(ru.ru_maxrss) * (1 if sys.platform == "darwin" else 1024)  # KiB on Linux
    return Proc(p.returncode, time.perf_counter() - t0, rss, log)


@dataclass
class Clock:
    """The whole run's time budget: a run whose usual length would end past ``deadline_s`` is not
    started, so the summaries print before the machine's per-command limit cuts everything."""
    deadline_s: float
    t0: float = field(default_factory=time.perf_counter)
    walls: list[float] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows(self, workers: int = 1) -> bool:
        typical = med(self.walls[-6:]) or 0.0
        return self.elapsed() + typical / max(workers, 1) < self.deadline_s


# ---- the model -------------------------------------------------------------------------------------

def build_model(arch: list[str]) -> Path:
    """The random Qwen2 of this shape in bf16: finetune.model.tiny's build (fp32 numpy weights, BPE
    tokenizer), converted once to bf16 weights with ``dtype: bfloat16`` in config.json."""
    from finetune.config import compose
    from finetune.io import atomic_dir
    from finetune.model.tiny import build_tiny, cache_root

    src = build_tiny(compose("/tmp/unused", *MODEL, *arch).model)
    dst = cache_root() / f"gpu-bench-bf16-{src.name.removeprefix('tiny-qwen2-')}"
    if (dst / "config.json").is_file():
        return dst
    import torch  # here, not above: a reused build needs no torch in this process
    from safetensors.torch import load_file, save_file

    with atomic_dir(dst) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json"):
                shutil.copy2(f, tmp / f.name)
        w = {k: (t.to(torch.bfloat16) if t.is_floating_point() else t) for k, t in load_file(src / "model.safetensors").items()}
        save_file(w, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((src / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# ---- parts 2 and 3: ours, the peer, chunked loss --------------------------------------------------

def ours_cmd(a: argparse.Namespace, data: Path, run: Path, b: int, steps: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "finetune", "backend=cuda", "precision=auto", *MODEL, *a.arch,
            f"model.path={a.model_dir}", "method=lora", "method.lora.rank=8", "method.lora.alpha=16",
            "method.lora.keys=[q_proj,v_proj]", "data=jsonl", f"data.path={data}", "data.val_fraction=0",
            f"data.cache_dir={a.work / 'tokens'}", "train.eval_every=0", f"train.steps={steps}",
            f"train.batch_size={b}", f"train.seq_len={a.seq_len}", "train.warmup_steps=0",
            "train.schedule=constant", "optim=adamw", "optim.lr=1e-4", "train.progress=false",
            f"hydra.run.dir={run}", *extra]


def read_ours(run: Path, warmup: int) -> dict[str, Any]:
    s = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.startswith("{")]
    rows = [r for r in rows if "step" in r and "step_seconds" in r]
    tail = rows[warmup:]
    secs = sum(r["step_seconds"] for r in tail)
    peaks = s["memory"]["peaks"]
    return {"tps": sum(r["tokens"] for r in tail) / secs if secs > 0 else None,
            "loop_tps": sum(r["tokens"] for r in rows) / s["wall_s"] if s.get("wall_s") else None,
            "reserved": peaks.get("reserved_bytes"), "allocated": peaks.get("allocated_bytes"),
            "adapted": [e.get("action") for e in s.get("adaptations") or []], "steps": len(rows)}


TRAINER = r'''
import json, sys, time
import torch
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainerCallback, TrainingArguments)
a = json.loads(sys.argv[1])
cuda = torch.cuda.is_available()
tok = AutoTokenizer.from_pretrained(a["model"])
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
rows = [json.loads(x)["text"] for x in open(a["data"])]
enc = tok([t + tok.eos_token for t in rows], truncation=True, max_length=a["seq"])
ds = [{"input_ids": ids, "attention_mask": m} for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.bfloat16)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                         task_type="CAUSAL_LM"))
base, tokens, times = DataCollatorForLanguageModeling(tok, mlm=False), [], []
def collate(features):  # on the host, before the batch moves to the GPU: no device sync
    batch = base(features)
    tokens.append(int(batch["attention_mask"].sum()))
    return batch
sync = torch.cuda.synchronize if cuda else (lambda: None)
peaks = {}
class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        sync()
        self.t = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        sync()
        times.append(time.perf_counter() - self.t)
    def on_train_end(self, args, state, control, **kw):
        if cuda:
            peaks.update(reserved=torch.cuda.max_memory_reserved(), allocated=torch.cuda.max_memory_allocated())
args = TrainingArguments(output_dir=a["out"], per_device_train_batch_size=a["batch"], max_steps=a["steps"],
                         learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                         optim="adamw_torch", bf16=True, logging_steps=10 ** 6, save_strategy="no", report_to=[],
                         use_cpu=not cuda, dataloader_num_workers=0, disable_tqdm=True, seed=0)
out = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Clock()], data_collator=collate).train()
# batches are fetched ahead of the steps: step k trained the k-th collated batch
json.dump({"tokens": tokens[:len(times)], "times": times, "train_runtime": out.metrics["train_runtime"], **peaks},
          open(a["out"] + "/counts.json", "w"))
'''


def read_peer(out: Path, warmup: int) -> dict[str, Any]:
    c = json.loads((out / "counts.json").read_text())
    tok, t = c["tokens"][warmup:], c["times"][warmup:]
    loop = c.get("train_runtime")
    return {"tps": sum(tok) / sum(t) if t and sum(t) > 0 else None,
            "loop_tps": sum(c["tokens"]) / loop if loop else None, "reserved": c.get("reserved"),
            "allocated": c.get("allocated"), "adapted": [], "steps": len(c["times"])}


def longest_tokens(model_dir: Path, data: Path, seq_len: int) -> int:
    """The longest sample in tokens (EOS included, cut at seq_len): the batch that sets the peak.
    Tokenized as both sides load the tokenizer (transformers'; the bare tokenizer.json splits
    digits differently)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [json.loads(x)["text"] for x in data.read_text().splitlines()]
    return min(seq_len, max(len(ids) + 1 for ids in tok(texts)["input_ids"]))


def part_runs(a: argparse.Namespace, say: Report, clock: Clock) -> tuple[dict[int, dict[str, Any]], bool]:
    """Ours, the peer and the chunked side: fresh processes in rounds, each round one run of every
    side at every micro-batch, the sides' order reversed every other round (ours, peer, peer,
    ours, ...). Round-major, so a time budget that runs out leaves every micro-batch as many runs."""
    crashed = False
    batches = list(a.micro_batches) + ([a.chunk_batch] if "chunk" in a.parts and a.chunk_batch not in a.micro_batches
                                       else [])
    res: dict[int, dict[str, Any]] = {}
    for b in batches:
        sides = (["ours"] if "peers" in a.parts or b == a.chunk_batch else []) + \
                (["peer"] if "peers" in a.parts and b in a.micro_batches else []) + \
                (["chunk"] if "chunk" in a.parts and b == a.chunk_batch else [])
        if sides:  # steps x b samples: one epoch, each side sees every sample once
            res[b] = {"data": make_data(a.work / f"mb{b}", a.steps * b) / "train.jsonl", "sides": sides,
                      **{s: [] for s in sides}}
    say(f"{'micro':>5s} {'round':>5s} {'side':14s} {'real tok/s':>11s} {'loop tok/s':>11s} {'peak resv GiB':>14s} {'peak alloc GiB':>15s} "
        f"{'peak RSS GiB':>13s} {'wall s':>7s}  note")
    for i in range(a.runs):
        for b, r in res.items():
            for side in (r["sides"] if i % 2 == 0 else r["sides"][::-1]):
                label = {"ours": "ours", "peer": "Trainer+PEFT", "chunk": f"ours chunk={a.loss_chunk}"}[side]
                if not clock.allows():
                    say(f"{b:5d} {i:5d} {label:14s} skipped: the time budget ({a.deadline_s:.0f} s) would be passed")
                    continue
                run, log = a.work / f"{side}_mb{b}_{i}", a.work / "logs" / f"{side}_mb{b}_{i}.log"
                if side == "peer":
                    run.mkdir(parents=True, exist_ok=True)
                    arg = {"model": str(a.model_dir), "data": str(r["data"]), "seq": a.seq_len, "batch": b,
                           "steps": a.steps, "out": str(run)}
                    p = run_proc([sys.executable, "-c", TRAINER, json.dumps(arg)], log, a.timeout_s)
                else:
                    extra = [f"train.loss_chunk={a.loss_chunk if side == 'chunk' else 0}"]
                    p = run_proc(ours_cmd(a, r["data"], run, b, a.steps, extra), log, a.timeout_s)
                clock.walls.append(p.wall_s)
                if p.rc != 0:
                    crashed = True
                    why = "timed out" if p.timed_out else f"exit {p.rc}"
                    say(f"{b:5d} {i:5d} {label:14s} CRASHED ({why}, {p.wall_s:.0f} s); log tail:\n{p.tail()}")
                    continue
                m = read_peer(run, a.warmup) if side == "peer" else read_ours(run, a.warmup)
                m["rss"] = p.rss_bytes
                r[side].append(m)
                note = f"governor: {', '.join(map(str, m['adapted']))}" if m["adapted"] else ""
                tps, loop = ("n/a" if m[k] is None else f"{m[k]:,.0f}" for k in ("tps", "loop_tps"))
                say(f"{b:5d} {i:5d} {label:14s} {tps:>11s} {loop:>11s} {gib(m['reserved']):>14s} {gib(m['allocated']):>15s} "
                    f"{gib(m['rss']):>13s} {p.wall_s:7.1f}  {note}")
    return res, crashed


def ratio_line(what: str, sides: tuple[str, str], x: float | None, y: float | None, unit: str,
               target: tuple[str, Any] | None = None, n: str = "") -> str:
    """``ratio WHAT: A x vs B y = r`` with the target beside it (``(text, predicate on r)``)."""
    fig = (lambda v: gib(v)) if unit == "GiB" else (lambda v: "n/a" if v is None else f"{v:,.0f}")
    r = ratio(x, y)
    tail = ""
    if target:
        verdict = "" if r is None else (": met" if target[1](r) else ": missed")
        tail = f" [target {target[0]}{verdict}]"
    return (f"ratio {what}: {sides[0]} {fig(x)} vs {sides[1]} {fig(y)} {unit} = {fmt_x(r)}{tail}"
            + (f" ({n})" if n else ""))


def summarize_peers(a: argparse.Namespace, res: dict[int, dict[str, Any]], say: Report) -> None:
    say("")
    say("ours vs HF Trainer + PEFT, medians (targets, issue 14: >= 2x real tokens/s, <= 0.6x peak reserved "
        "at the same batch)")
    for b in a.micro_batches:
        r = res.get(b, {})
        o, p = r.get("ours", []), r.get("peer", [])
        m = lambda rows, k: med([x[k] for x in rows])
        n = f"{len(o)} + {len(p)} runs"
        say(ratio_line(f"micro-batch {b} real tokens/s, steps {a.warmup + 1}..{a.steps}", ("ours", "peer"),
                       m(o, "tps"), m(p, "tps"), "tok/s", (">= 2.00x", lambda x: x >= 2.0), n))
        say(ratio_line(f"micro-batch {b} loop tokens/s, all steps over the loop's wall time", ("ours", "peer"),
                       m(o, "loop_tps"), m(p, "loop_tps"), "tok/s", n=n))
        say(ratio_line(f"micro-batch {b} peak reserved", ("ours", "peer"), m(o, "reserved"), m(p, "reserved"), "GiB",
                       ("<= 0.60x", lambda x: x <= 0.6), n))
        say(ratio_line(f"micro-batch {b} peak allocated", ("ours", "peer"), m(o, "allocated"), m(p, "allocated"),
                       "GiB", n=n))


def summarize_chunk(a: argparse.Namespace, res: dict[int, dict[str, Any]], say: Report) -> None:
    from finetune import planner
    from finetune.config import compose
    from finetune.resolver import resolve

    b = a.chunk_batch
    r = res.get(b, {})
    off, on = r.get("ours", []), r.get("chunk", [])
    say("")
    say(f"chunked loss at micro-batch {b}, train.loss_chunk={a.loss_chunk} vs 0, medians (targets, issue 14: "
        "peak down by at least the logits' share, at most 5% slower)")
    readers = [f for f in ("backends/cuda/runtime.py", "finetune/run/loop.py") if "loss_chunk" in (REPO / f).read_text()]
    if not readers:
        say("  note: neither backends/cuda/runtime.py nor finetune/run/loop.py mentions loss_chunk in this tree: "
            "both sides likely run the same loss")
    logits = None
    if "data" in r:
        longest = longest_tokens(a.model_dir, r["data"], a.seq_len)
        cfg = compose(a.work / "plan", "backend=cuda", "precision=auto", *MODEL, *a.arch, f"model.path={a.model_dir}",
                      f"train.batch_size={b}", f"train.seq_len={a.seq_len}")
        logits = planner.plan(resolve(cfg), seq_len=longest, recommend=False)["bytes"]["logits"]
        say(f"  the logits' share: {gib(logits)} GiB (the planner's logits + loss bytes at {b} x {longest} tokens, "
            "the longest sample's batch)")
    m = lambda rows, k: med([x[k] for x in rows])
    n = f"{len(on)} + {len(off)} runs"
    o_r, n_r = m(off, "reserved"), m(on, "reserved")
    down = None if o_r is None or n_r is None else o_r - n_r
    say(ratio_line("chunked/unchunked peak reserved", ("chunked", "unchunked"), n_r, o_r, "GiB", n=n)
        + f"; down {gib(down)} GiB [target: down >= {gib(logits)} GiB"
        + ("" if down is None or logits is None else (": met" if down >= logits else ": missed")) + "]")
    say(ratio_line("chunked/unchunked peak allocated", ("chunked", "unchunked"), m(on, "allocated"),
                   m(off, "allocated"), "GiB", n=n))
    say(ratio_line(f"chunked/unchunked real tokens/s, steps {a.warmup + 1}..{a.steps}", ("chunked", "unchunked"),
                   m(on, "tps"), m(off, "tps"), "tok/s", (">= 0.95x", lambda x: x >= 0.95), n))


# ---- part 1: the planner against the measured peak -------------------------------------------------

def long_texts(path: Path, n: int, per: int = 12) -> Path:
    """GSM8K texts joined ``per`` at a time: each record longer than the grid's longest seq_len,
    so every sample is cut to exactly seq_len tokens, the full micro-batch the planner plans."""
    rows = [json.loads(x) for x in GSM8K.read_text().splitlines()[: n * per]]
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": "\n\n".join(texts[i * per:(i + 1) * per])}) + "\n" for i in range(n)))
    return path


def part_grid(a: argparse.Namespace, say: Report, clock: Clock) -> bool:
    """Part 3: one row per configuration, the planner's figures against the run's own peaks."""
    from finetune import planner
    from finetune.config import compose
    from finetune.resolver import resolve

    data = long_texts(a.work / "grid" / "long.jsonl", 64)
    base = ["backend=cuda", "precision=auto", *MODEL, *a.arch, f"model.path={a.model_dir}", "data=jsonl",
            f"data.path={data}", "data.val_fraction=0", f"data.cache_dir={a.work / 'tokens'}", "train.eval_every=0",
            f"train.steps={a.grid_steps}", "train.progress=false", "memory.adapt=false"]
    say(f"{'#':>2s} {'configuration':40s} {'plan alloc GiB':>14s} {'peak alloc GiB':>14s} {'error':>7s} "
        f"{'plan resv GiB':>13s} {'peak resv GiB':>13s} {'error':>7s} {'resv1 err':>9s} {'NVML err':>8s} "
        f"{'RSS err':>7s} {'wall s':>6s}")
    crashed = False
    plans: dict[int, dict[str, Any]] = {}
    points = grid_points(a)
    for i, (name, ov) in enumerate(points):  # in this thread: Hydra's compose is not thread-safe
        try:
            plans[i] = planner.plan(resolve(compose(a.work / "grid" / f"g{i:02d}", *base, *ov)), recommend=False)
        except Exception as e:  # noqa: BLE001  (a configuration the planner refuses is a row, not the end of the bench)
            crashed = True
            say(f"{i:2d} {name:40s} CRASHED in the planner: {type(e).__name__}: {e}")
    threads = str(max(1, (os.cpu_count() or 2) // a.grid_workers))

    def one(i: int) -> Proc | None:
        if not clock.allows(a.grid_workers):
            return None
        cmd = [sys.executable, "-m", "finetune", *base, *points[i][1], f"hydra.run.dir={a.work / 'grid' / f'g{i:02d}'}"]
        return run_proc(cmd, a.work / "logs" / f"grid_{i:02d}.log", a.timeout_s, env={"OMP_NUM_THREADS": threads})

    errors: list[tuple[float | None, float | None]] = []
    pct = lambda e: "n/a" if e is None else f"{e:+.1%}"
    with ThreadPoolExecutor(max_workers=a.grid_workers) as pool:
        futures = {pool.submit(one, i): i for i in plans}
        for fut in as_completed(futures):
            i = futures[fut]
            name, p, plan = points[i][0], fut.result(), plans[i]
            if p is None:
                say(f"{i:2d} {name:40s} skipped: the time budget ({a.deadline_s:.0f} s) would be passed")
                continue
            clock.walls.append(p.wall_s)
            if p.rc != 0:
                crashed = True
                say(f"{i:2d} {name:40s} CRASHED ({'timed out' if p.timed_out else f'exit {p.rc}'}); log tail:\n{p.tail()}")
                continue
            summary = json.loads((a.work / "grid" / f"g{i:02d}" / "summary.json").read_text())
            peaks = summary["memory"]["peaks"]
            m_a, m_r = peaks.get("allocated_bytes"), peaks.get("reserved_bytes")
            p_a, p_p = plan["peak_allocated_bytes"], plan["phases"]["steady"]["reserved_bytes"]
            e_a = (p_a - m_a) / m_a if m_a else None
            e_r = (p_p - m_r) / m_r if m_r else None
            # step 1's reserved, and the run's NVML used and RSS peaks (the run's own plan_error:
            # planned at step 1's real width; NVML counts the other grid runs on the device too
            # when --grid-workers > 1)
            first = (summary.get("plan_error") or {}).get("step1_reserved") or {}
            run = summary.get("plan_error_run") or {}
            e_1 = first.get("relative_error")
            e_n = (run.get("peak_device_level") or {}).get("relative_error")
            e_h = (run.get("peak_host") or {}).get("relative_error")
            errors.append((e_a, e_r, e_1, e_n, e_h))
            say(f"{i:2d} {name:40s} {gib(p_a):>14s} {gib(m_a):>14s} {pct(e_a):>7s} {gib(p_p):>13s} {gib(m_r):>13s} "
                f"{pct(e_r):>7s} {pct(e_1):>9s} {pct(e_n):>8s} {pct(e_h):>7s} {p.wall_s:6.1f}")
    say("")
    for k, what, target in ((0, "planner peak_allocated_bytes vs measured memory.peaks.allocated_bytes",
                             "targets: every configuration within 10%, median within 5%"),
                            (1, "planned steady reserved (the allocator replay) vs memory.peaks.reserved_bytes",
                             "issue 30: within 10%"),
                            (2, "planned step-1 reserved vs step 1's measured reserved peak", "issue 30: within 10%"),
                            (3, "planned NVML used (device level) vs memory.peaks.device_used_bytes",
                             "issue 30: within 10% (one grid worker; more share the device)"),
                            (4, "planned host RSS vs memory.peaks.rss_bytes", "issue 30: within 10%")):
        errs = [abs(e[k]) for e in errors if e[k] is not None]
        if not errs:
            say(f"ratio {what}: worst |error| n/a, median |error| n/a ({len(errors)} ran, none with an allocator "
                f"peak on this device) [{target}]")
            continue
        worst, median = max(errs), statistics.median(errs)
        verdict = (f" (within 10%: {sum(e <= 0.10 for e in errs)}/{len(errs)}; median target "
                   f"{'met' if median <= 0.05 else 'missed'})") if k == 0 else ""
        say(f"ratio {what}: worst |error| {worst:.1%}, median |error| {median:.1%} over {len(errs)} "
            f"configurations{verdict} [{target}]")
    return crashed


# ---- entry -----------------------------------------------------------------------------------------

def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU end to end: tiny shape, 3 steps, 1 run per side, 3-point grid")
    ap.add_argument("--quick", action="store_true", help="about half: micro-batch 4 only, 20 steps, half the grid")
    ap.add_argument("--parts", default="peers,chunk,grid", help="comma-separated: peers, chunk, grid")
    ap.add_argument("--runs", type=int, help="runs per side (default 3; smoke 1)")
    ap.add_argument("--steps", type=int, help="optimizer steps per timed run (default 30; quick 20; smoke 3)")
    ap.add_argument("--warmup", type=int, help="first steps left out of tokens/s (default 10; quick 5; smoke 1)")
    ap.add_argument("--micro-batches", help="comma-separated (default 4,8; quick and smoke 4)")
    ap.add_argument("--chunk-batch", type=int, help="micro-batch of the chunked-loss comparison (default the largest)")
    ap.add_argument("--loss-chunk", type=int, help="train.loss_chunk tokens of the chunked side (default 1024; smoke 64)")
    ap.add_argument("--seq-len", type=int, help="train.seq_len / the peer's max_length (default 1024; smoke 256)")
    ap.add_argument("--grid-steps", type=int, default=3, help="steps per grid run (3: step 2 holds the lazy optimizer state)")
    ap.add_argument("--grid-workers", type=int, help="grid processes at once (default 4 with a GPU, else 2)")
    ap.add_argument("--deadline-s", type=float, help="start no run that would end past this (default 500; quick 330)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="one process's limit")
    ap.add_argument("--work", type=Path, help="keep run dirs and logs here (default: a temporary dir, removed)")
    ap.add_argument("--out", type=Path, help="report file (default $OUT/gpu_bench.txt where $OUT is set)")
    a = ap.parse_args(argv)
    from finetune.budget import cuda_devices

    gpu = cuda_devices()[0] > 0
    d = {"runs": 1, "steps": 3, "warmup": 1, "micro_batches": "4", "loss_chunk": 64, "seq_len": 256,
         "deadline_s": 1800.0} if a.smoke else \
        {"runs": 3, "steps": 20, "warmup": 5, "micro_batches": "4", "loss_chunk": 1024, "seq_len": 1024,
         "deadline_s": 330.0} if a.quick else \
        {"runs": 3, "steps": 30, "warmup": 10, "micro_batches": "4,8", "loss_chunk": 1024, "seq_len": 1024,
         "deadline_s": 500.0}
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.micro_batches = [int(x) for x in str(a.micro_batches).split(",")]
    a.chunk_batch = a.chunk_batch or max(a.micro_batches)
    a.grid_workers = a.grid_workers or (4 if gpu else 2)  # a process's start is mostly one core's imports
    a.parts = {p.strip() for p in a.parts.split(",") if p.strip()}
    a.arch = SMOKE_ARCH if a.smoke else []
    a.gpu = gpu
    if a.out is None and os.environ.get("OUT"):
        a.out = Path(os.environ["OUT"]) / "gpu_bench.txt"
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    say = Report(a.out)
    for ln in machine_lines(argv):
        say(ln)
    mode = "smoke (CPU shape)" if a.smoke else ("quick" if a.quick else "full")
    say(f"mode: {mode}; parts: {','.join(sorted(a.parts))}; {a.runs} run(s) per side, {a.steps} steps "
        f"({a.warmup} warm-up left out), micro-batch {','.join(map(str, a.micro_batches))}, seq_len {a.seq_len}, "
        f"chunk side train.loss_chunk={a.loss_chunk} at micro-batch {a.chunk_batch}; time budget {a.deadline_s:.0f} s")
    if a.smoke:
        say("smoke: a check that every part runs end to end; no figure from a tiny model on a CPU means anything")
    if not a.gpu:
        say("no GPU: every memory figure below that needs CUDA's allocator is n/a (peak RSS is the host's)")
    if not GSM8K.is_file():
        say(f"{GSM8K} not found: set FINETUNE_GSM8K=/path/to/gsm8k/train.jsonl")
        return 1
    clock = Clock(a.deadline_s)
    keep = a.work is not None
    a.work = a.work or Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    a.work.mkdir(parents=True, exist_ok=True)
    crashed = False
    try:
        t = time.perf_counter()
        a.model_dir = build_model(a.arch)
        say(f"model: {a.model_dir} (random Qwen2, bf16{'; tiny smoke shape' if a.smoke else ', 0.5B shape'}); "
            f"built or reused in {time.perf_counter() - t:.0f} s")
        # the grid first: its processes run a few at a time and measure no time, so it has a bounded
        # length; the rounds after it are what the time budget trims (a round at a time)
        if "grid" in a.parts:
            t = time.perf_counter()
            say("")
            say(f"== planner vs measured peak ({a.grid_steps} steps each, {a.grid_workers} at a time; error = "
                f"(planned - measured) / measured) ==")
            crashed |= part_grid(a, say, clock)
            say(f"time: the grid took {time.perf_counter() - t:.0f} s")
        if a.parts & {"peers", "chunk"}:
            t = time.perf_counter()
            say("")
            say("== ours vs HF Trainer + PEFT, and chunked loss (alternating fresh processes, one at a time) ==")
            res, c = part_runs(a, say, clock)
            crashed |= c
            if "peers" in a.parts:
                summarize_peers(a, res, say)
            if "chunk" in a.parts:
                summarize_chunk(a, res, say)
            say(f"time: ours vs peer and chunked loss took {time.perf_counter() - t:.0f} s")
    finally:
        say(f"time: total {clock.elapsed():.0f} s" + (f"; run dirs and logs in {a.work}" if keep else ""))
        if not keep:
            shutil.rmtree(a.work, ignore_errors=True)
    if crashed:
        say("some runs crashed (see above): exit 1")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
