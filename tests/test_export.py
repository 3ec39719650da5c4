"""finetune-export on the tiny model, fp32, with the real libraries on both sides: an adapter
trained on one backend, exported, and loaded by the other side's own loader (transformers +
PEFT's ``PeftModel.from_pretrained``; mlx-lm's ``load_adapters`` / ``load(adapter_path=)``) gives
the logits the trained adapter gives where it was trained; merged models load with plain
transformers; what cannot convert is refused in one line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import HAS_MLX, HAS_TORCH, make_cfg
import warm_cli

from finetune.resolver import resolve

pytestmark = pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both torch+peft and mlx-lm")

TOL = 1e-4  # max abs logit difference allowed between the two libraries (fp32)
EFFECT = 1e-2  # the adapter must move the logits by at least this (100x TOL)
IDS = [3, 17, 45, 101, 7, 250, 12, 9, 300, 64, 5, 33]  # token ids of the tiny vocabulary (512)

# name: (backend, method, overrides): each trains 3 steps at lr 1e-2 (the adapter moves)
RUNS = {
    # top layer only, three keys, rank 4, alpha 32: layers_to_transform [1], lora_alpha 32 (scale 8)
    "mlx-lora": ("mlx", "lora", ("method.lora.num_layers=1", "method.lora.keys=[q_proj,v_proj,down_proj]",
                                  "method.lora.rank=4", "method.lora.alpha=32")),
    "cuda-lora": ("cuda", "lora", ("method.lora.dropout=0.1",)),
    "mlx-dora": ("mlx", "dora", ()),
    "cuda-dora": ("cuda", "dora", ("method.lora.num_layers=1",)),
}


def trained_run(root: Path, name: str) -> Path:
    """The run dir of RUNS[name] under ``root``, trained on first use (shared by test modules
    in one session through pytest's basetemp)."""
    run = root / name
    if not (run / "summary.json").is_file():
        from finetune.run.loop import train

        backend, method, extra = RUNS[name]
        train(resolve(make_cfg(run, f"backend={backend}", f"method={method}", "train.steps=3", "optim.lr=1e-2",
                       "train.warmup_steps=0", "train.eval_every=0", "train.progress=false",
                       "data.num_samples=64", *extra)))
    return run


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "export-runs"


@pytest.fixture(scope="module")
def base(runs_root) -> Path:
    from finetune.model.source import resolve_model_dir

    return resolve_model_dir(make_cfg(runs_root / "unused").model)


def torch_logits(base: Path, adapter: Path | None = None, merged: Path | None = None) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(merged or base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float().numpy()


def mlx_logits(base: Path, adapter: Path | None = None, via_load_adapters: bool = False) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    if via_load_adapters:
        model, _ = load(str(base))
        load_adapters(model, str(adapter))
    else:
        model, _ = load(str(base), adapter_path=str(adapter) if adapter else None)
    model.eval()
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


@pytest.fixture(scope="module")
def base_logits(base) -> dict[str, np.ndarray]:
    return {"torch": torch_logits(base), "mlx": mlx_logits(base)}


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return warm_cli.run([sys.executable, "-m", "finetune.export", *map(str, args)], check=False, capture_output=True,
                          text=True, timeout=300)


# ---- conversion: logits equal across libraries --------------------------------------------
@pytest.mark.parametrize("name", ["mlx-lora", "mlx-dora"])
def test_mlx_adapter_exported_to_peft_gives_mlx_lms_logits(name, runs_root, base, base_logits, tmp_path):
    run = trained_run(runs_root, name)
    r = export_cli("--to", "peft", run, tmp_path / "peft")
    assert r.returncode == 0, r.stderr[-2000:]
    want = mlx_logits(base, run / "adapter")  # mlx-lm's own load of the trained adapter
    got = torch_logits(base, tmp_path / "peft")  # transformers + PEFT on the export
    diff, effect = np.abs(want - got).max(), np.abs(want - base_logits["mlx"]).max()
    print(f"{name} -> peft: max abs logit diff {diff:.3g}, adapter effect {effect:.3g}")
    assert diff <= TOL and effect > EFFECT, (diff, effect)
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    src = json.loads((run / "adapter" / "adapter_config.json").read_text())
    lp = src["lora_parameters"]
    assert cfg["r"] == lp["rank"] and cfg["lora_alpha"] == pytest.approx(lp["scale"] * lp["rank"])
    assert cfg["use_dora"] == (name == "mlx-dora") and cfg["base_model_name_or_path"] == str(base)
    if name == "mlx-lora":  # num_layers=1 of 2 -> the top layer; rank 4, alpha 32
        assert cfg["layers_to_transform"] == [1] and cfg["r"] == 4 and cfg["lora_alpha"] == 32
        assert sorted(cfg["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    else:
        assert cfg["layers_to_transform"] is None
    from finetune.model.safetensors_io import read_safetensors

    _, meta = read_safetensors(tmp_path / "peft" / "adapter_model.safetensors")
    made = json.loads(meta["finetune_export"])
    assert made["source_format"] == "mlx" and made["base"] == str(base) and made["version"]


@pytest.mark.parametrize("name", ["cuda-lora", "cuda-dora"])
def test_peft_adapter_exported_to_mlx_gives_peft_logits(name, runs_root, base, base_logits, tmp_path):
    run = trained_run(runs_root, name)
    r = export_cli("--to", "mlx", run / "adapter", tmp_path / "mlx")
    assert r.returncode == 0, r.stderr[-2000:]
    want = torch_logits(base, run / "adapter")  # PEFT's own load of the trained adapter
    got = mlx_logits(base, tmp_path / "mlx", via_load_adapters=True)  # mlx-lm's load_adapters on the export
    diff, effect = np.abs(want - got).max(), np.abs(want - base_logits["torch"]).max()
    print(f"{name} -> mlx: max abs logit diff {diff:.3g}, adapter effect {effect:.3g}")
    assert diff <= TOL and effect > EFFECT, (diff, effect)
    cfg = json.loads((tmp_path / "mlx" / "adapter_config.json").read_text())
    assert cfg["fine_tune_type"] == ("dora" if name == "cuda-dora" else "lora")
    assert cfg["num_layers"] == (1 if name == "cuda-dora" else 2)
    assert cfg["lora_parameters"] == {"rank": 8, "scale": 2.0, "dropout": 0.1 if name == "cuda-lora" else 0.0,
                                      "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    assert cfg["exported_from"]["source_format"] == "peft" and cfg["model"] == str(base)


def test_round_trip_is_bit_exact(runs_root, tmp_path):
    """mlx -> peft -> mlx and peft -> mlx -> peft give back every tensor bit for bit."""
    from finetune.export import convert
    from finetune.model.safetensors_io import read_safetensors

    for name, there, back, weights in (("mlx-dora", "peft", "mlx", "adapters.safetensors"),
                                       ("cuda-lora", "mlx", "peft", "adapter_model.safetensors")):
        run = trained_run(runs_root, name)
        convert(run, tmp_path / f"{name}-{there}", there)
        convert(tmp_path / f"{name}-{there}", tmp_path / f"{name}-{back}", back)
        a, _ = read_safetensors(run / "adapter" / weights)
        b, _ = read_safetensors(tmp_path / f"{name}-{back}" / weights)
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k].data, b[k].data), k


# ---- merge --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,engine", [("cuda-lora", "peft"), ("mlx-dora", "peft"), ("mlx-lora", "mlx")])
def test_merged_model_loads_with_transformers_and_gives_base_plus_adapter(name, engine, runs_root, base, tmp_path):
    from finetune.export import convert, merge

    run = trained_run(runs_root, name)
    merge(run, tmp_path / "merged", engine=engine)
    peft_dir = run / "adapter"
    if name.startswith("mlx"):
        peft_dir = convert(run, tmp_path / "peft", "peft")
    want = torch_logits(base, peft_dir)
    got = torch_logits(base, merged=tmp_path / "merged")  # plain transformers, no PEFT
    diff = np.abs(want - got).max()
    print(f"{name} merged ({engine}) vs base + adapter: max abs logit diff {diff:.3g}")
    assert diff <= TOL, diff
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["exported_from"]["made"] == "merged model" and "quantization" not in config
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "merged")).chat_template
    assert not (tmp_path / "merged" / "adapter_config.json").exists()


def test_merge_on_an_mlx_quantized_base_dequantizes_only_when_asked(runs_root, base, tmp_path):
    from mlx_lm import convert as mlx_convert

    qbase = tmp_path / "q4"
    mlx_convert(str(base), str(qbase), quantize=True, q_group_size=64, q_bits=4)
    src = tmp_path / "adapter"
    shutil.copytree(trained_run(runs_root, "mlx-lora") / "adapter", src)
    r = export_cli("--merge", src, tmp_path / "merged", "--base", qbase)
    assert r.returncode == 2 and not (tmp_path / "merged").exists()
    line = r.stderr.strip()
    assert line.count("\n") == 0 and line.startswith("error: ") and "--dequantize" in line and "GiB" in line, line
    r = export_cli("--to", "peft", src, tmp_path / "peft", "--base", qbase)
    assert r.returncode == 2 and "MLX-quantized" in r.stderr and not (tmp_path / "peft").exists(), r.stderr
    r = export_cli("--merge", src, tmp_path / "merged", "--base", qbase, "--dequantize")
    assert r.returncode == 0, r.stderr[-2000:]
    want = mlx_logits(qbase, src)  # mlx-lm: the quantized base + the adapter
    got = torch_logits(base, merged=tmp_path / "merged")  # transformers: the dequantized merge
    assert np.abs(want - got).max() <= TOL


# ---- refusals -----------------------------------------------------------------------------
def _edited_peft(runs_root: Path, tmp_path: Path, **changes) -> Path:
    src = tmp_path / "src"
    shutil.copytree(trained_run(runs_root, "cuda-lora") / "adapter", src)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(changes)
    (src / "adapter_config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("change,words", [
    ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type=IA3"),
    ({"init_lora_weights": "pissa"}, "pissa"),
])
def test_unconvertible_peft_adapter_is_refused_in_one_line(change, words, runs_root, tmp_path):
    src = _edited_peft(runs_root, tmp_path, **change)
    r = export_cli("--to", "mlx", src, tmp_path / "dst")
    assert r.returncode == 2 and not (tmp_path / "dst").exists()
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_layers_that_are_not_the_top_ones_are_refused_for_mlx(runs_root, tmp_path):
    """PEFT adapts any list of layers; mlx-lm only the top num_layers: layer 0 of 2 alone does
    not convert to mlx (and does convert to PEFT, where it came from)."""
    from finetune.model.safetensors_io import read_safetensors, write_safetensors

    src = _edited_peft(runs_root, tmp_path, layers_to_transform=[0])
    tensors, meta = read_safetensors(src / "adapter_model.safetensors")
    write_safetensors(src / "adapter_model.safetensors", {k: v for k, v in tensors.items() if ".layers.1." not in k},
                      meta)
    r = export_cli("--to", "mlx", src, tmp_path / "dst")
    assert r.returncode == 2 and "top num_layers" in r.stderr and not (tmp_path / "dst").exists(), r.stderr
    assert export_cli("--to", "peft", src, tmp_path / "again").returncode == 0


def test_bad_inputs_are_one_line_errors(runs_root, tmp_path):
    run = trained_run(runs_root, "mlx-lora")
    (tmp_path / "taken").mkdir()
    cases = [
        (("--to", "peft", tmp_path / "nowhere", tmp_path / "d1"), "does not exist"),
        (("--to", "peft", tmp_path / "taken", tmp_path / "d2"), "no adapter_config.json"),
        (("--to", "peft", run, tmp_path / "taken"), "exists"),
        (("--to", "peft", run, tmp_path / "d3", "--base", tmp_path / "taken"), "no config.json"),
    ]
    for args, words in cases:
        r = export_cli(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, (args, r.stderr)
    assert not any((tmp_path / d).exists() for d in ("d1", "d2", "d3"))
    assert list((tmp_path / "taken").iterdir()) == []
