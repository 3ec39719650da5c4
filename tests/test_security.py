"""Tokens and keys never reach a file: a run through the CLI with HF / W&B / MLflow secrets
planted in the environment and a key-named config value leaves none of them in the saved
config (.hydra/), metrics, the csv logger's files or the summary; nor does finetune-export in
any file it writes. Export and mode=generate refuse pickle-only weights and a model's own code
unless asked (--allow-pickle / model.allow_pickle, --trust-remote-code / model.trust_remote_code)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAS_MLX, finetune_cmd, needs_torch
import warm_cli

from finetune.redact import redact_text, redact_tree

PLANTED = {"HF_TOKEN": "hf_plantedSECRET0001", "WANDB_API_KEY": "wandbPLANTEDsecret0002",
           "MLFLOW_TRACKING_TOKEN": "mlflowPLANTED0003", "MLFLOW_TRACKING_PASSWORD": "mlflowPASS0004"}
CONFIG_SECRET = "sk-plantedCONFIGkey0005"


def test_redaction_rules():
    tree = {"api_key": "abcdef123", "max_new_tokens": 64, "objective": "tokens_per_sec", "hf_token": None,
            "uri": "http://user:hunter22@host:5000", "nested": [{"password": "p4ssw0rd"}]}
    out = redact_tree(tree, secrets=["planted-env-value"])
    assert out == {"api_key": "***", "max_new_tokens": 64, "objective": "tokens_per_sec", "hf_token": None,
                   "uri": "http://user:***@host:5000", "nested": [{"password": "***"}]}
    assert redact_text("x planted-env-value y", ["planted-env-value"]) == "x *** y"


@needs_torch
def test_planted_tokens_appear_in_no_file(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, **PLANTED}
    r = warm_cli.run([*finetune_cmd(), "backend=cuda", "train.steps=2", "train.eval_every=0", "train.progress=false",
                        "data.num_samples=40", "logger=csv", f"+extra.api_key={CONFIG_SECRET}",
                        f"hydra.run.dir={run}"], env=env, check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "summary.json").is_file() and (run / ".hydra" / "config.yaml").is_file()
    secrets = [*PLANTED.values(), CONFIG_SECRET]
    for f in [p for p in run.rglob("*") if p.is_file()]:
        data = f.read_bytes()
        for s in secrets:
            assert s.encode() not in data, f"{s} in {f}"
    for s in secrets:
        assert s not in r.stderr and s not in r.stdout
    assert "api_key: '***'" in (run / ".hydra" / "config.yaml").read_text() or \
        "api_key: ***" in (run / ".hydra" / "config.yaml").read_text()


# ---- finetune-export and mode=generate -------------------------------------------------------
ADAPTER_SECRET = "wandbKEYinADAPTERcfg0006"  # mlx-lm keeps every training argument in adapter_config.json
BASE_SECRET = "hf_plantedINbaseCONFIG0007"  # a token saved with a model's config / its tokenizer's
TOKENIZER_SECRET = "hf_plantedINtokenizer0008"
REMOTE_CODE = {  # a custom architecture: Qwen2 under another name, whose code leaves a marker when it runs
    "configuration_tinycustom.py": ("import os\nfrom pathlib import Path\n\nfrom transformers import Qwen2Config\n\n"
                                    "Path(os.environ['FINETUNE_TEST_REMOTE_CODE_MARKER']).write_text('ran')\n\n\n"
                                    "class TinyCustomConfig(Qwen2Config):\n    model_type = 'tinycustom'\n"),
    "modeling_tinycustom.py": ("from transformers import Qwen2ForCausalLM\n\nfrom .configuration_tinycustom import "
                               "TinyCustomConfig\n\n\nclass TinyCustomForCausalLM(Qwen2ForCausalLM):\n"
                               "    config_class = TinyCustomConfig\n"),
}


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    from conftest import make_cfg

    from finetune.model.source import resolve_model_dir

    return resolve_model_dir(make_cfg(tmp_path_factory.mktemp("unused") / "run").model)


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "export-runs"  # shared with test_export / test_generate


def _run(name: str, runs_root: Path) -> Path:
    from test_export import trained_run

    return trained_run(runs_root, name)


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))


def _export(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return warm_cli.run([sys.executable, "-m", "finetune.export", *map(str, args)], check=False,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def _generate(tmp: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return warm_cli.run([*finetune_cmd(), "mode=generate", "prompt=What is 2+3?", "generate.max_new_tokens=4",
                           f"hydra.run.dir={tmp}", *overrides], check=False, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    """The last stderr line of a refused command: exit 2, 'error: ...', no traceback."""
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and all(w in line for w in words), line
    return line


def test_redaction_keeps_a_models_vocabulary_and_finds_what_it_cannot_mask(tmp_path):
    """Model and tokenizer configs call their vocabulary tokens: ids and special tokens stay,
    a credential under a token-named key goes; a secret in a binary file is found, not masked."""
    from finetune.redact import config_secrets, redact_dir, secrets_in_dir

    config = {"bos_token_id": 151643, "eos_token_id": [1, 2], "image_token_index": 151655, "pad_token": "<|pad|>",
              "eos_token": {"content": "</s>", "special": True}, "mask_token": "[MASK]",
              "additional_special_tokens": ["<a>"], "token": BASE_SECRET, "hub_token": "hf_abcdefghij"}
    assert config_secrets(config) == [BASE_SECRET, "hf_abcdefghij"]
    assert redact_tree(config, []) == {**config, "token": "***", "hub_token": "***"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"token": 7, "_token": 151643}},
                                                         "note": f"x {BASE_SECRET} y"}))
    (tmp_path / "untouched.json").write_text('{"a":  1}')
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01" + BASE_SECRET.encode() + b"\xff")
    redact_dir(tmp_path, [BASE_SECRET])
    assert json.loads((tmp_path / "config.json").read_text()) == {**config, "token": "***", "hub_token": "***"}
    # a vocabulary keeps its keys' values (they are words), loses the secret's value
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == {
        "model": {"vocab": {"token": 7, "_token": 151643}}, "note": "x *** y"}
    assert (tmp_path / "untouched.json").read_text() == '{"a":  1}'  # nothing to mask: byte for byte
    assert secrets_in_dir(tmp_path, [BASE_SECRET]) == [(tmp_path / "weights.bin", BASE_SECRET)]


@needs_torch
def test_export_writes_no_planted_token_or_key(runs_root, tiny_base, tmp_path):
    """HF/W&B/MLflow tokens in the environment, a key in the adapter's config (as mlx-lm keeps
    its training arguments), a token in the base's config.json and tokenizer_config.json (and
    the environment's HF token in a plain field): none is in any file of any export, conversion
    or merge, nor in the command's output; the exported model keeps its vocabulary and loads."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    _edit_json(base / "config.json", hub_token=BASE_SECRET, note=f"pushed with {PLANTED['HF_TOKEN']}")
    _edit_json(base / "tokenizer_config.json", token=TOKENIZER_SECRET)
    sources = {}
    names = ["cuda-lora"] + (["mlx-lora"] if HAS_MLX else [])
    for name in names:
        src = sources[name] = tmp_path / name
        shutil.copytree(_run(name, runs_root) / "adapter", src)
        key = "base_model_name_or_path" if name.startswith("cuda") else "model"
        _edit_json(src / "adapter_config.json", **{key: str(base), "wandb_api_key": ADAPTER_SECRET,
                                                   "hf_token": PLANTED["HF_TOKEN"]})
    jobs = [("--to", "mlx", sources["cuda-lora"], tmp_path / "out-mlx"),
            ("--merge", sources["cuda-lora"], tmp_path / "out-merged-peft")]
    if HAS_MLX:
        jobs += [("--to", "peft", sources["mlx-lora"], tmp_path / "out-peft"),
                 ("--merge", sources["mlx-lora"], tmp_path / "out-merged-from-mlx")]
    secrets = [*PLANTED.values(), CONFIG_SECRET, ADAPTER_SECRET, BASE_SECRET, TOKENIZER_SECRET]
    for args in jobs:
        r = _export(*args, env=PLANTED)
        assert r.returncode == 0, r.stderr[-3000:]
        out = Path(args[-1])
        files = [p for p in out.rglob("*") if p.is_file()]
        assert files, out
        for f in files:
            data = f.read_bytes()
            for s in secrets:
                assert s.encode() not in data, f"{s} in {f}"
        for s in secrets:
            assert s not in r.stderr and s not in r.stdout
    if HAS_MLX:
        from finetune.export import merge

        merge(sources["mlx-lora"], tmp_path / "out-merged-mlx", engine="mlx")  # mlx-lm's save writes its own files
        for f in (tmp_path / "out-merged-mlx").rglob("*"):
            if f.is_file():
                assert not any(s.encode() in f.read_bytes() for s in secrets), f
    merged = tmp_path / "out-merged-peft"
    config = json.loads((merged / "config.json").read_text())
    assert config["hub_token"] == "***" and config["note"] == "pushed with ***"
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 0)  # vocabulary ids untouched
    from transformers import AutoTokenizer

    want, got = AutoTokenizer.from_pretrained(str(tiny_base)), AutoTokenizer.from_pretrained(str(merged))
    assert (got.eos_token, got.pad_token, got.chat_template) == (want.eos_token, want.pad_token, want.chat_template)
    assert got("What is 2+3?")["input_ids"] == want("What is 2+3?")["input_ids"]


