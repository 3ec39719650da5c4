"""``finetune mode=eval`` and ``eval.tasks`` after training (issue 35): lm-evaluation-harness on
the base and the adapter, side by side, on both backends, over the shipped local GSM8K tasks.

One tiny adapter per backend, trained once for the module: on cuda the tiny Qwen2 with
``eval.tasks`` set (the evaluation after training, into its run dir), on mlx a tiny Llama
evaluated with ``mode=eval``. Exact match is 0 on both sides of a random tiny model, so the
difference is read off ``gsm8k_local_ppl``'s bits per byte, which moves with the adapter's
weights. lm-eval's own CLI, on the same local task, model and adapter, gives the same figures.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import GSM8K, HAS_MLX, HAS_TORCH, finetune_cmd, make_cfg
import warm_cli

from finetune.errors import UserError

pytestmark = [pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both torch+peft and mlx-lm"),
              pytest.mark.skipif(not GSM8K.is_file(), reason=f"needs GSM8K's train.jsonl at {GSM8K}")]

TASKS = "eval.tasks=[gsm8k_local,gsm8k_local_ppl]"
# 3 documents, no shots, 4 new tokens: the harness end to end in seconds
EVAL = (TASKS, f"eval.path={GSM8K}", "eval.limit=3", "eval.num_fewshot=0", "eval.max_gen_toks=4")
TRAIN = ("train.steps=3", "optim.lr=1e-2", "train.warmup_steps=0", "train.eval_every=0", "train.progress=false",
         "data.num_samples=32", "train.batch_size=2")
BPB = "bits_per_byte"


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory) -> Path:
    """A cuda LoRA run with eval.tasks: trained, then its final adapter evaluated in its run dir."""
    from finetune.cli import run

    d = tmp_path_factory.mktemp("eval") / "cuda-run"
    run(make_cfg(d, "backend=cuda", *TRAIN, *EVAL))
    return d


@pytest.fixture(scope="module")
def mlx_run(tmp_path_factory) -> Path:
    """An mlx LoRA run on a tiny Llama (no evaluation while training)."""
    from families import build_family

    from finetune.cli import run

    d = tmp_path_factory.mktemp("eval") / "mlx-run"
    run(make_cfg(d, "backend=mlx", f"model.path={build_family('llama')}", *TRAIN))
    return d


def _bpb(result: dict, side: str) -> float:
    return result["results"]["gsm8k_local_ppl"][BPB][side]


def _check_result(result: dict, adapter: Path) -> None:
    assert result["adapter"] == str(adapter) and result["tasks"] == ["gsm8k_local", "gsm8k_local_ppl"]
    assert result["n_samples"]["gsm8k_local"]["effective"] == 3
    em = result["results"]["gsm8k_local"]
    assert set(em) == {"exact_match/strict-match", "exact_match/flexible-extract"}
    for r in em.values():  # a mean: lm-eval's closed-form stderr
        assert r["base"] is not None and r["base_stderr"] is not None and r["higher_is_better"] is True
    base, adapted = _bpb(result, "base"), _bpb(result, "adapter")
    assert 0 < base and 0 < adapted and base != adapted  # the adapter's weights moved the model
    assert result["results"]["gsm8k_local_ppl"][BPB]["diff"] == adapted - base
    assert result["results"]["gsm8k_local_ppl"][BPB]["higher_is_better"] is False


def test_eval_after_training_writes_eval_json_and_the_summary(cuda_run):
    result = json.loads((cuda_run / "eval.json").read_text())
    _check_result(result, cuda_run / "adapter")
    assert result["backend"] == "cuda" and result["adapter_format"] == "peft"
    table = (cuda_run / "eval.md").read_text()
    assert f"| gsm8k_local_ppl | {BPB} ↓ |" in table and "adapter - base" in table
    summary = json.loads((cuda_run / "summary.json").read_text())
    assert summary["eval"][f"gsm8k_local_ppl/{BPB}"] == _bpb(result, "adapter")
    assert summary["final_train_loss"] is not None  # still the run's summary
    # the local tasks' YAMLs, for lm_eval --include_path, and files as the umask says
    assert sorted(p.name for p in (cuda_run / "eval_tasks").iterdir()) == ["gsm8k_local.yaml", "gsm8k_local_ppl.yaml"]
    from finetune.io import umask_mode

    assert (cuda_run / "eval.json").stat().st_mode & 0o777 == umask_mode()


def test_mode_eval_on_mlx_writes_eval_json_beside_the_table_it_prints(mlx_run, tmp_path, capsys):
    from finetune.cli import run

    capsys.readouterr()
    result = run(make_cfg(tmp_path / "e", "mode=eval", "backend=mlx", f"eval.adapter={mlx_run}", *EVAL))
    printed = capsys.readouterr().out
    _check_result(result, mlx_run / "adapter")
    assert result["backend"] == "mlx" and result["adapter_format"] == "mlx"
    written = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert written == json.loads(json.dumps({k: v for k, v in result.items() if k != "eval"}))
    assert result["eval"][f"gsm8k_local_ppl/{BPB}"] == _bpb(result, "adapter")
    assert printed == (tmp_path / "e" / "eval.md").read_text()


def test_lm_eval_cli_gives_our_figures(cuda_run, tmp_path):
    """`lm_eval --model hf --model_args pretrained=BASE,peft=ADAPTER --include_path RUN/eval_tasks`
    on the same documents: every metric of the adapter equals eval.json's, exactly."""
    ours = json.loads((cuda_run / "eval.json").read_text())
    args = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
            f"pretrained={ours['model_dir']},peft={cuda_run / 'adapter'}", "--include_path",
            str(cuda_run / "eval_tasks"), "--tasks", "gsm8k_local,gsm8k_local_ppl", "--limit", "3", "--num_fewshot",
            "0", "--gen_kwargs", "max_gen_toks=4", "--device", "cpu", "--output_path", str(tmp_path / "out")]
    r = warm_cli.run(args, check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    compared = 0
    for task, metrics in ours["results"].items():
        for label, row in metrics.items():
            metric, _, flt = label.partition("/")
            assert theirs[task][f"{metric},{flt or 'none'}"] == row["adapter"], (task, label)
            compared += 1
    assert compared == 5


def test_a_sweep_ranks_by_an_eval_metric_and_reports_it(cuda_run):
    from finetune import report, sweep

    summary = json.loads((cuda_run / "summary.json").read_text())
    want = summary["eval"][f"gsm8k_local_ppl/{BPB}"]
    objective = f"eval:gsm8k_local_ppl/{BPB}"
    sweep.check_objective(objective, {"eval": {"tasks": ["gsm8k_local_ppl"]}})
    assert sweep.objective_value(summary, objective) == want and sweep.direction(objective) == "minimize"
    assert sweep.direction("eval:gsm8k_local/exact_match/strict-match") == "maximize"
    assert sweep.objective_value(summary, "eval:gsm8k_local/exact_match/strict-match") == 0.0
    assert sweep.objective_value(None, objective) == float("inf")  # a failed job: the worst
    with pytest.raises(UserError, match=r"^search_objective=eval:mmlu/acc ranks by task mmlu, which the jobs do not "
                                        r"evaluate: add eval.tasks=\[mmlu\]$"):
        sweep.check_objective("eval:mmlu/acc", {"eval": {"tasks": ["gsm8k_local"]}})
    rows, _ = report.report(cuda_run, chart=False)
    assert rows[0][f"eval:gsm8k_local_ppl/{BPB}"] == want
    md = (cuda_run / "sweep_summary.md").read_text()
    assert f"gsm8k_local_ppl/{BPB}" in md.splitlines()[0]
    assert f"eval:gsm8k_local_ppl/{BPB}" in (cuda_run / "sweep_summary.csv").read_text().splitlines()[0]
    assert BPB in report.table(rows)


@pytest.mark.parametrize("overrides, line", [
    (("mode=eval",), "mode=eval needs tasks: add eval.tasks=[gsm8k_local] eval.path=FILE.jsonl (or any lm-eval task "
                     "name: lm-eval ls tasks)"),
    (("mode=eval", "eval.tasks=[gsm8k_local]"), "eval.tasks=[gsm8k_local] reads a local JSONL: add "
                                                "eval.path=FILE.jsonl (GSM8K's question/answer records)"),
    (("eval.tasks=[gsm8k_local_ppl]", "eval.path=/no/such.jsonl"),
     "eval.path=/no/such.jsonl: no such file; give a JSONL of question/answer records"),
])
def test_bad_eval_keys_are_one_line_before_anything_loads(overrides, line, tmp_path):
    from finetune.resolver import resolve

    with pytest.raises(UserError) as e:
        resolve(make_cfg(tmp_path, *overrides))
    assert str(e.value) == line


def test_an_adapter_dir_without_an_adapter_is_one_line(tmp_path):
    from finetune.cli import run

    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"holds no adapter_config.json .*give an adapter"):
        run(make_cfg(tmp_path / "e", "mode=eval", "backend=cuda", f"eval.adapter={tmp_path / 'empty'}", *EVAL))
    assert not (tmp_path / "e" / "eval.json").exists()


