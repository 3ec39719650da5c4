"""``finetune mode=eval``: EleutherAI's lm-evaluation-harness on the base and on a run's adapter,
side by side; and the same on a train run's final adapter where ``eval.tasks`` is set.

    finetune mode=eval backend=cuda eval.adapter=outputs/RUN eval.tasks=[gsm8k_local,gsm8k_local_ppl] \\
        eval.path=/data/gsm8k/test.jsonl eval.limit=100

Tasks: any name lm-eval knows (its data set from the hub, as lm-eval reads it), a task of your
own (``eval.include_path``: a folder of lm-eval task YAMLs, as ``lm_eval --include_path``), or the
local ones shipped here (``LOCAL_TASKS``) over a JSONL of your own (``eval.path``):

- ``gsm8k_local``: lm-eval's ``gsm8k`` task (its prompt, its 5 shots, its strict and flexible
  exact-match) over GSM8K's ``question``/``answer`` records;
- ``gsm8k_local_ppl``: how well the model predicts each record, question and worked answer, as
  lm-eval's ``wikitext`` scores text (``loglikelihood_rolling``: ``bits_per_byte``, word and byte
  perplexity), a metric that moves with the adapter's weights long before exact match does.
  lm-eval gives these aggregates no stderr (``N/A``, null here).

The local tasks' YAMLs are written into the run dir (``eval_tasks/``), so
``lm_eval --include_path RUN_DIR/eval_tasks --tasks gsm8k_local ...`` runs the same task.

The model: the cuda backend hands lm-eval its own HF model (``lm_eval.models.huggingface.HFLM``,
the adapter through its ``peft=``); the mlx backend an lm-eval model on mlx-lm (mlx-lm's own
``MLXLM``, the adapter loaded by ``mlx_lm.utils.load``) (backends/<name>/evaluate.py). An adapter
from the other backend is converted on the fly, as ``mode=generate`` does. The base is evaluated,
released, then the adapter: one model in memory at a time.

The result: ``eval.json`` (per task and metric: the base's and the adapter's value and stderr,
the difference, which way is better) and ``eval.md`` (the same as a table, also printed) in the
run dir, each written whole or not at all (finetune.io).

Imports stay light here: lm-eval (which imports torch) is imported where a run needs it.
"""

from __future__ import annotations

import difflib
import gc
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from finetune.backends import capabilities
from finetune.backends.runtimes import get_backend
from finetune.errors import UserError
from finetune.export.conversion import convert
from finetune.generate import locate_given
from finetune.io import atomic_write_json, atomic_write_text
from finetune.model.source import check_weights
from finetune.spec import EvalSpec, RunSpec

EVAL_FILE = "eval.json"
EVAL_TABLE = "eval.md"
TASKS_DIR = "eval_tasks"  # in the run dir: the local tasks' YAMLs (lm_eval --include_path)
PATH_MARK = "<eval.path>"  # where a local task's config takes eval.path

# lm-eval's gsm8k task (lm_eval/tasks/gsm8k/gsm8k.yaml, version 3.0) over a local JSONL: its
# shots drawn from the same file (lm-eval leaves the document itself out of its own shots)
_GSM8K_DATA = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": PATH_MARK}}, "test_split": "test"}
LOCAL_TASKS: dict[str, dict[str, Any]] = {
    "gsm8k_local": {
        "task": "gsm8k_local", **_GSM8K_DATA, "fewshot_split": "test", "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": False,
                         "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"]}],
        "generation_kwargs": {"until": ["Question:", "</s>", "<|im_end|>"], "do_sample": False, "temperature": 0.0},
        "repeats": 1, "num_fewshot": 5,
        "filter_list": [
            {"name": "strict-match", "filter": [{"function": "regex", "regex_pattern": "#### (\\-?[0-9\\.\\,]+)"},
                                                {"function": "take_first"}]},
            {"name": "flexible-extract", "filter": [{"function": "regex", "group_select": -1,
                                                     "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"},
                                                    {"function": "take_first"}]}],
        "metadata": {"version": 3.0},
    },
    "gsm8k_local_ppl": {
        "task": "gsm8k_local_ppl", **_GSM8K_DATA, "output_type": "loglikelihood_rolling",
        "doc_to_text": "", "doc_to_target": "Question: {{question}}\nAnswer: {{answer}}",
        "metric_list": [{"metric": m, "aggregation": a, "higher_is_better": False} for m, a in (
            ("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
            ("bits_per_byte", "bits_per_byte"))],
        "num_fewshot": 0, "metadata": {"version": 1.0},
    },
}


