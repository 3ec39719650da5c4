"""Our preference objectives against TRL's own trainers (TRL 1.16), 5 optimizer steps each:
DPOTrainer (loss_type sigmoid, ipo, hinge), ORPOTrainer and CPOTrainer with loss_type="simpo"
(trl.experimental), KTOTrainer; on the tiny Qwen2, and DPO and KTO on a tiny Llama too. Both sides start from the same LoRA adapter weights (ours, as our
backend initialised them, loaded into TRL's PEFT model) and see the same batches; the test
asserts every step's loss and reward metrics equal TRL's within 1e-4.

What is aligned, by configuration only (neither side's math is edited):
- the batches: TRL's data set is our step schedule's records in our order, read sequentially
  (``train_sampling_strategy="sequential"``), ``per_device_train_batch_size`` = our effective
  batch, no gradient accumulation; KTO's KL rows rotate within that batch, as ours within the step;
- tokens: the tiny tokenizer adds no BOS, TRL appends EOS to each completion as we do, no
  truncation (``max_length`` = our ``train.seq_len`` = 128, longer than any record);
- the update: plain SGD, constant learning rate, no warmup, no weight decay, the global
  gradient norm clipped to 1.0 on both sides; fp32 throughout (TRL's configs default to
  ``bf16=True``, set False), no dropout.

One convention truly differs: TRL's ORPOTrainer takes the NLL term over the prompt's tokens as
well as the completion's (``concatenated_forward``: "orpo chosen nll loss is computed over the
full prompt and response"), the ORPO paper and we over the completion's only. ORPO's records
here have a one-token prompt, which no position predicts, so both NLLs count the same tokens.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

STEPS, LR, SEQ = 5, 0.5, 128
BATCH = {"pairs": 2, "unpaired": 4}  # items a step: 4 rows either way (KTO: both labels in most steps)
TOL = 1e-4


def _pairs(n: int, one_token_prompt: bool = False) -> list[dict]:
    out = []
    for i in range(1, n + 1):
        p = "Q" if one_token_prompt else f"Question {i}: what is {i} + {i}?\nAnswer:\n"
        out.append({"prompt": p, "chosen": f" {i} + {i} = {2 * i}\n#### {2 * i}",
                    "rejected": f" {i} + {i} = {2 * i}\n#### {2 * i + 1}"})
    return out


def _unpaired(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i} + {i}?\nAnswer:\n",
             "completion": f"{i} + {i} = {2 * i if i % 3 else 2 * i + 1}\n#### {2 * i if i % 3 else 2 * i + 1}",
             "label": bool(i % 3)} for i in range(1, n + 1)]


# case -> (our objective overrides, TRL trainer, TRL config keywords, records)
CASES = {
    "dpo-sigmoid": (("objective=dpo", "objective.beta=0.1"), "dpo", {"loss_type": ["sigmoid"], "beta": 0.1}, "pairs"),
    "dpo-ipo": (("objective=dpo", "objective.loss_type=ipo", "objective.beta=0.5"), "dpo",
                {"loss_type": ["ipo"], "beta": 0.5}, "pairs"),
    "dpo-hinge": (("objective=dpo", "objective.loss_type=hinge", "objective.beta=0.1"), "dpo",
                  {"loss_type": ["hinge"], "beta": 0.1}, "pairs"),
    "orpo": (("objective=orpo", "objective.beta=0.1"), "orpo", {"beta": 0.1}, "pairs1"),
    "simpo": (("objective=simpo", "objective.beta=2.0", "objective.gamma=0.5"), "simpo",
              {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}, "pairs"),
    "kto": (("objective=kto", "objective.beta=0.1", "objective.desirable_weight=1.0",
             "objective.undesirable_weight=1.5"), "kto",
            {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.5}, "unpaired"),
}
RECORDS = {"pairs": lambda: _pairs(10), "pairs1": lambda: _pairs(10, True), "unpaired": lambda: _unpaired(20)}


@pytest.fixture(scope="module")
def models():
    """family -> (checkpoint dir, tokenizer): the tiny Qwen2, and a tiny Llama (tests/families.py,
    untied head, Llama-3 RoPE) with the same tokenizer; built on first use."""
    from transformers import AutoTokenizer

    from finetune.config import Config
    from finetune.model.tiny import build_tiny

    built: dict[str, tuple] = {}

    def get(family: str):
        if family not in built:
            if family == "qwen2":
                d = build_tiny(Config(run_dir="unused").model)
            else:
                from families import build_family

                d = build_family(family)
            built[family] = (d, AutoTokenizer.from_pretrained(str(d)))
        return built[family]

    return get


def _ours(d, tok, overrides, records, batch, tmp_path):
    """Our backend's 5 steps as the loop takes them (finetune/run/loop.py ``_pair_step``,
    ``_unpaired_step``: the step's scales, KTO's z0 once a step, one optimizer step each).
    Returns (the adapter's initial weights, its LoRA config, per-step metrics, the records in
    the order the steps read them)."""
    from peft import get_peft_model_state_dict

    from conftest import make_spec
    from finetune.backends.cuda.runtime import CudaBackend
    from finetune.data.pairs import PairSource, UnpairedSource, pair_counts
    from finetune.data.tokens import tokenize

    spec = make_spec(tmp_path / "ours", "backend=cuda", "backend.device=cpu", "precision=32-true", "optim=sgd",
                     f"optim.lr={LR}", f"model.path={d}", *overrides)
    kto = spec.objective.unpaired
    t = tokenize(records, tok, SEQ, True, pairs=not kto, unpaired=kto)
    src = (UnpairedSource if kto else PairSource)(t, tok.pad_token_id, batch, 0, 0.0, 0, 1, SEQ)
    assert len(src.lengths) == len(records)  # nothing dropped: item i is record i
    be = CudaBackend()
    be.setup(spec, d)
    init = {k: v.detach().clone() for k, v in get_peft_model_state_dict(be.model).items()}
    steps, order = [], []
    for s in range(STEPS):
        b = src.train_batch(s)
        if kto:
            order += list(b.indices)
            sums = be.forward_backward_unpaired(b, 1 / len(b.lengths), be.kto_kl(src.kl_batch(b), batch))
        else:
            order += list(b.indices[0::2] // 2)
            pairs, chosen = pair_counts(b)
            sums = be.forward_backward_pairs(b, 1 / pairs, 1 / chosen)
        be.optimizer_step(LR)
        steps.append({"loss": sums.loss, **sums.metrics()})
    return init, be.model.peft_config["default"], steps, [records[int(i)] for i in order]


def _trl(kind, d, tok, init, lora, ordered, batch, extra, tmp_path):
    """TRL's trainer ``kind`` over ``ordered`` from ``init``: its logged metrics per step."""
    from datasets import Dataset
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    common = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                  max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, optim="sgd",
                  weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no",
                  use_cpu=True, train_sampling_strategy="sequential", bf16=False, fp16=False, disable_tqdm=True,
                  seed=0, max_length=SEQ, disable_dropout=True, gradient_checkpointing=False, **extra)
    if kind == "dpo":
        from trl import DPOConfig as Cfg, DPOTrainer as Trainer
    elif kind == "orpo":
        from trl.experimental.orpo import ORPOConfig as Cfg, ORPOTrainer as Trainer
    elif kind == "simpo":
        from trl.experimental.cpo import CPOConfig as Cfg, CPOTrainer as Trainer
    else:
        from trl import KTOConfig as Cfg, KTOTrainer as Trainer
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32), lora)
    set_peft_model_state_dict(model, init)
    trainer = Trainer(model=model, args=Cfg(**common), train_dataset=Dataset.from_list(ordered), processing_class=tok)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


