"""A sweep over a preference objective ranks its jobs by validation reward accuracy or margin
(issue 33): ``finetune -m search=reward objective=dpo``, Optuna maximizing each trial's last
validation ``eval_rewards/accuracies`` (TRL's name, as TRL's ``metric_for_best_model`` takes it);
the sweep report shows the columns; an objective the jobs cannot score is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import finetune_cmd, needs_torch
import warm_cli

from finetune.errors import UserError
from finetune.sweep import check_objective, direction, objective_value


def _pairs(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i} + {i}?\nAnswer:\n", "chosen": f"{i} + {i} = {2 * i}\n#### {2 * i}",
             "rejected": f"{i} + {i} = {2 * i}\n#### -{2 * i + 1}"} for i in range(1, n + 1)]


@pytest.mark.parametrize("tree,words", [
    ({"objective": {"name": "sft"}, "train": {"eval_every": 5}}, "add objective=dpo"),
    ({"train": {"eval_every": 5}}, "add objective=dpo"),
    ({"objective": {"name": "dpo"}, "train": {"eval_every": 0}}, "set train.eval_every=N"),
])
def test_a_reward_objective_the_jobs_cannot_score_is_one_line(tree, words):
    with pytest.raises(UserError, match=words) as e:
        check_objective("eval_rewards/accuracies", tree)
    assert "\n" not in str(e.value)
    check_objective("eval_rewards/margins", {"objective": {"name": "orpo"}, "train": {"eval_every": 2}})
    assert direction("eval_rewards/accuracies") == direction("eval_rewards/margins") == "maximize"


@needs_torch
def test_an_optuna_search_over_beta_ranks_trials_by_validation_reward_accuracy(tmp_path: Path) -> None:
    """Two trials of DPO (tiny model, cuda on CPU) with Optuna's beta and lr: each returns its
    summary.json's last validation reward accuracy; the best value is the highest of them, and
    sweep_summary.md has the accuracy and margin columns with each job's figures."""
    import yaml

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in _pairs(24)))
    sweep_dir = tmp_path / "sweep"
    r = warm_cli.run([*finetune_cmd(), "-m", "search=reward", "objective=dpo", "hydra.sweeper.n_trials=2",
                        "backend=cuda", "isolate_jobs=false", f"data.path={data}", "data.val_fraction=0.25",
                        "train.steps=2", "train.eval_every=2", "train.batch_size=4", "train.seq_len=64",
                        "train.warmup_steps=0", "train.progress=false", "precision=32-true",
                        f"hydra.sweep.dir={sweep_dir}"],
                       check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sweep_dir.rglob("summary.json")]
    accs = [s["pair_metrics"]["eval"]["eval_rewards/accuracies"] for s in summaries]
    assert len(accs) == 2 and all(0.0 <= a <= 1.0 for a in accs), accs
    assert [objective_value(s, "eval_rewards/accuracies") for s in summaries] == accs
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())["best_value"]
    assert best == max(accs)
    md = (sweep_dir / "sweep_summary.md").read_text().splitlines()
    head = [c.strip() for c in md[0].strip("|").split("|")]
    assert "val reward acc" in head and "val reward margin" in head, md[0]
    shown = sorted(float(row.strip("|").split("|")[head.index("val reward acc")]) for row in md[2:4])
    assert shown == pytest.approx(sorted(accs), abs=1e-4)