def check(spec: RunSpec) -> None:
    """The resolver's checks of ``eval.*`` (no lm-eval import): what the mode needs, and the
    files the keys name."""
    e = spec.eval
    if spec.mode == "eval" and not e.tasks:
        raise UserError("mode=eval needs tasks: add eval.tasks=[gsm8k_local] eval.path=FILE.jsonl (or any lm-eval "
                        "task name: lm-eval ls tasks)")
    local = [t for t in e.tasks if t in LOCAL_TASKS]
    if local and e.path is None:
        raise UserError(f"eval.tasks=[{local[0]}] reads a local JSONL: add eval.path=FILE.jsonl (GSM8K's "
                        "question/answer records)")
    if e.path is not None and not Path(e.path).expanduser().is_file():
        raise UserError(f"eval.path={e.path}: no such file; give a JSONL of question/answer records")
    if e.include_path is not None and not Path(e.include_path).expanduser().is_dir():
        raise UserError(f"eval.include_path={e.include_path}: no such folder; give the folder of your lm-eval task "
                        "YAMLs")


def write_local_tasks(e: EvalSpec, run_dir: Path) -> Path | None:
    """The YAMLs of the local tasks ``e.tasks`` names, eval.path filled in, in RUN_DIR/eval_tasks
    (each written whole); None where it names none."""
    import yaml

    names = [t for t in e.tasks if t in LOCAL_TASKS]
    if not names:
        return None
    data = str(Path(str(e.path)).expanduser().resolve())
    d = run_dir / TASKS_DIR
    d.mkdir(parents=True, exist_ok=True)
    for name in names:
        cfg = json.loads(json.dumps(LOCAL_TASKS[name]).replace(json.dumps(PATH_MARK)[1:-1], json.dumps(data)[1:-1]))
        atomic_write_text(d / f"{name}.yaml", f"# finetune's local task (finetune/evaluate.py), over {data}\n"
                          + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    return d


def task_manager(e: EvalSpec, tasks_dir: Path | None) -> Any:
    """lm-eval's TaskManager over the local tasks and eval.include_path, and over lm-eval's own
    tasks where a name is none of those (indexing all of lm-eval's takes seconds). A name it
    does not know: one line naming the nearest ones."""
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in (tasks_dir, e.include_path and Path(e.include_path).expanduser()) if p]
    tm = TaskManager(include_path=paths or None, include_defaults=False) if paths else None
    if tm is None or any(t not in tm.all_tasks for t in e.tasks):
        tm = TaskManager(include_path=paths or None)
    for t in e.tasks:
        if t not in tm.all_tasks:
            near = difflib.get_close_matches(t, tm.all_tasks, n=3)
            raise UserError(f"eval.tasks: lm-eval knows no task {t}" + (f" (did you mean: {', '.join(near)}?)"
                            if near else "") + "; lm-eval ls tasks names them, eval.include_path=DIR adds yours")
    return tm


def load_tasks(e: EvalSpec, tm: Any) -> None:
    """Load each task's documents once before any model loads: a data set the hub must serve
    and cannot (offline) is one line naming the fix, not a traceback after the weights loaded."""
    try:
        tm.load(list(e.tasks))
    except Exception as exc:  # noqa: BLE001 (whatever lm-eval or datasets raise: said in one line)
        text = f"{type(exc).__name__}: {exc}"
        hub = ("offline", "connect", "reach", "internet", "huggingface.co", "HF_HUB", "Couldn't find")
        if any(w.lower() in text.lower() for w in hub) or "ConnectionError" in type(exc).__name__:
            raise UserError(f"eval.tasks={','.join(e.tasks)}: a task's data set must come from the Hugging Face hub, "
                            "which is not reachable here; connect (or unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), "
                            "or evaluate on a local file: eval.tasks=[gsm8k_local] eval.path=FILE.jsonl") from None
        raise UserError(f"eval.tasks={','.join(e.tasks)}: lm-eval could not load the tasks "
                        f"({text.splitlines()[0][:300]})") from None


