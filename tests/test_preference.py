"""Preference objectives (objective=dpo|orpo|simpo): the losses against TRL's own loss code, bad
pair records named file:line, and on the tiny model: ln 2 at step 1 and the same loss when a
step is split by whole pairs."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from finetune import objectives
from finetune.data.formats import check_pair
from finetune.errors import UserError
from finetune.spec import ObjectiveSpec

G = torch.Generator().manual_seed(0)
PC, PR = -torch.rand(6, generator=G) * 30 - 5, -torch.rand(6, generator=G) * 30 - 5  # summed log-probs
RC, RR = PC + torch.randn(6, generator=G), PR + torch.randn(6, generator=G)
NC, NR = torch.tensor([7., 9, 11, 5, 8, 12]), torch.tensor([6., 10, 9, 7, 8, 4])
CPU = SimpleNamespace(device="cpu")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_matches_trl_formula(loss_type):
    """TRL 1.16 DPOTrainer._compute_loss's per-sequence loss, restated from its code path
    (the trainer itself needs a model: its lines for these loss types)."""
    import torch.nn.functional as F

    o = ObjectiveSpec(name="dpo", loss_type=loss_type, beta=0.3)
    t = objectives.pair_terms(o, torch, PC, PR, NC, NR, RC, RR)
    d = (PC - RC) - (PR - RR)
    want = {"sigmoid": -F.logsigmoid(0.3 * d), "hinge": torch.relu(1 - 0.3 * d),
            "ipo": ((PC - RC) / NC - (PR - RR) / NR - 1 / (2 * 0.3)) ** 2}[loss_type]
    assert torch.allclose(t.losses, want, atol=1e-6)
    assert torch.allclose(t.chosen_rewards, 0.3 * (PC - RC)) and torch.allclose(t.rejected_rewards, 0.3 * (PR - RR))


def test_cdpo_label_smoothing_matches_trl_cpo_sigmoid():
    from trl.experimental.cpo import CPOTrainer

    o = ObjectiveSpec(name="dpo", beta=0.2, label_smoothing=0.1)
    t = objectives.pair_terms(o, torch, PC, PR, NC, NR, RC, RR)
    ns = SimpleNamespace(alpha=0.0, loss_type="sigmoid", beta=0.2, label_smoothing=0.1, accelerator=CPU)
    want, _, _ = CPOTrainer.cpo_loss(ns, PC - RC, PR - RR)
    assert torch.allclose(t.losses, want, atol=1e-6)


def test_orpo_and_simpo_match_trl_loss_functions():
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    o = ObjectiveSpec(name="orpo", beta=0.25)
    t = objectives.pair_terms(o, torch, PC, PR, NC, NR)
    losses, cr, rr, _, _ = ORPOTrainer.odds_ratio_loss(SimpleNamespace(beta=0.25, accelerator=CPU), PC / NC, PR / NR)
    assert torch.allclose(t.losses, -losses, atol=1e-6)  # TRL subtracts its (beta * log sigmoid) term
    assert torch.allclose(t.chosen_rewards, cr) and torch.allclose(t.rejected_rewards, rr)
    o = ObjectiveSpec(name="simpo", beta=2.0, gamma=0.5)
    t = objectives.pair_terms(o, torch, PC, PR, NC, NR)
    ns = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.0,
                         accelerator=CPU)
    losses, cr, rr = CPOTrainer.cpo_loss(ns, PC / NC, PR / NR)
    assert torch.allclose(t.losses, losses, atol=1e-6)
    assert torch.allclose(t.chosen_rewards, cr) and torch.allclose(t.rejected_rewards, rr)


def test_policy_equal_to_reference_gives_ln2():
    t = objectives.pair_terms(ObjectiveSpec(name="dpo"), torch, PC, PR, NC, NR, PC, PR)
    assert torch.allclose(t.losses, torch.full_like(PC, math.log(2)))


@pytest.mark.parametrize("rec, words", [
    ({"prompt": "q", "chosen": "a"}, "without 'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": "  "}, "'rejected' is empty"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "'chosen' equals 'rejected'"),
    ({"chosen": "a", "rejected": "b"}, "without 'prompt'"),
])
def test_bad_pairs_named_by_line(rec, words):
    with pytest.raises(UserError, match=words) as e:
        check_pair(rec, "pairs.jsonl:3")
    assert str(e.value).startswith("pairs.jsonl:3")


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from finetune.config import Config
    from finetune.model.tiny import build_tiny

    d = build_tiny(Config(run_dir="unused").model)
    return d, AutoTokenizer.from_pretrained(str(d))


def _pairs(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i} + {i}?\nAnswer:\n", "chosen": f"{i} + {i} = {2 * i}\n#### {2 * i}",
             "rejected": f"{i} + {i} = {2 * i}\n#### -{2 * i + 1}"} for i in range(1, n + 1)]


def test_wrong_format_for_objective_is_one_line(tiny):
    from finetune.data.tokens import tokenize

    _, tok = tiny
    with pytest.raises(UserError, match="objective=dpo"):
        tokenize(_pairs(2), tok, 128, True)
    with pytest.raises(UserError, match="objective=sft"):
        tokenize([{"prompt": "a", "completion": "b"}], tok, 128, True, pairs=True)


def test_preference_records_name_the_prompt_format_generation_uses(tiny):
    """adapter/finetune.json's prompt_format (what mode=generate formats a prompt as) of a run on
    pairs or KTO records: string prompts trained as they are ("raw"), chat turns through the chat
    template ("chat"), as SFT's prompt/completion and messages records do."""
    from finetune.data.tokens import tokenize
    from finetune.prompting import prompt_format

    _, tok = tiny
    chat = [{**p, "prompt": [{"role": "user", "content": p["prompt"]}]} for p in _pairs(3)]
    kto = [{"prompt": p["prompt"], "completion": p["chosen"], "label": True} for p in _pairs(3)]
    kto_chat = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in kto]
    got = {name: tokenize(recs, tok, 128, True, pairs=pairs, unpaired=not pairs).formats
           for name, recs, pairs in (("pairs", _pairs(3), True), ("chat", chat, True), ("kto", kto, False),
                                     ("kto_chat", kto_chat, False))}
    assert got == {"pairs": {"preference pairs": 3}, "chat": {"preference pairs, chat turns": 3},
                   "kto": {"unpaired (KTO)": 3}, "kto_chat": {"unpaired (KTO), chat turns": 3}}
    assert [prompt_format(got[k]) for k in ("pairs", "chat", "kto", "kto_chat")] == ["raw", "chat", "raw", "chat"]