# every objective on the tiny Qwen2; DPO (a reference pass) and KTO (its KL rows too) on a Llama as well
RUNS = [(case, "qwen2") for case in CASES] + [("dpo-sigmoid", "llama"), ("kto", "llama")]


@pytest.mark.parametrize("case, family", RUNS, ids=[f"{c}-{f}" for c, f in RUNS])
def test_steps_equal_trls_trainer(case, family, models, tmp_path):
    overrides, kind, extra, data = CASES[case]
    d, tok = models(family)
    records = RECORDS[data]()
    batch = BATCH["unpaired" if kind == "kto" else "pairs"]
    init, lora, ours, ordered = _ours(d, tok, overrides, records, batch, tmp_path)
    theirs = _trl(kind, d, tok, init, lora, ordered, batch, extra, tmp_path)
    assert len(theirs) == STEPS
    worst, compared = 0.0, 0
    for step, (o, t) in enumerate(zip(ours, theirs), 1):
        for k, v in o.items():
            if v is None or k not in t:  # KTO: no rewards/accuracies; a step without one label
                continue
            assert v == pytest.approx(t[k], abs=TOL), (case, step, k, v, t[k])
            worst, compared = max(worst, abs(v - t[k])), compared + 1
    assert compared >= STEPS * 5
    # the policy moved: the figures compared are not those of an untrained adapter (DPO's and
    # KTO's rewards are 0 until the policy leaves the reference)
    assert max(abs(o["rewards/chosen"] or 0) + abs(o["rewards/rejected"] or 0) for o in ours[1:]) > 10 * TOL
    if kind == "kto":  # and KTO's z0 was compared where it is not clamped to 0
        assert max(o["kl"] for o in ours) > 10 * TOL
    print(f"\n{case} ({family}): {compared} figures over {STEPS} steps, max |ours - TRL| = {worst:.2e}; "
          f"loss {ours[0]['loss']:.4f} -> {ours[-1]['loss']:.4f}")
