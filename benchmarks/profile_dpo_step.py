"""Where a DPO step's time goes on torch's CPU, and how much of vs_peers_dpo.py's cuda ratio is padding.

    python benchmarks/profile_dpo_step.py --steps 6

One process, the tiny model of vs_peers.py with PEFT LoRA r8/alpha 16 on q_proj and v_proj, the
same GSM8K pairs (vs_peers_dpo.build_pairs, chat-rendered, no EOS), 4 pairs a step. Each step is
the DPO work both ours and TRL's DPOTrainer do: the reference forward of the 8 rows under
``torch.no_grad()`` and ``disable_adapter()``, the policy forward of the same rows, log-probs of
the completion tokens, the sigmoid loss, backward, AdamW. It is run on two batchings of the same
pairs, alternated step by step:

- grouped: pairs of like length a step (sorted by their longer sequence, cut in fours; what ours'
  length grouping does), rows padded to the step's longest;
- random: 4 random pairs a step (TRL's sampler), rows padded to the step's longest.

Printed: per batching, real and padded tokens a step, and the seconds of each phase (reference
forward, policy forward, backward + optimizer); real tokens/s and padded tokens/s. Same code on
both batchings, so their ratio of real tokens/s is what padding alone is worth; the rest of the
measured ours/TRL ratio is the trainers' own per-step work.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from vs_peers import MODELS
from vs_peers_dpo import BATCH, BETA, SEQ, build_pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per batching (after one warm-up each)")
    ap.add_argument("--pairs", type=int, default=200)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.config import compose
    from finetune.model.source import resolve_model_dir

    model_dir = resolve_model_dir(compose("/tmp/unused", *MODELS["tiny"]).model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs, _ = build_pairs(tok, a.pairs, SEQ)
    rows = []  # per pair: (prompt length, chosen ids, rejected ids)
    for p in pairs:
        user = [{"role": "user", "content": p["prompt"]}]
        plen = len(tok.apply_chat_template(user, add_generation_prompt=True, return_dict=False))
        rows.append((plen, *(tok.apply_chat_template(user + [{"role": "assistant", "content": c}], return_dict=False)
                             for c in (p["chosen"], p["rejected"]))))
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                      task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)

    def batch(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        seqs = [(rows[i][0], s) for i in idx for s in rows[i][1:]]
        width = max(len(s) for _, s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        att = torch.zeros(len(seqs), width, dtype=torch.long)
        comp = torch.zeros(len(seqs), width)
        for r, (plen, s) in enumerate(seqs):
            ids[r, :len(s)], att[r, :len(s)], comp[r, plen:len(s)] = torch.tensor(s), 1, 1.0
        return ids, att, comp, sum(len(s) for _, s in seqs)

    def logps(ids: torch.Tensor, att: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1].float()
        picked = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (picked * comp[:, 1:]).sum(1)

    def step(idx: list[int]) -> dict[str, float]:
        ids, att, comp, real = batch(idx)
        t0 = time.perf_counter()
        with torch.no_grad(), model.disable_adapter():
            ref = logps(ids, att, comp)
        t1 = time.perf_counter()
        pol = logps(ids, att, comp)
        logits = BETA * ((pol[0::2] - ref[0::2]) - (pol[1::2] - ref[1::2]))
        loss = -F.logsigmoid(logits).mean()
        t2 = time.perf_counter()
        loss.backward()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        return {"real": real, "padded": ids.numel(), "ref": t1 - t0, "fwd": t2 - t1, "bwd_opt": t3 - t2}

    longest = [max(len(r[1]), len(r[2])) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: longest[i])
    groups = [order[i:i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]
    rng = random.Random(0)
    rng.shuffle(groups)
    out: dict[str, list[dict[str, float]]] = {"grouped": [], "random": []}
    for k in range(a.steps + 1):  # step 0 of each: warm-up, left out
        for name in (("grouped", "random") if k % 2 == 0 else ("random", "grouped")):
            idx = groups[k] if name == "grouped" else rng.sample(range(len(rows)), BATCH)
            r = step(idx)
            if k:
                out[name].append(r)
    print(f"DPO step phases, tiny model, torch {torch.__version__} on the CPU ({torch.get_num_threads()} threads), "
          f"{BATCH} pairs a step, {a.steps} steps each, alternated")
    print(f"{'batching':10}{'real tok':>10}{'padded':>9}{'pad %':>7}{'ref fwd s':>11}{'pol fwd s':>11}"
          f"{'bwd+opt s':>11}{'real tok/s':>12}{'padded tok/s':>14}")
    tps = {}
    for name, rs in out.items():
        real, pad = (statistics.mean(r[k] for r in rs) for k in ("real", "padded"))
        ph = {k: statistics.mean(r[k] for r in rs) for k in ("ref", "fwd", "bwd_opt")}
        secs = sum(ph.values())
        tps[name] = real / secs
        print(f"{name:10}{real:10,.0f}{pad:9,.0f}{100 * (1 - real / pad):7.1f}{ph['ref']:11.3f}{ph['fwd']:11.3f}"
              f"{ph['bwd_opt']:11.3f}{real / secs:12,.0f}{pad / secs:14,.0f}")
    print(f"grouped / random real tokens/s: {tps['grouped'] / tps['random']:.2f}x")


if __name__ == "__main__":
    main()