@needs_torch
def test_a_pickle_only_model_is_refused_by_export_and_generate(runs_root, tiny_base, tmp_path):
    """Weights only in a pickle (never opened here: the file is not even a valid pickle) are
    refused before any loader runs, in one line naming the fix, exit 2, by every command."""
    pk = tmp_path / "pickle_only"
    shutil.copytree(tiny_base, pk)
    (pk / "model.safetensors").unlink()
    (pk / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    run = _run("cuda-lora", runs_root)
    adapter = tmp_path / "adapter"  # an adapter whose config names the pickle-only base
    shutil.copytree(run / "adapter", adapter)
    _edit_json(adapter / "adapter_config.json", base_model_name_or_path=str(pk))
    for how in (("--to", "mlx"), ("--merge",)):
        r = _export(*how, run, tmp_path / "out", "--base", pk)
        _one_line_error(r, f"base model {pk}", "has only pickle weights (pytorch_model.bin), which run code when "
                        "loaded; convert them to safetensors, or add --allow-pickle")
        assert not (tmp_path / "out").exists()
    for backend in ["cuda"] + (["mlx"] if HAS_MLX else []):
        r = _generate(tmp_path / f"g-{backend}", f"backend={backend}", "model=qwen2-0.5b", f"model.path={pk}")
        _one_line_error(r, f"model.path={pk} has only pickle weights (pytorch_model.bin), which run code when "
                        "loaded; convert them to safetensors, or set model.allow_pickle=true")
        r = _generate(tmp_path / f"g2-{backend}", f"backend={backend}", f"generate.adapter={adapter}")
        _one_line_error(r, f"model.path={pk} has only pickle weights (pytorch_model.bin)")  # the base it names


@needs_torch
def test_allow_pickle_loads_a_real_pickle_base_where_the_library_can(runs_root, tiny_base, tmp_path):
    """With model.allow_pickle=true / --allow-pickle a real torch pickle is used: transformers
    loads it and generates what the safetensors base generates; conversion reads its shapes
    (weights-only unpickler, meta device); mlx-lm, which loads safetensors only, says so."""
    import torch
    from safetensors.torch import load_file

    pk = tmp_path / "pickle_base"
    shutil.copytree(tiny_base, pk)
    torch.save(load_file(str(pk / "model.safetensors")), pk / "pytorch_model.bin")
    (pk / "model.safetensors").unlink()
    want = _generate(tmp_path / "g0", "backend=cuda", "model=qwen2-0.5b", f"model.path={tiny_base}")
    got = _generate(tmp_path / "g1", "backend=cuda", "model=qwen2-0.5b", f"model.path={pk}", "model.allow_pickle=true")
    assert want.returncode == 0 and got.returncode == 0, (want.stderr[-2000:], got.stderr[-2000:])
    assert got.stdout == want.stdout
    run = _run("cuda-lora", runs_root)
    r = _export("--to", "mlx", run, tmp_path / "mlx-adapter", "--base", pk, "--allow-pickle")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _export("--to", "mlx", run, tmp_path / "mlx-adapter-ref", "--base", tiny_base)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "mlx-adapter" / "adapters.safetensors").read_bytes() == \
        (tmp_path / "mlx-adapter-ref" / "adapters.safetensors").read_bytes()
    # a merge onto the pickle base (--allow-pickle: transformers reads the pickle) is the merge
    # onto the safetensors base, tensor for tensor
    for base, out, extra in ((pk, "merged-pk", ("--allow-pickle",)), (tiny_base, "merged-ref", ())):
        r = _export("--merge", run, tmp_path / out, "--base", base, *extra)
        assert r.returncode == 0, r.stderr[-2000:]
    got_w, want_w = load_file(str(tmp_path / "merged-pk" / "model.safetensors")), \
        load_file(str(tmp_path / "merged-ref" / "model.safetensors"))
    assert got_w.keys() == want_w.keys() and all(torch.equal(got_w[k], want_w[k]) for k in want_w)
    if HAS_MLX:
        r = _generate(tmp_path / "g2", "backend=mlx", "model=qwen2-0.5b", f"model.path={pk}", "model.allow_pickle=true")
        _one_line_error(r, "mlx-lm does not load", "use backend=cuda")


