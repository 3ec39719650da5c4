"""Planned reserved against PEFT's published MetaMathQA runs (Llama-3.2-3B on an L40S).

    python benchmarks/plan_vs_published.py > benchmarks/results/plan_vs_metamathqa.txt

Each run of tests/data/measured/peft_metamathqa.json is planned as its command line says, at
several padded widths T, two ways:

- ours: ``mode=plan``'s steady state, the loop this project runs (zero_grad after the optimizer
  step, then empty_cache; the head's output freed with the loss);
- theirs: the same model, optimizer and shapes replayed through the allocator model with
  run.py's loop (``trace.build``'s ``zero_grad_first`` and ``outputs_kept``: zero_grad before the
  forward, the bf16 logits and the KV cache held until the next forward returns; batches
  right-padded with a mask), the steady step's reserved peak after an emptied cache.

The published figure is the 99th percentile over 5,000 steps of each step's reserved peak; the
width of the step at that percentile is not published (MetaMathQA is not on this machine). It
is a longest batch: BucketIterator sorts 80 samples longest first and cuts 20 batches, so one step
in 20 is padded to the longest of its 80 samples, and the 99th percentile of steps is at about
the 99.7th percentile of sample lengths, against the 1,300-character cap. The table prints
planned / published at each width, and the widths at which all four runs are within 10%.

A check of the loop's model that uses no reserved figure: the published mean of
memory_allocated() after a step against the plan's allocated at the end of a step, at the mean
sample length (a lower bound of the mean padded width). Nothing here is fitted. Imports neither
torch nor mlx.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from finetune.backends import memory_model  # noqa: E402
from finetune.backends.cuda import trace  # noqa: E402
from finetune.backends.cuda.alloc_config import parse_alloc_conf  # noqa: E402
from finetune.config import compose  # noqa: E402
from finetune.planner import plan  # noqa: E402
from finetune.planner.setup import inventory, resolve as setup  # noqa: E402
from finetune.resolver import resolve  # noqa: E402

WIDTHS = (300, 400, 470, 540, 600, 768)


def their_loop(spec: Any) -> tuple[int, int, int]:
    """(allocated peak, reserved peak, allocated at the end) of the steady step (the third,
    after empty_cache) of PEFT's run.py loop, one device."""
    arch, s = setup(spec)
    s = dataclasses.replace(s, step_widths=(), padding_mask=True)  # tokenizer.pad: right-padded, a mask
    mm = memory_model("cuda")
    tensors = inventory(arch, s)
    order = ["embed"] + [f"layer.{i}" for i in range(arch.layers)] + ["head"]
    tr = trace.build(arch, s, mm.rank_tensors(tensors, s), mm, {m: 0 for m in order}, 0,
                     mm.collective_buffers(tensors, s), steps=3, empty_cache_every=1,
                     zero_grad_first=True, outputs_kept=True)
    figs = trace.replay(tr, parse_alloc_conf(s.alloc_conf))
    step = [f for k, f in figs.items() if k.startswith("step3:")]
    return (max(f.peak_allocated for f in step), max(f.peak_reserved for f in step),
            figs["step3:optimizer"].end_allocated)


def main() -> None:
    data = json.loads((REPO / "tests" / "data" / "measured" / "peft_metamathqa.json").read_text())
    print(data["source"])
    print("their loop:", data["their_loop"])
    print()
    head = f"{'run':10s}{'loop':7s}{'published p99':>15s}" + "".join(f"{'T=' + str(w):>18s}" for w in WIDTHS)
    print(head)
    within: dict[str, set[int]] = {}
    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, r in data["runs"].items():
            args = [a for a in r["command"].split() if not a.startswith("train.seq_len=")]
            ours, theirs = [], []
            for w in WIDTHS:
                spec = resolve(compose(tmp, "mode=plan", *args, f"train.seq_len={w}"))
                ours.append(plan(spec, recommend=False)["phases"]["steady"]["reserved_bytes"])
                theirs.append(their_loop(spec)[1])
            pub = r["reserved_99th_bytes"]
            for loop, figs in (("ours", ours), ("theirs", theirs)):
                cells = [f"{v / 1e9:8.2f} GB {v / pub:5.2f}x" for v in figs]
                print(f"{name:10s}{loop:7s}{pub / 1e9:12.2f} GB" + "".join(f"{c:>18s}" for c in cells))
            within[name] = {w for w, v in zip(WIDTHS, theirs) if abs(v / pub - 1) < 0.10}
            t_mean = round(data["mean_sample_tokens"])
            end = their_loop(resolve(compose(tmp, "mode=plan", *args, f"train.seq_len={t_mean}")))[2]
            checks.append((name, r["allocated_after_step_avg_bytes"], end))
    both = sorted(set.intersection(*within.values()))
    print(f"\ntheirs within 10% of the published p99 for all four runs at T = {', '.join(map(str, both)) or 'none'}")
    print("the p99 step's width: BucketIterator pads one step in 20 to the longest of its 80 samples, so the 99th "
          "percentile of steps is at about the 99.7th percentile sample (0.8 ** (1 / 80)), just under the 1,300-character "
          "cap; that is 400 to 540 tokens only if Llama-3's tokenizer gives 3.3 to 2.5 characters a token on MetaMathQA "
          "(not measured: neither the data nor the tokenizer is on this machine; at 4 characters a token it would be "
          "~330 tokens, where the LoRA and DoRA runs plan 0.81-0.83x)")
    print("\nallocated after a step, published mean vs their loop planned at T = the mean sample length "
          f"({data['mean_sample_tokens']} tokens; padded batches are at least that wide):")
    for name, pub, planned in checks:
        print(f"  {name:10s}{pub / 1e9:8.3f} GB published  {planned / 1e9:8.3f} GB planned  {planned / pub:5.3f}x")
    print("\nwhy ours is over on the full fine-tune: our loop frees the gradients (zero_grad) before empty_cache, so "
          "each step carves its gradients and the foreach workspace (_foreach_sqrt: one more copy of every weight, "
          "6.4 GB) anew beside the activations' cached segments, which weight-shaped tensors mostly do not fit (T=600: "
          "8.3 GB cached when the optimizer step starts, 4.7 GB of new segments for the workspace); theirs keeps the "
          "gradients through empty_cache, and the blocks zero_grad frees at the next step are weight-shaped: the new "
          "gradients and the workspace take them again. Ours is not monotonic in T where the activations' segments "
          "(rounded to 2 MiB) happen to hold weight-shaped tensors: for T in (736, 768], [4T, 8192] in bf16 is a "
          "48 MiB segment, exactly an MLP weight's workspace tensor")
    print("\nours: mode=plan's steady reserved (memory.empty_cache_every=1 as their loop empties the cache every step, "
          "torch's default allocator, foreach AdamW); theirs: run.py's loop replayed (see above); "
          "ratio = planned / published 99th percentile")


if __name__ == "__main__":
    main()
