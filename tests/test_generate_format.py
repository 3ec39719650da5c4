"""``mode=generate`` follows training (issue 31): a prompt takes the shape the adapter's run gave
its prompts (raw text for prompt/completion data, the chat template for chat ``messages``),
recorded in summary.json and beside the adapter (adapter/finetune.json, kept by an export);
``generate.chat_template`` overrides it; both backends stop at the same end tokens and print
none; and generate leaves no run directory. Every generation goes through the real CLI.

The runs: the tiny model, 300 steps at lr 1e-2 (LoRA on q/v) on four short prompt/completion
pairs, trained on mlx (the issue's case), and the same pairs as chat messages trained on cuda.
Greedy, each adapter then answers a training prompt with its trained completion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAS_MLX, HAS_TORCH, make_cfg
import warm_cli

pytestmark = pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both torch+peft and mlx-lm")

REPO = Path(__file__).resolve().parents[1]
# one line each (Hydra's override grammar takes no newline in prompt=...)
PAIRS = [("Ava has 12 coins. Ben gives her 5. Answer:", " 12 + 5 = 17. #### 17"),
         ("Jo has 30 books. Jo gives 8 away. Answer:", " 30 - 8 = 22. #### 22"),
         ("Eli has 9 shells. They double. Answer:", " 9 * 2 = 18. #### 18"),
         ("Hana has 41 stamps. Kofi brings 6. Answer:", " 41 + 6 = 47. #### 47")]
PROMPT, COMPLETION = PAIRS[1]
STEPS = 300


def _train(run: Path, backend: str, data: Path) -> Path:
    import torch
    from finetune.run.loop import train
    from finetune.resolver import resolve

    # one intra-op thread, as the other tests' subprocesses (OMP_NUM_THREADS=1): on two cores that
    # other jobs load, torch's 2-thread pool took 34-44 s for these 300 tiny steps, one thread 1.7 s
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(resolve(make_cfg(run, f"backend={backend}", f"data.path={data}", f"train.steps={STEPS}", "optim.lr=1e-2",
                               "train.schedule=constant", "train.warmup_steps=0", "train.eval_every=0",
                               "train.batch_size=4", "data.val_fraction=0", "train.progress=false")))
    finally:
        torch.set_num_threads(threads)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The two trained runs, shared by this file's tests: "pc" (mlx, prompt/completion) and
    "chat" (cuda, chat messages)."""
    import time

    root = tmp_path_factory.mktemp("generate-format")
    pc, chat = root / "pc.jsonl", root / "chat.jsonl"
    pc.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for _ in range(4) for p, c in PAIRS))
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                     {"role": "assistant", "content": c.strip()}]}) + "\n"
                            for _ in range(4) for p, c in PAIRS))
    t0 = time.perf_counter()
    out = {"pc": _train(root / "mlx-pc", "mlx", pc), "chat": _train(root / "cuda-chat", "cuda", chat)}
    print(f"\n[generate-format] two {STEPS}-step runs trained in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


TMPDIR: Path  # the file's one TMPDIR, set by _tmpdir


@pytest.fixture(scope="module", autouse=True)
def _tmpdir(tmp_path_factory) -> None:
    """One TMPDIR for this file's generate commands: one environment, so that from the second
    command on they fork from a warm process started with it (tests/warm_cli.py)."""
    global TMPDIR
    TMPDIR = tmp_path_factory.mktemp("tmpdir")


def _generate(tmp_path: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m finetune.cli mode=generate ...`` from an empty working directory, with no
    hydra.run.dir: it leaves neither outputs/ nor a temporary dir behind (in the file's TMPDIR,
    checked after every command)."""
    cwd, tmp = tmp_path / "cwd", TMPDIR
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    r = warm_cli.run([sys.executable, "-m", "finetune.cli", "mode=generate", *overrides], cwd=cwd, env=env,
                       check=False, capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    assert list(cwd.iterdir()) == [], list(cwd.iterdir())  # no outputs/DATE/TIME run dir
    assert not [p for p in tmp.iterdir() if p.name.startswith("finetune-generate-")], list(tmp.iterdir())
    return r


def _prompt_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("prompt: ")]


def test_runs_record_their_prompt_format(runs):
    for name, fmt, data in (("pc", "raw", "prompt/completion"), ("chat", "chat", "chat messages")):
        assert json.loads((runs[name] / "summary.json").read_text())["prompt_format"] == fmt
        assert json.loads((runs[name] / "adapter" / "finetune.json").read_text()) == {
            "prompt_format": fmt, "data_formats": {data: len(PAIRS) * 4}}


def test_prompt_completion_adapter_continues_the_raw_prompt_on_both_backends(runs, tmp_path):
    """The issue's case: trained 300 steps on prompt/completion data, the adapter continues a
    training prompt with its completion, given as raw text (the chat template made it look
    broken). On mlx from the run dir; on cuda from a PEFT copy exported elsewhere, which keeps
    the record. Both print the same text."""
    from finetune.export import convert

    peft = convert(runs["pc"], tmp_path / "elsewhere" / "peft-adapter", "peft")
    assert json.loads((peft / "finetune.json").read_text())["prompt_format"] == "raw"
    printed = {}
    for backend, adapter in (("mlx", runs["pc"]), ("cuda", peft)):
        r = _generate(tmp_path / backend, f"backend={backend}", f"generate.adapter={adapter}", f"prompt={PROMPT}",
                      "generate.max_new_tokens=16", "generate.temperature=0")
        assert _prompt_lines(r) == [("prompt: raw text (as the adapter's run formatted its prompts; "
                                    "generate.chat_template=true to change it)")], r.stderr[-2000:]
        printed[backend] = r.stdout
    print(f"\n[generate-format] mlx printed {printed['mlx']!r}, cuda printed {printed['cuda']!r}", file=sys.stderr)
    assert printed["mlx"] == printed["cuda"]
    assert printed["mlx"].startswith(COMPLETION[:8]), printed  # " 30 - 8 =": the trained completion's first tokens


def test_chat_adapter_gets_the_chat_template_and_mlx_prints_no_end_of_turn(runs, tmp_path):
    """A chat-trained adapter answers through the chat template; it learned to close its turn
    with <|im_end|>, at which both backends stop, printing the same text and no special token."""
    printed = {}
    for backend in ("mlx", "cuda"):
        r = _generate(tmp_path / backend, f"backend={backend}", f"generate.adapter={runs['chat']}", f"prompt={PROMPT}",
                      "generate.max_new_tokens=16")
        assert _prompt_lines(r) == [("prompt: the chat template (as the adapter's run formatted its prompts; "
                                    "generate.chat_template=false to change it)")], r.stderr[-2000:]
        printed[backend] = r.stdout
    assert printed["mlx"] == printed["cuda"] and printed["mlx"].startswith(COMPLETION.strip()[:7]), printed
    assert "<|" not in printed["mlx"], printed  # <|im_end|>, <|endoftext|>, <|im_start|>


def test_chat_template_key_overrides_the_record(runs, tmp_path):
    """generate.chat_template=true wraps the raw-trained adapter's prompt in the chat template
    (and it no longer answers as trained); false gives the chat-trained one raw text."""
    r = _generate(tmp_path / "on", "backend=mlx", f"generate.adapter={runs['pc']}", f"prompt={PROMPT}",
                  "generate.max_new_tokens=16", "generate.chat_template=true")
    assert _prompt_lines(r) == [("prompt: the chat template (generate.chat_template=true; the adapter's run "
                                "formatted its prompts as raw text)")], r.stderr[-2000:]
    assert not r.stdout.startswith(COMPLETION[:8]) and "<|" not in r.stdout, r.stdout
    r = _generate(tmp_path / "off", "backend=mlx", f"generate.adapter={runs['chat']}", f"prompt={PROMPT}",
                  "generate.max_new_tokens=16", "generate.chat_template=false")
    assert _prompt_lines(r) == [("prompt: raw text (generate.chat_template=false; the adapter's run formatted its "
                                "prompts as the chat template)")], r.stderr[-2000:]
    assert "<|" not in r.stdout


def test_no_record_keeps_the_chat_template_and_says_so(tmp_path):
    """The base alone (or an adapter from elsewhere): the tokenizer's chat template, as before,
    said in one line."""
    r = _generate(tmp_path, "backend=mlx", f"prompt={PROMPT}", "generate.max_new_tokens=4")
    assert _prompt_lines(r) == [("prompt: the chat template (no adapter, and the tokenizer has one; "
                                "generate.chat_template=false to change it)")], r.stderr[-2000:]


def test_a_bad_chat_template_value_is_one_line(tmp_path):
    r = _generate(tmp_path, "backend=cuda", f"prompt={PROMPT}", "generate.chat_template=maybe", check=False)
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [("error: generate.chat_template: Value 'maybe' is not a valid bool "
                                             "(type str); give generate.chat_template true, false or null")]


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    from finetune.model.source import resolve_model_dir
    from transformers import AutoTokenizer

    d = resolve_model_dir(make_cfg(tmp_path_factory.mktemp("unused")).model)
    return d, AutoTokenizer.from_pretrained(str(d))


def test_the_prompt_side_of_training_is_what_generate_wraps(tiny_tok):
    """Each data format's prompt, as training renders it (finetune/data/tokens.py ``_render``: the text before
    the first scored character), is what generation builds from the same prompt."""
    from finetune.data.tokens import _render
    from finetune.prompting import FORMAT_OF_RECORDS, prompt_format, wrap

    _, tok = tiny_tok
    for record, fmt in (({"question": "Jo has 3 coins.", "answer": "3"}, "question/answer"),
                        ({"prompt": "Jo has 3 coins.", "completion": " 3"}, "raw")):
        text, spans = _render(record, tok, True)
        assert text[:spans[0][0]] == wrap("Jo has 3 coins.", fmt)
    msgs = [{"role": "user", "content": "Jo has 3 coins."}, {"role": "assistant", "content": "3"}]
    text, spans = _render({"messages": msgs}, tok, True)
    assert text[:spans[0][0]] == tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert set(FORMAT_OF_RECORDS.values()) == {"chat", "raw", "question/answer"}
    assert prompt_format({"text": 3, "chat messages": 2, "prompt/completion": 1}) == "raw"  # the most records'
    assert prompt_format({}) is None


def test_end_tokens_are_eos_and_the_chat_templates_end_of_turn(tiny_tok):
    from finetune.prompting import end_of_turn_id, end_token_ids

    d, tok = tiny_tok
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tok) == eot
    assert end_token_ids(tok, d) == sorted({tok.eos_token_id, eot})