@needs_torch
def test_trust_remote_code_reaches_the_loaders_and_is_off_by_default(runs_root, tiny_base, tmp_path):
    """A model whose architecture is its own Python code (config.json auto_map): without
    trust_remote_code generate and export refuse it in one line and its code never runs; with
    model.trust_remote_code=true / --trust-remote-code it runs (a marker file) and they work."""
    custom, marker = tmp_path / "custom", tmp_path / "remote-code-ran"
    shutil.copytree(tiny_base, custom)
    for name, text in REMOTE_CODE.items():
        (custom / name).write_text(text)
    _edit_json(custom / "config.json", model_type="tinycustom", architectures=["TinyCustomForCausalLM"],
               auto_map={"AutoConfig": "configuration_tinycustom.TinyCustomConfig",
                         "AutoModelForCausalLM": "modeling_tinycustom.TinyCustomForCausalLM"})
    env = {"FINETUNE_TEST_REMOTE_CODE_MARKER": str(marker), "HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    run = _run("cuda-lora", runs_root)
    r = _generate(tmp_path / "g0", "backend=cuda", "model=qwen2-0.5b", f"model.path={custom}", env=env)
    _one_line_error(r, "needs its own Python code", "set model.trust_remote_code=true if you trust the source")
    r = _export("--merge", run, tmp_path / "merged", "--base", custom, env=env)
    _one_line_error(r, "needs its own Python code", "add --trust-remote-code")
    assert not marker.exists() and not (tmp_path / "merged").exists()
    r = _generate(tmp_path / "g1", "backend=cuda", "model=qwen2-0.5b", f"model.path={custom}",
                  "model.trust_remote_code=true", env=env)
    assert r.returncode == 0 and marker.exists(), r.stderr[-3000:]
    marker.unlink()
    r = _export("--merge", run, tmp_path / "merged", "--base", custom, "--trust-remote-code", env=env)
    assert r.returncode == 0 and marker.exists(), r.stderr[-3000:]
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "tinycustom"