def test_unknown_task_and_an_unreachable_hub_are_one_line(tmp_path):
    """An unknown name: refused with the nearest names. A hub task offline (lm-eval's gsm8k):
    through the CLI, one line naming the fix, exit 2, no run dir left."""
    from finetune.evaluate import task_manager, write_local_tasks
    from finetune.spec import EvalSpec

    e = EvalSpec(tasks=("gsm8k_locl", "gsm8k_local"), path=str(GSM8K))
    with pytest.raises(UserError, match=r"^eval.tasks: lm-eval knows no task gsm8k_locl \(did you mean: gsm8k_local, "):
        task_manager(e, write_local_tasks(e, tmp_path / "tasks"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = warm_cli.run([*finetune_cmd(), "mode=eval", "backend=cuda", "eval.tasks=[gsm8k]", "eval.limit=2",
                        f"hydra.run.dir={tmp_path}/run"], check=False, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: eval.tasks=gsm8k: a task's data set must come from the Hugging Face hub, which is "
                           "not reachable here"), r.stderr[-3000:]
    assert "eval.tasks=[gsm8k_local] eval.path=FILE.jsonl" in last and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


RELEASE = """
import gc, sys, weakref
sys.path.insert(0, {tests!r})
from conftest import make_cfg
from finetune.resolver import resolve
from finetune.run.loop import Trainer
for backend in ("mlx", "cuda"):
    t = Trainer(resolve(make_cfg({root!r} + "/" + backend, "backend=" + backend, "train.steps=1", "train.eval_every=0",
                                 "train.progress=false", "data.num_samples=8", "train.batch_size=2")))
    t.connect()
    t.claim()
    with t.runlog:
        t.setup()
        t.train()
    held = weakref.ref(t.backend)
    t.release_model()
    gc.collect()
    print(backend, "held" if held() is not None else "released")
    t.lock.release(remove=False)
"""


def test_a_finished_run_lets_go_of_its_model_before_evaluating(tmp_path):
    """Trainer.release_model (what a train run with eval.tasks calls before loading the base
    again): nothing holds either backend, its model and optimizer state, afterwards. In a
    process of its own: pytest's captures keep frames of the setup alive, a run keeps none."""
    code = RELEASE.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    r = warm_cli.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-3:] == ["mlx released", "cuda released", ""], r.stdout[-2000:]


def test_an_optuna_search_ranks_its_trials_by_an_eval_metric(tmp_path):
    """`finetune -m search=val_loss search_objective=eval:gsm8k_local_ppl/bits_per_byte`: each
    trial trains, evaluates its adapter, and returns its bits per byte; Optuna's best value is
    the lowest of the trials' (their summary.json), and the report has the column."""
    import yaml

    sweep_dir = tmp_path / "sweep"
    r = warm_cli.run([*finetune_cmd(), "-m", "search=val_loss", f"search_objective=eval:gsm8k_local_ppl/{BPB}",
                        "hydra.sweeper.n_trials=2", "backend=mlx", "isolate_jobs=false", "train.steps=2",
                        "train.eval_every=0", "train.progress=false", "data.num_samples=16", "eval.tasks=[gsm8k_local_ppl]",
                        f"eval.path={GSM8K}", "eval.limit=2", f"hydra.sweep.dir={sweep_dir}"],
                       check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    scores = [json.loads(p.read_text())["eval"][f"gsm8k_local_ppl/{BPB}"] for p in sweep_dir.rglob("summary.json")]
    assert len(scores) == 2
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())["best_value"]
    assert best == min(scores)
    assert f"eval gsm8k_local_ppl/{BPB}" in (sweep_dir / "sweep_summary.md").read_text().splitlines()[0]
