"""``finetune mode=generate``: a trained tiny adapter answers on both backends, its own and the
other one's (converted on the fly), its prompt as raw text as the run trained (the built-in
data is prompt/completion; tests/test_generate_format.py holds the prompt-format cases); the
printed text is the library's own generation."""

from __future__ import annotations

import os

import pytest
from conftest import HAS_MLX, HAS_TORCH, finetune_cmd, make_cfg
import warm_cli
from test_export import trained_run

pytestmark = pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both torch+peft and mlx-lm")
PROMPT = "Natalia sold clips to 48 of her friends. How many did she sell?"


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "export-runs"  # the runs test_export trains, if it ran


def _generate(capsys, run_dir, *overrides: str) -> tuple[dict, str]:
    from finetune.cli import run

    capsys.readouterr()
    out = run(make_cfg(run_dir, "mode=generate", f"generate.prompt={PROMPT}", "generate.max_new_tokens=8",
                       *overrides))
    return out, capsys.readouterr().out


@pytest.mark.parametrize("backend", ["mlx", "cuda"])
def test_generate_prints_a_completion_from_either_backends_adapter(backend, runs_root, capsys, tmp_path):
    """Greedy completions of the mlx-trained adapter: native on mlx, converted to PEFT on cuda
    (and the cuda-trained one the other way); the same adapter gives the same tokens on both
    libraries, since their logits agree to 1e-7."""
    texts = {}
    for name in ("mlx-lora", "cuda-lora"):
        run = trained_run(runs_root, name)
        out, printed = _generate(capsys, tmp_path / name, f"backend={backend}", f"generate.adapter={run}")
        assert printed == out["completion"] + "\n"
        assert out["backend"] == backend and out["adapter"] == str(run / "adapter")
        assert out["converted"] == (name.split("-")[0] != backend)
        texts[name] = out["completion"]
    for name, text in texts.items():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out["model_dir"])
        # at most 8 new tokens: a byte-level token that is part of a character decodes to U+FFFD,
        # so bound the text by the bytes 8 of the vocabulary's longest decodings can make
        longest = max(len(tok.decode([i]).encode()) for i in range(len(tok)))
        assert text and len(text.encode()) <= 8 * longest, (name, text)


def test_same_adapter_same_greedy_text_on_both_backends(runs_root, capsys, tmp_path):
    run = trained_run(runs_root, "mlx-lora")
    mlx, _ = _generate(capsys, tmp_path / "a", "backend=mlx", f"generate.adapter={run}")
    cuda, _ = _generate(capsys, tmp_path / "b", "backend=cuda", f"generate.adapter={run}")
    assert mlx["completion"] == cuda["completion"]


def test_sampling_follows_the_seed_and_the_base_alone_answers(capsys, tmp_path):
    a, _ = _generate(capsys, tmp_path / "a", "backend=cuda", "generate.temperature=1.0", "train.seed=1")
    b, _ = _generate(capsys, tmp_path / "b", "backend=cuda", "generate.temperature=1.0", "train.seed=1")
    assert a["completion"] and a["completion"] == b["completion"] and a["adapter"] is None


def test_generate_through_the_console_script(runs_root, capsys, tmp_path):
    """`finetune mode=generate backend=mlx generate.adapter=<a cuda run>` prints what the
    in-process call returns, and only that, on stdout."""
    run = trained_run(runs_root, "cuda-lora")
    # the short form the issue names: prompt="..." (generate.prompt is the same key)
    r = warm_cli.run([*finetune_cmd(), "mode=generate", "backend=mlx", f"generate.adapter={run}",
                        f"prompt={PROMPT}", "generate.max_new_tokens=8", f"hydra.run.dir={tmp_path}/g"],
                       check=False, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert r.returncode == 0, r.stderr[-2000:]
    want, _ = _generate(capsys, tmp_path / "in", "backend=mlx", f"generate.adapter={run}")
    assert r.stdout == want["completion"] + "\n"
    # on cuda too, and transformers draws no "Loading weights" bar over it (finetune.quiet)
    r = warm_cli.run([*finetune_cmd(), "mode=generate", "backend=cuda", f"generate.adapter={run}",
                        f"prompt={PROMPT}", "generate.max_new_tokens=8", f"hydra.run.dir={tmp_path}/c"],
                       check=False, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert r.returncode == 0, r.stderr[-2000:]
    want, _ = _generate(capsys, tmp_path / "in-cuda", "backend=cuda", f"generate.adapter={run}")
    assert r.stdout == want["completion"] + "\n" and "Loading weights" not in r.stderr, r.stderr[-2000:]


def test_generate_without_a_prompt_is_one_line(tmp_path):
    r = warm_cli.run([*finetune_cmd(), "mode=generate", "backend=cuda", f"hydra.run.dir={tmp_path}/g"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == ('error: mode=generate needs a prompt: add prompt="..." '
                                                 '(or generate.prompt="...")')