def test_dpo_step_one_is_ln2_and_split_by_whole_pairs_keeps_loss(tiny, tmp_path):
    from conftest import make_spec
    from finetune.backends.cuda.runtime import CudaBackend
    from finetune.data.pairs import PairSource, pair_counts
    from finetune.data.tokens import tokenize
    from finetune.objectives import PairSums

    d, tok = tiny
    src = PairSource(tokenize(_pairs(8), tok, 128, True, pairs=True), tok.pad_token_id, 4, 0, 0.0, 0)
    batch = src.train_batch(0)
    pairs, chosen = pair_counts(batch)
    assert pairs == 4 and np.array_equal(batch.indices[0::2] + 1, batch.indices[1::2])  # pairs side by side
    for method in ("lora", "full"):
        spec = make_spec(tmp_path, "backend=cuda", "backend.device=cpu", "precision=32-true", "objective=dpo",
                         f"method={method}")
        be = CudaBackend()
        be.setup(spec, d)
        be.precompute_reference(src.all_batches(4), len(src.samples.ids))  # a table under full only
        whole = be.forward_backward_pairs(batch, 1 / pairs, 1 / chosen)
        g1 = [p.grad.clone() for p in be.model.parameters() if p.grad is not None]
        be.zero_grad()
        split = PairSums()
        for micro in batch.split(2):  # one pair a micro-batch
            split = split.add(be.forward_backward_pairs(micro, 1 / pairs, 1 / chosen))
        g2 = [p.grad.clone() for p in be.model.parameters() if p.grad is not None]
        assert whole.loss == pytest.approx(math.log(2), abs=1e-6), method
        assert split.loss == pytest.approx(whole.loss, abs=1e-6)
        assert whole.metrics() == pytest.approx(split.metrics(), abs=1e-5)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))
        be.zero_grad()


# -- KTO (objective=kto): unpaired records labelled desirable or not ------------------------------

