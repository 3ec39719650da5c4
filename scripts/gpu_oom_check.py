"""A real CUDA out-of-memory error, caught by the governor (used by gpu_check.sh).

    python scripts/gpu_oom_check.py OUT_DIR

1. Run A: LoRA on a widened tiny model with long sequences, micro-batch 8 x accumulation 4,
   no cap: its measured peak reserved is what micro-batch 8 needs.
2. Run B, same process: torch.cuda.set_per_process_memory_fraction caps the allocator at 1.3x
   that peak, and the run asks for micro-batch 32 x accumulation 1 (the same effective batch).
   Torch raises a real OutOfMemoryError; the governor frees, halves the micro-batch and redoes
   the same samples until it fits.
3. Checks: B recorded oom adaptations and ended below micro-batch 32, trained the same tokens
   as A, and its losses equal A's within float tolerance. Exit 1 if a check fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def long_texts(path: Path, n: int = 256) -> None:
    """Records longer than train.seq_len, so every sample is a full-length row."""
    from finetune.synthetic import generate

    recs = generate(n * 40, seed=3)
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(r["prompt"] + r["completion"] for r in recs[i * 40:(i + 1) * 40])})
                    + "\n")


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def main() -> int:
    import torch

    from finetune.cli import run
    from finetune.config import compose

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_oom_check")
    out.mkdir(parents=True, exist_ok=True)
    data = out / "long.jsonl"
    long_texts(data)
    common = ["backend=cuda", "method=lora", "model=tiny", "model.config.hidden_size=1024",
              "model.config.num_hidden_layers=8", "model.config.num_attention_heads=16",
              "model.config.num_key_value_heads=4", "model.config.intermediate_size=4096", "data=jsonl",
              f"data.path={data}", "train.seq_len=1024", "train.steps=4", "train.eval_every=0",
              "train.save_every=0", "train.progress=false"]
    a = run(compose(out / "A", *common, "train.batch_size=8", "train.grad_accum=4"))
    peak = a["memory"]["peaks"]["reserved_bytes"]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    cap = int(peak * 1.3)
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    print(f"A: micro-batch 8 peak reserved {peak / 2**30:.2f} GiB; cap for B: {cap / 2**30:.2f} GiB "
          f"({cap / total:.3f} of {total / 2**30:.1f} GiB)")
    b = run(compose(out / "B", *common, "train.batch_size=32", "train.grad_accum=1"))
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    ooms = [e for e in b["adaptations"] if e.get("trigger") == "oom"]
    for e in b["adaptations"]:
        print("B event:", json.dumps(e))
    la, lb = losses(out / "A"), losses(out / "B")
    print("A losses:", la)
    print("B losses:", lb)
    fails = []
    if not ooms:
        fails.append("no oom adaptation in B")
    if b["tokens"] != a["tokens"]:
        fails.append(f"tokens differ: A {a['tokens']} B {b['tokens']}")
    if len(la) != len(lb) or any(abs(x - y) > 1e-4 * max(1.0, abs(x)) for x, y in zip(la, lb)):
        fails.append("losses differ beyond 1e-4")
    if b["memory"]["peaks"]["reserved_bytes"] > cap:
        fails.append("B's peak reserved exceeds the cap")
    for f in fails:
        print("FAIL:", f)
    print("gpu_oom_check:", "PASS" if not fails else "FAIL")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