def run_harness(e: EvalSpec, lm: Any, tm: Any) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` on one model, with the settings lm_eval's CLI passes for the
    same flags (its seeds, its defaults)."""
    import lm_eval

    gen = {"max_gen_toks": e.max_gen_toks} if e.max_gen_toks is not None else None
    limit = e.limit if e.limit is None or e.limit < 1 else int(e.limit)
    out = lm_eval.simple_evaluate(model=lm, tasks=list(e.tasks), task_manager=tm, num_fewshot=e.num_fewshot,
                                  limit=limit, bootstrap_iters=e.bootstrap_iters, gen_kwargs=gen,
                                  apply_chat_template=e.chat_template, log_samples=False)
    if out is None:  # a rank other than 0 of a distributed evaluation
        return {}
    return out


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)) else None


def metrics(out: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """task -> metric label -> {value, stderr, higher_is_better} from lm-eval's results. A
    label is the metric, ``/FILTER`` added unless lm-eval's filter is ``none``
    (``exact_match/strict-match``); a stderr lm-eval could not give (``N/A``) is null."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for task, res in (out.get("results") or {}).items():
        better = (out.get("higher_is_better") or {}).get(task) or {}
        for k, v in res.items():
            if "," not in k or "_stderr," in k:
                continue
            metric, _, flt = k.partition(",")
            label = metric if flt == "none" else f"{metric}/{flt}"
            table.setdefault(task, {})[label] = {
                "value": _number(v), "stderr": _number(res.get(f"{metric}_stderr,{flt}")),
                "higher_is_better": better.get(metric)}
    return table


def compare(base: dict[str, Any], adapted: dict[str, Any] | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Per task and metric: the base's and the adapter's value and stderr, and adapter - base."""
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for task, ms in base.items():
        for label, b in ms.items():
            a = (adapted or {}).get(task, {}).get(label)
            diff = a["value"] - b["value"] if a and a["value"] is not None and b["value"] is not None else None
            rows.setdefault(task, {})[label] = {
                "base": b["value"], "base_stderr": b["stderr"],
                "adapter": a["value"] if a else None, "adapter_stderr": a["stderr"] if a else None,
                "diff": diff, "higher_is_better": b["higher_is_better"]}
    return rows


def _cell(v: float | None, se: float | None = None) -> str:
    if v is None:
        return "-"
    return f"{v:.6g}" + (f" ± {se:.4g}" if se is not None else "")


def table(rows: dict[str, dict[str, dict[str, Any]]], adapter: bool) -> str:
    """The Markdown table of ``compare``'s rows: base, adapter (± stderr) and the difference."""
    head = ["task", "metric", "base"] + (["adapter", "adapter - base"] if adapter else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for task, ms in rows.items():
        for label, r in ms.items():
            arrow = {True: " ↑", False: " ↓"}.get(r["higher_is_better"], "")
            cells = [task, label + arrow, _cell(r["base"], r["base_stderr"])]
            if adapter:
                d = r["diff"]
                cells += [_cell(r["adapter"], r["adapter_stderr"]), "-" if d is None else f"{d:+.6g}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def flat(result: dict[str, Any], side: str = "adapter") -> dict[str, float | None]:
    """``TASK/METRIC`` -> the adapter's value (else the base's, where no adapter ran): what a
    sweep ranks by (``search_objective=eval:TASK/METRIC``) and its report shows."""
    out: dict[str, float | None] = {}
    for task, ms in (result.get("results") or {}).items():
        for label, r in ms.items():
            out[f"{task}/{label}"] = r[side] if result.get("adapter") else r["base"]
    return out


def evaluate_dirs(spec: RunSpec, model_dir: Path, adapter: Path | None, fmt: str | None, run_dir: Path,
                  full: Path | None = None) -> dict[str, Any]:
    """lm-eval on the base in ``model_dir`` and on it plus ``adapter`` (format ``fmt``; or the
    whole model ``full``, a method=full run's), writing eval.json and eval.md into ``run_dir``
    and printing the table. Returns what eval.json holds."""

    import lm_eval

    e, backend = spec.eval, spec.backend.resolved
    runtime = get_backend(backend)  # the framework is installed, else a UserError with the install line
    check_weights(model_dir, spec.model)
    tasks_dir = write_local_tasks(e, run_dir)
    tm = task_manager(e, tasks_dir)
    load_tasks(e, tm)
    trust, pickle = spec.model.trust_remote_code, spec.model.allow_pickle
    native_format = capabilities(backend).adapter_format
    outs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="finetune-eval-") as tmp:
        native = adapter
        if adapter is not None and fmt != native_format:
            native = convert(adapter, Path(tmp) / "adapter", native_format, base=str(model_dir), allow_pickle=pickle)
        sides: list[tuple[str, Path, Path | None]] = [("base", model_dir, None)]
        if native is not None or full is not None:
            sides.append(("adapter", full or model_dir, native))
        for side, mdir, adir in sides:
            print(f"eval: {side} ({mdir}{' + ' + str(adir) if adir else ''}) on {', '.join(e.tasks)}",
                  file=sys.stderr, flush=True)
            lm = runtime.eval_model(mdir, adir, e.batch_size, trust_remote_code=trust, allow_pickle=pickle)
            outs[side] = run_harness(e, lm, tm)
            del lm
            gc.collect()
            runtime.release_cache()
    rows = compare(metrics(outs["base"]), metrics(outs["adapter"]) if "adapter" in outs else None)
    shown = str(full or adapter) if (full or adapter) else None
    result = {
        "backend": backend, "model_dir": str(model_dir), "adapter": shown,
        "adapter_format": fmt, "tasks": list(e.tasks), "path": e.path, "limit": e.limit,
        "num_fewshot": e.num_fewshot, "max_gen_toks": e.max_gen_toks, "batch_size": e.batch_size,
        "chat_template": e.chat_template, "bootstrap_iters": e.bootstrap_iters,
        "tasks_dir": str(tasks_dir) if tasks_dir else None, "lm_eval_version": lm_eval.__version__,
        "n_samples": outs["base"].get("n-samples", {}), "versions": outs["base"].get("versions", {}),
        "results": rows,
    }
    text = table(rows, adapter="adapter" in outs)
    atomic_write_json(run_dir / EVAL_FILE, result)
    atomic_write_text(run_dir / EVAL_TABLE, text)
    print(text, end="", flush=True)
    print(f"eval: {run_dir / EVAL_FILE}", file=sys.stderr, flush=True)
    return result


def evaluate(spec: RunSpec) -> dict[str, Any]:
    """``mode=eval``: the base and ``eval.adapter`` (a run dir or adapter dir, either backend's
    format, or a method=full run's model) on ``eval.tasks``, into this command's run dir. Returns
    eval.json's content and ``eval`` (``flat``: what search_objective=eval:TASK/METRIC reads)."""
    model_dir, adapter, fmt, full = locate_given(spec, spec.eval.adapter)
    result = evaluate_dirs(spec, model_dir, adapter, fmt, Path(spec.paths.run_dir), full=full)
    return {**result, "eval": flat(result)}  # a sweep of mode=eval jobs ranks by it too (search_objective)


def check_tasks(spec: RunSpec) -> None:
    """Before a train run with ``eval.tasks`` trains: every task known and its documents
    loadable (the local tasks' YAMLs in a scratch folder), so that a typo or an unreachable hub
    is refused in one line before the training, not after it."""
    with tempfile.TemporaryDirectory(prefix="finetune-eval-") as tmp:
        e = spec.eval
        load_tasks(e, task_manager(e, write_local_tasks(e, Path(tmp))))


def after_training(spec: RunSpec, run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """A train run with ``eval.tasks``: its final adapter (RUN_DIR/adapter, or a method=full
    run's model) against its base, into the same run dir; summary.json gains ``eval``
    (TASK/METRIC -> the adapter's value: what the sweep's report and search read)."""
    try:
        model_dir, adapter, fmt, full = locate_given(spec, str(run_dir))
        result = evaluate_dirs(spec, model_dir, adapter, fmt, run_dir, full=full)
    except UserError as err:
        raise UserError(f"{err} (the training is complete: its adapter and summary.json are in {run_dir}; evaluate it "
                        f"with finetune mode=eval eval.adapter={run_dir})") from None
    summary = {**summary, "eval": flat(result)}
    atomic_write_json(run_dir / "summary.json", summary)
    return summary