def test_kto_matches_trl_formula():
    """TRL 1.16 KTOTrainer._compute_loss (loss_type="kto"), its lines restated: KL clamped at 0,
    1 - sigmoid(beta (r - kl)) for desirable, 1 - sigmoid(beta (kl - r)) for undesirable, each
    class weighted, the mean over the records."""
    o = ObjectiveSpec(name="kto", beta=0.3, desirable_weight=1.5, undesirable_weight=0.7)
    desirable = torch.tensor([True, False, True, True, False, False])
    kl = float(objectives.kto_kl(torch, PC, RC))
    assert kl == pytest.approx(max(0.0, float((PC - RC).mean())))
    t = objectives.kto_terms(o, torch, PC, RC, desirable, 0.2)
    r = PC - RC
    want = torch.where(desirable, 1.5 * (1 - torch.sigmoid(0.3 * (r - 0.2))), 0.7 * (1 - torch.sigmoid(0.3 * (0.2 - r))))
    assert torch.allclose(t.losses, want, atol=1e-6) and torch.allclose(t.chosen_rewards, 0.3 * r)
    assert float(objectives.kto_kl(torch, PC, PC + 5)) == 0.0  # a negative estimate is clamped


@pytest.mark.parametrize("rec, words", [
    ({"completion": "a", "label": True}, "without 'prompt'"),
    ({"prompt": "q", "completion": " ", "label": False}, "'completion' is empty"),
    ({"prompt": "", "completion": "a", "label": False}, "'prompt' is empty"),
    ({"prompt": "q", "completion": "a", "label": "yes"}, "'label' is 'yes'"),
    ({"prompt": "q", "completion": [{"role": "assistant"}], "label": True}, "'completion' turn 0"),
])
def test_bad_kto_records_named_by_line(rec, words):
    from finetune.data.formats import check_record

    with pytest.raises(UserError, match=words) as e:
        check_record(rec, "kto.jsonl:7")
    assert str(e.value).startswith("kto.jsonl:7")


def _kto(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i} + {i}?\nAnswer:\n",
             "completion": f"{i} + {i} = {2 * i}\n#### {2 * i if i % 2 else 2 * i + 1}", "label": bool(i % 2)}
            for i in range(1, n + 1)]


def test_kto_records_for_other_objectives_are_one_line(tiny):
    from finetune.data.tokens import tokenize

    _, tok = tiny
    with pytest.raises(UserError, match="with objective=kto"):
        tokenize(_kto(2), tok, 128, True)  # to sft
    with pytest.raises(UserError, match="with objective=kto"):
        tokenize(_kto(2), tok, 128, True, pairs=True)
    with pytest.raises(UserError, match="objective=kto needs labelled records.*objective=dpo"):
        tokenize(_pairs(2), tok, 128, True, unpaired=True)
    with pytest.raises(UserError, match="objective=kto needs labelled records.*objective=sft"):
        tokenize([{"prompt": "a", "completion": "b"}], tok, 128, True, unpaired=True)


def test_kto_label_in_mask_and_mismatched_kl_rows(tiny):
    from finetune.data.pairs import UnpairedSource
    from finetune.data.tokens import tokenize
    from finetune.objectives import unpaired_labels

    _, tok = tiny
    t = tokenize(_kto(6), tok, 128, True, unpaired=True)
    src = UnpairedSource(t, tok.pad_token_id, 6, 0, 0.0, 0, 1, 128)
    b = src.train_batch(0)
    assert list(unpaired_labels(b)) == [bool((i + 1) % 2) for i in b.indices]
    assert int(t.targets().sum()) == int(b.loss_mask[:, 1:].sum())  # the label entry is no target
    kl = src.kl_batch(b)
    for row in range(6):  # prompt of record i, completion of the record before it in the step
        i, j = b.indices[row], b.indices[row - 1]
        m = np.asarray(t.masks[i]); mj = np.asarray(t.masks[j])
        p = 1 + int(np.argmax(m[1:] > 0)); pj = 1 + int(np.argmax(mj[1:] > 0))
        want = np.concatenate([np.asarray(t.ids[i])[:p], np.asarray(t.ids[j])[pj:]])
        assert np.array_equal(kl.input_ids[row, :len(want)], want) and kl.loss_mask[row].sum() == len(mj) - pj


