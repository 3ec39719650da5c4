"""Every bad input is one clean answer: a one-line error naming the fix, exit 2, no traceback,
and nothing left that could be taken for a result (no summary.json, adapter/, checkpoint, or
half-written temporary). Most cases run in-process through finetune.cli.run (the CLI's own
code path after Hydra); a handful go through the console script to prove exit 2 and no
traceback; a second test sweeps every numeric key of the schema with an out-of-range value."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from finetune.cli import run
from finetune.config import RANGES, compose
from finetune.resolver import validate
from finetune.errors import UserError

from conftest import finetune_cmd, needs_mlx, needs_torch
import warm_cli

FAST = ("backend=cuda", "train.steps=2", "train.eval_every=0", "train.progress=false", "data.num_samples=40",
        "memory.sample_every=0", "train.warmup_steps=0")


def _no_result(run_dir: Path) -> None:
    if not run_dir.exists():
        return
    names = {p.name for p in run_dir.rglob("*")}
    assert "summary.json" not in names and "adapter" not in names, sorted(names)
    assert not [n for n in names if n.endswith(".tmp")], sorted(names)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Files and directories the cases point at: bad data, bad model dirs, a run with
    checkpoints to resume with the wrong settings."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "a_dir").mkdir()
    (d / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (d / "list_row.jsonl").write_text('{"text": "ok"}\n[1, 2]\n')
    (d / "int_prompt.jsonl").write_text('{"prompt": 12, "completion": "x"}\n')
    (d / "no_role.jsonl").write_text(json.dumps({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]})
                                     + "\n")
    (d / "long_prompt.jsonl").write_text("".join(json.dumps({"prompt": "word " * 200, "completion": "end"}) + "\n"
                                                 for _ in range(8)))
    (d / "bad.json").write_text('{"text": "ok"}\n{"text": \n')
    from finetune.model.source import resolve_model_dir

    tiny = resolve_model_dir(compose(d / "x").model)
    no_weights = d / "no_weights"
    shutil.copytree(tiny, no_weights)
    (no_weights / "model.safetensors").unlink()
    pickle_only = d / "pickle_only"
    shutil.copytree(no_weights, pickle_only)
    (pickle_only / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    alien = d / "alien_arch"
    shutil.copytree(tiny, alien)
    cfg = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_arch_xyz",
                                                   "architectures": ["NoSuchForCausalLM"]}))
    return d


@pytest.fixture(scope="module")
def ckpt_run(tmp_path_factory):
    """A finished cuda LoRA run with checkpoints, to resume under the wrong settings."""
    d = tmp_path_factory.mktemp("ckpt") / "run"
    run(compose(d, *FAST, "train.save_every=1", "train.steps=2"))
    return d


CASES = [  # id, overrides ({i}: the inputs dir, {c}: the checkpointed run), text the error must hold
    ("unknown-key", ["+train.stepz=3"], "train.stepz is not a config key; did you mean: train.steps"),
    ("unknown-nested-key", ["+method.lora.rnk=4"], "method.lora.rnk is not a config key; did you mean: method.lora.rank"),
    ("unknown-logger-key", ["logger=csv", "+logger.csv.pth=x"], "logger.csv.pth is not a config key"),
    ("unknown-override", ["train.stepz=3"], "train.stepz is not a config key; did you mean: train.steps"),
    ("string-for-int", ["train.steps=abc"], "give train.steps a whole number"),
    ("string-for-float", ["optim.lr=fast"], "give optim.lr a number"),
    ("float-for-int", ["train.batch_size=1.5"], "give train.batch_size a whole number"),
    ("bad-choice", ["train.on_save_error=retry"], "train.on_save_error=retry is not valid; choose one of: stop, continue"),
    ("run-dir-not-creatable", ["RUN_DIR={i}/latin1.jsonl/run"], "cannot be created or written (Not a directory); set hydra.run.dir="),
    ("data-missing", ["data=jsonl", "data.path={i}/nope.jsonl"], "does not exist; point it at a .jsonl file"),
    ("data-is-directory", ["data=jsonl", "data.path={i}/a_dir"], "is a directory; point it at a .jsonl file"),
    ("data-unreadable", ["data=jsonl", "data.path=/proc/self/mem"], "cannot be read"),
    ("data-not-utf8", ["data=jsonl", "data.path={i}/latin1.jsonl"], "latin1.jsonl:2 is not UTF-8 text"),
    ("data-bad-json", ["data=jsonl", "data.path={i}/bad.json"], "bad.json:2 is not valid JSON"),
    ("data-row-not-object", ["data=jsonl", "data.path={i}/list_row.jsonl"], "list_row.jsonl:2 is a JSON list, not an object"),
    ("data-wrong-type", ["data=jsonl", "data.path={i}/int_prompt.jsonl"], "'prompt' is a int, not a string"),
    ("chat-turn-no-role", ["data=jsonl", "data.path={i}/no_role.jsonl"], "chat turn 0 has no 'role'"),
    ("prompt-fills-seq-len", ["data=jsonl", "data.path={i}/long_prompt.jsonl", "train.seq_len=32"],
     "no completion tokens left in any of the 8 samples after truncating to train.seq_len=32"),
    ("model-dir-missing", ["model=qwen2-0.5b", "model.path={i}/no_such_model"], "does not exist"),
    ("model-no-weights", ["model=qwen2-0.5b", "model.path={i}/no_weights"], "holds no weights (*.safetensors)"),
    ("model-pickle-only", ["model=qwen2-0.5b", "model.path={i}/pickle_only"],
     "has only pickle weights (pytorch_model.bin), which run code when loaded; convert them to safetensors, "
     "or set model.allow_pickle=true"),
    ("model-unknown-arch", ["model=qwen2-0.5b", "model.path={i}/alien_arch"],
     "architecture model_type='no_such_arch_xyz' is not one transformers can load"),
    ("resume-nothing", ["train.resume=true"], "holds no checkpoint"),
    ("resume-other-method", ["RUN_DIR={c}", "train.resume=true", "train.steps=3", "method=dora"],
     "is from another run (method=lora, this run has dora)"),
    ("resume-other-rank", ["RUN_DIR={c}", "train.resume=true", "train.steps=3", "method.lora.rank=4"],
     "is from another run (lora_rank=8, this run has 4)"),
    ("resume-other-batch", ["RUN_DIR={c}", "train.resume=true", "train.steps=3", "train.batch_size=2"],
     "keep train.batch_size * train.grad_accum equal"),
]


@needs_torch
def test_every_bad_input_is_one_line_naming_the_fix(tmp_path, inputs, ckpt_run):
    """One case per bad input, through the real code paths in-process; the whole table in one
    test so the tiny model and the checkpointed run are built once."""
    failures = []
    for case_id, overrides, needle in CASES:
        args = [o.format(i=inputs, c=ckpt_run) for o in overrides]
        run_dir = next((Path(a.split("=", 1)[1]) for a in args if a.startswith("RUN_DIR=")), tmp_path / case_id)
        args = [a for a in args if not a.startswith("RUN_DIR=")]
        before = sorted(p.name for p in (run_dir / "checkpoints").glob("*")) if run_dir.exists() else None
        # data=jsonl reads no data.num_samples (a key the chosen data group ignores is refused)
        fast = [f for f in FAST if not (f.startswith("data.num_samples=") and "data=jsonl" in args)]
        try:
            run(compose(run_dir, *fast, *args))
            failures.append(f"{case_id}: no error")
            continue
        except UserError as e:
            msg = str(e)
        if needle not in msg or "\n" in msg:
            failures.append(f"{case_id}: {msg!r} lacks {needle!r}")
        if before is None:
            _no_result(run_dir)
        else:  # an existing run is left exactly as it was
            assert sorted(p.name for p in (run_dir / "checkpoints").glob("*")) == before, case_id
    assert not failures, "\n".join(failures)


@needs_torch
@needs_mlx
def test_resume_from_another_backend_is_refused(tmp_path, ckpt_run):
    with pytest.raises(UserError, match=r"is from another run \(backend=cuda, this run has mlx\)"):
        run(compose(ckpt_run, *[a for a in FAST if a != "backend=cuda"], "backend=mlx", "train.resume=true",
                    "train.steps=3"))


def _out_of_range(lo: float, hi: float, lo_in: bool, hi_in: bool, is_int: bool) -> float | int:
    if hi != float("inf"):
        return int(hi) + 1 if is_int else hi + (1.0 if hi_in else 0.0)
    v = lo - 1 if lo_in else lo
    return int(v) if is_int else float(v)


def test_every_numeric_key_out_of_range_is_refused(tmp_path):
    """RANGES lists every numeric key of the schema (checked below against the dataclasses);
    each gets a value just outside its range and must fail validate() naming the key."""
    import dataclasses
    import typing

    from finetune.config import Config, RANGE_HINTS

    numeric = set()

    def walk(t, prefix):
        for f in dataclasses.fields(t):
            ft = typing.get_type_hints(t)[f.name]
            if dataclasses.is_dataclass(ft):
                walk(ft, f"{prefix}{f.name}.")
            elif ft in (int, float, int | None, float | None):
                numeric.add(prefix + f.name)
            elif ft == list[float]:
                numeric.update({f"{prefix}{f.name}.0", f"{prefix}{f.name}.1"})

    walk(Config, "")
    covered = set(RANGES) | {"method.lora.num_layers"}
    assert numeric <= covered, f"numeric keys without a range: {sorted(numeric - covered)}"
    base = compose(tmp_path, "backend=cuda")
    cases = {k: _out_of_range(*v[:4], isinstance(_get(base, k), int) and not isinstance(_get(base, k), bool)) for k, v in RANGES.items()}
    cases["method.lora.num_layers"] = 0
    cases["memory.budget"] = "150%"
    failures = []
    for key, bad in cases.items():
        lo, hi = RANGES.get(key, (None, None))[:2]
        if key.startswith("optim.betas."):
            betas = [0.9, 0.999]
            betas[int(key[-1])] = bad
            override = f"optim.betas=[{betas[0]},{betas[1]}]"
        else:
            field_type = type(_get(base, key)) if _get(base, key) is not None else int
            if field_type is int and isinstance(bad, float) and bad == int(bad):
                bad = int(bad)
            override = f"{key}={bad}"
        try:
            validate(compose(tmp_path, "backend=cuda", override))
            failures.append(f"{override}: accepted")
        except UserError as e:
            shown = "optim.betas" if key.startswith("optim.betas.") else key
            if shown not in str(e) or "\n" in str(e):
                failures.append(f"{override}: {e}")
    assert not failures, "\n".join(failures)
    assert RANGE_HINTS  # the hints name why a bound is there


def _get(cfg, dotted):
    node = cfg
    for part in dotted.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


@pytest.mark.parametrize("args, needle", [
    (["+train.stepz=3"], "error: train.stepz is not a config key; did you mean: train.steps"),
    (["train.steps=abc"], "error: train.steps: Value 'abc'"),
    (["optim.lr=-1"], "error: optim.lr=-1.0 must be > 0"),
])
def test_cli_bad_input_exit_2_no_traceback(tmp_path, args, needle):
    r = warm_cli.run([*finetune_cmd(), *args, f"hydra.run.dir={tmp_path}/r"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [next(ln for ln in r.stderr.splitlines()
                                                                    if ln.startswith("error:"))], r.stderr
    assert not (tmp_path / "r").exists()  # nothing left behind that looks like a run


def test_cli_debug_shows_the_traceback(tmp_path):
    r = warm_cli.run([*finetune_cmd(), "--debug", "+train.stepz=3", f"hydra.run.dir={tmp_path}/r"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" in r.stderr, r.stderr