def test_kto_kl_once_per_step_keeps_a_split_steps_loss(tiny, tmp_path):
    """The step's z0 comes from all its records; micro-batches of one record each, at that z0,
    give the whole step's loss, metrics and gradients (a z0 per micro-batch would not)."""
    from conftest import make_spec
    from finetune.backends.cuda.runtime import CudaBackend
    from finetune.data.pairs import UnpairedSource
    from finetune.data.tokens import tokenize
    from finetune.objectives import PairSums

    d, tok = tiny
    src = UnpairedSource(tokenize(_kto(8), tok, 128, True, unpaired=True), tok.pad_token_id, 4, 0, 0.0, 0, 1, 128)
    batch, be = src.train_batch(0), CudaBackend()
    be.setup(make_spec(tmp_path, "backend=cuda", "backend.device=cpu", "precision=32-true", "objective=kto",
                       "objective.beta=0.5"), d)
    kl_rows = src.kl_batch(batch)
    assert be.kto_kl(kl_rows, 4) == 0.0  # LoRA's B starts at zero: the policy is the reference
    whole = be.forward_backward_unpaired(batch, 1 / 4, 0.0)
    assert whole.loss == pytest.approx(0.5, abs=1e-6)  # 1 - sigmoid(0) for every record
    be.zero_grad()
    for _ in range(3):  # move the adapters away from the reference: up the KL rows' likelihood
        (-be._row_logps(kl_rows)[0].sum()).backward()
        with torch.no_grad():
            for p in be.model.parameters():
                if p.grad is not None:
                    p.sub_(0.05 * p.grad.sign())
        be.zero_grad()
    kl = be.kto_kl(kl_rows, 4)
    assert kl > 0 and be.kto_kl(kl_rows, 1) == pytest.approx(kl, abs=1e-6)
    assert be.kto_kl(src.kl_batch(batch.split(2)[0]), 4) != pytest.approx(kl, abs=1e-3)  # per micro: another z0
    whole = be.forward_backward_unpaired(batch, 1 / 4, kl)
    g1 = [p.grad.clone() for p in be.model.parameters() if p.grad is not None]
    be.zero_grad()
    split = PairSums()
    for micro in batch.split(1):
        split = split.add(be.forward_backward_unpaired(micro, 1 / 4, kl))
    g2 = [p.grad.clone() for p in be.model.parameters() if p.grad is not None]
    assert split.loss == pytest.approx(whole.loss, abs=1e-6)
    assert whole.metrics() == pytest.approx(split.metrics(), abs=1e-5) and whole.metrics()["kl"] == kl
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))


BAD_FILES = [  # id, objective, the bad line 3, what the error says
    ("missing-rejected", "dpo", {"prompt": "q", "chosen": "a"}, "a preference record without 'rejected'"),
    ("empty-completion", "orpo", {"prompt": "q", "chosen": "a", "rejected": ""}, "'rejected' is empty"),
    ("chosen-equals-rejected", "simpo", {"prompt": "q", "chosen": "a b", "rejected": "a b"},
     "'chosen' equals 'rejected'"),
    ("kto-empty-completion", "kto", {"prompt": "q", "completion": "", "label": True}, "'completion' is empty"),
]


@pytest.mark.parametrize("case", [c[0] for c in BAD_FILES])
def test_bad_preference_file_is_refused_by_line_before_weights_load(case, tmp_path, monkeypatch):
    """Through the CLI's code path (finetune.cli.run): the bad record named as file:line, and
    transformers' from_pretrained never called (a spy that fails the test if it is); nothing
    written that could pass for a result."""
    import transformers

    from finetune.cli import run
    from finetune.config import compose

    _, objective, bad, words = next(c for c in BAD_FILES if c[0] == case)
    good = _kto(2) if objective == "kto" else _pairs(2)
    f = tmp_path / "prefs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [*good, bad, *good]))

    def loaded(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    run_dir = tmp_path / "run"
    with pytest.raises(UserError) as e:
        run(compose(run_dir, "backend=cuda", "backend.device=cpu", f"objective={objective}", f"data.path={f}",
                    "train.steps=1", "train.progress=false", "data.cache=false"))
    assert str(e.value).startswith(f"{f}:3: ") and words in str(e.value) and "\n" not in str(e.value)
    assert not (run_dir / "summary.json").exists() and not (run_dir / "adapter").exists()
    if case == "missing-rejected":  # the spy is on the load path: a good file gets there
        f.write_text("".join(json.dumps(r) + "\n" for r in _pairs(8)))
        with pytest.raises(AssertionError, match="weights were loaded"):
            run(compose(tmp_path / "run2", "backend=cuda", "backend.device=cpu", "objective=dpo", f"data.path={f}",
                        "train.steps=1", "train.progress=false", "data.cache=false", "train.batch_size=2"))


def _gsm8k_pairs(path, n: int, max_chars: int = 300) -> list[dict]:
    """The ``n`` shortest GSM8K records as pairs: chosen the answer, rejected the same answer
    with a wrong final number (the right one plus an offset of 1..9 either way, drawn per record);
    the two differ in the final number's digits only (benchmarks/dpo_learnability.py builds the
    same set, larger)."""
    import random
    import re

    rng = random.Random(0)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if len(r["question"]) + len(r["answer"]) <= max_chars),
                  key=lambda r: len(r["question"]) + len(r["answer"]))
    out = []
    for r in rows:
        m = re.search(r"####\s*(-?[\d,]+)\s*$", r["answer"])
        if m:
            wrong = int(m.group(1).replace(",", "")) + rng.choice([-1, 1]) * rng.randint(1, 9)
            out.append({"prompt": r["question"] + "\n", "chosen": r["answer"],
                        "rejected": r["answer"][:m.start(1)] + str(wrong)})
        if len(out) == n:
            return out
    return out


def test_dpo_reward_accuracy_rises_on_gsm8k_pairs(gsm8k, tmp_path):
    """A full run (the CLI's code path) of DPO on 16 GSM8K pairs, 4 a step, LoRA r16 at lr
    3e-3: step 1's loss is ln 2 (the policy is the reference) and its reward accuracy 0 (equal
    rewards), and the train batches' reward accuracy (TRL's rewards/accuracies, each step's
    pairs before its update) is above 0.9 over steps 11-20. The tiny model memorises which final
    number each context takes: 16 pairs come round every 4 steps. Generalising to held-out pairs
    is measured in benchmarks/dpo_learnability.py (80 pairs, 100 steps)."""
    from finetune.cli import run
    from finetune.config import compose

    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_pairs(gsm8k, 16)))
    run_dir = tmp_path / "run"
    run(compose(run_dir, "backend=cuda", "backend.device=cpu", "precision=32-true", "objective=dpo", f"data.path={f}",
                "data.val_fraction=0", "train.steps=20", "train.batch_size=4", "train.seq_len=320",
                "train.eval_every=0", "train.progress=false", "train.warmup_steps=0", "train.schedule=constant",
                "memory.sample_every=0", "method.lora.rank=16", "optim.lr=3e-3"))
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and "rewards/accuracies" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and steps[0]["rewards/accuracies"] == 0.0
    late = [r["rewards/accuracies"] for r in steps[10:]]
    assert sum(late) / len(late) > 0.9, [r["rewards/accuracies"] for r in steps]


def test_kto_chat_records_train_the_completion_only(tiny):
    """KTO's records as chat turns go through the chat template as pairs do: the assistant's
    turn is the target, the label rides in the (never-target) first mask entry."""
    from finetune.data.tokens import tokenize

    _, tok = tiny
    recs = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}],
             "completion": [{"role": "assistant", "content": "4"}], "label": True},
            {"prompt": "What is 3 + 3?", "completion": "7", "label": False}]
    t = tokenize(recs, tok, 128, True, unpaired=True)
    for i, want in enumerate(["4<|im_end|>\n<|endoftext|>", "7<|endoftext|>"]):  # turns; strings as they are
        ids, m = np.asarray(t.ids[i]), np.asarray(t.masks[i])
        assert m[0] == int(recs[i]["label"]) and tok.decode(ids[1:][m[1:] == 1]) == want
    assert tok.decode(np.asarray(t.ids[0])).startswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_kto_refuses_method_full_before_weights_load(tmp_path):
    from finetune.cli import run
    from finetune.config import compose

    f = tmp_path / "kto.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _kto(8)))
    with pytest.raises(UserError, match="objective=kto takes its reference from the base with the adapters off"):
        run(compose(tmp_path / "run", "backend=cuda", "backend.device=cpu", "objective=kto", "method=full",
                    f"data.path={f}", "train.steps=1", "train.progress=false", "data.cache=false"))


def test_kto_weights_outside_eq8_warn(tiny, tmp_path, caplog):
    """TRL's KTOTrainer warning, ours: 1 desirable to 2 undesirable records at equal weights
    weigh 0.5 to 1, outside the paper's [1, 4/3]; desirable_weight 2.2 brings it inside."""
    from conftest import make_spec
    from finetune.data import _check_kto_weights
    from finetune.data.tokens import tokenize

    _, tok = tiny
    t = tokenize([r for r in _kto(6) if r["label"]] + [{**r, "label": False} for r in _kto(6)], tok, 128, True,
                 unpaired=True)  # 3 desirable, 6 undesirable
    with caplog.at_level("WARNING", logger="finetune"):
        _check_kto_weights(make_spec(tmp_path, "objective=kto"), t)
    assert "3 desirable and 6 undesirable records weigh 0.50 to 1" in caplog.text
    assert "objective.desirable_weight in [2.00, 2.67]" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="finetune"):
        _check_kto_weights(make_spec(tmp_path, "objective=kto", "objective.desirable_weight=2.2"), t)
    assert "objective=kto" not in caplog.text
