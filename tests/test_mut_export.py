"""finetune-export's library calls on hand-written adapters over the tiny model's real files:
what each format's config says after a conversion (rank, alpha/scale, the target modules, the
layers), what a quantized base's merge is refused with (the sizes, exactly), and what an
unconvertible adapter is refused with. No training and no model loaded: the adapters are
written tensor by tensor, so every number in the output is known in advance. Written for
survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_cfg
from finetune.errors import UserError
from finetune.export import convert, merge
from finetune.model.safetensors_io import Tensor, read_safetensors, write_safetensors

HIDDEN, KV_OUT = 64, 32  # the tiny model: hidden 64, 4 heads of 16, 2 kv heads (v_proj is [32, 64])
OUT = {"self_attn.q_proj": HIDDEN, "self_attn.v_proj": KV_OUT}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from finetune.model.source import resolve_model_dir

    return resolve_model_dir(make_cfg(tmp_path_factory.mktemp("unused")).model)


def _ab(rank: int, out: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rank, HIDDEN)).astype(np.float32),  # A [r, in]
            rng.standard_normal((out, rank)).astype(np.float32))  # B [out, r]


def mlx_adapter(d: Path, base: Path, rank: int = 4, scale: float = 8.0, drop: str = "") -> Path:
    """mlx-lm's layout: the top layer (1 of 2), q_proj and v_proj, lora_a [in, r], lora_b [r, out]."""
    d.mkdir(parents=True)
    tensors = {}
    for i, (rel, out) in enumerate(OUT.items()):
        a, b = _ab(rank, out, i)
        tensors[f"model.layers.1.{rel}.lora_a"] = Tensor("F32", a.T.copy())
        tensors[f"model.layers.1.{rel}.lora_b"] = Tensor("F32", b.T.copy())
    write_safetensors(d / "adapters.safetensors", tensors, {"format": "mlx"})
    lp = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(OUT)}
    lp.pop(drop, None)
    (d / "adapter_config.json").write_text(json.dumps({"model": str(base), "fine_tune_type": "lora", "num_layers": 1,
                                                       "lora_parameters": lp}))
    return d


def peft_adapter(d: Path, base: Path, rank: int = 8, alpha: float = 16.0, **cfg_changes) -> Path:
    """PEFT's layout: both layers, q_proj and v_proj, lora_A [r, in], lora_B [out, r]."""
    d.mkdir(parents=True)
    tensors = {}
    for layer in (0, 1):
        for i, (rel, out) in enumerate(OUT.items()):
            a, b = _ab(rank, out, 10 * layer + i)
            p = f"base_model.model.model.layers.{layer}.{rel}"
            tensors[f"{p}.lora_A.weight"] = Tensor("F32", a)
            tensors[f"{p}.lora_B.weight"] = Tensor("F32", b)
    write_safetensors(d / "adapter_model.safetensors", tensors, {"format": "pt"})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": rank,
           "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
           "use_dora": False, **cfg_changes}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


def test_mlx_adapter_to_peft_writes_alpha_as_scale_times_rank_and_the_short_target_names(tiny, tmp_path):
    src = mlx_adapter(tmp_path / "mlx", tiny, rank=4, scale=8.0)
    convert(src, tmp_path / "peft", "peft", base=str(tiny))
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    # PEFT scales B @ A by lora_alpha / r: 32 / 4 = 8, mlx-lm's scale
    assert (cfg["r"], cfg["lora_alpha"]) == (4, 32.0)
    assert cfg["target_modules"] == ["q_proj", "v_proj"]  # the short names pick exactly these two in the base
    assert cfg["layers_to_transform"] == [1] and cfg["peft_type"] == "LORA" and cfg["use_dora"] is False
    tensors, _ = read_safetensors(tmp_path / "peft" / "adapter_model.safetensors")
    a, b = _ab(4, KV_OUT, 1)
    np.testing.assert_array_equal(tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"].data, a)
    np.testing.assert_array_equal(tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].data, b)


def test_peft_adapter_to_mlx_writes_scale_as_alpha_over_rank(tiny, tmp_path):
    src = peft_adapter(tmp_path / "peft", tiny, rank=8, alpha=16.0)
    convert(src, tmp_path / "mlx", "mlx", base=str(tiny))
    cfg = json.loads((tmp_path / "mlx" / "adapter_config.json").read_text())
    assert cfg["lora_parameters"] == {"rank": 8, "scale": 2.0, "dropout": 0.0,
                                      "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    assert cfg["num_layers"] == 2 and cfg["fine_tune_type"] == "lora"
    tensors, _ = read_safetensors(tmp_path / "mlx" / "adapters.safetensors")
    a, b = _ab(8, HIDDEN, 0)
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.lora_a"].data, a.T)
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.lora_b"].data, b.T)


@pytest.mark.parametrize("peft_type", ["IA3", "PROMPT_TUNING", "VERA"])
def test_a_peft_adapter_other_than_lora_is_refused_by_its_type(tiny, tmp_path, peft_type):
    src = peft_adapter(tmp_path / "peft", tiny, peft_type=peft_type)
    with pytest.raises(UserError, match=rf"peft_type={peft_type}; only LoRA and DoRA adapters convert$"):
        convert(src, tmp_path / "mlx", "mlx", base=str(tiny))
    assert not (tmp_path / "mlx").exists()


@pytest.mark.parametrize("missing", ["scale", "rank"])
def test_an_mlx_config_without_scale_or_rank_is_refused_naming_both_keys(tiny, tmp_path, missing):
    src = mlx_adapter(tmp_path / "mlx", tiny, drop=missing)
    with pytest.raises(UserError, match=r"adapter_config.json: lora_parameters needs rank and scale \(mlx-lm's keys\)$"):
        convert(src, tmp_path / "peft", "peft", base=str(tiny))


def test_an_adapter_wider_than_the_base_is_refused_with_both_shapes(tiny, tmp_path):
    src = mlx_adapter(tmp_path / "mlx", tiny)
    tensors, meta = read_safetensors(src / "adapters.safetensors")
    key = "model.layers.1.self_attn.v_proj.lora_b"
    tensors[key] = Tensor("F32", np.zeros((4, 48), np.float32))  # out 48 where the base's v_proj has 32
    write_safetensors(src / "adapters.safetensors", tensors, meta)
    with pytest.raises(UserError, match=r"model.layers.1.self_attn.v_proj is \[out, in\] = \[48, 64\] in the adapter "
                                        r"but \[32, 64\] in base"):
        convert(src, tmp_path / "peft", "peft", base=str(tiny))


def _quantized_copy(tiny: Path, d: Path, bits: int = 4, group: int = 64) -> tuple[Path, int, int]:
    """The tiny model as mlx_lm.convert -q lays it out (packed uint32 weights, F16 scales and
    biases per group of 64) without mlx: (dir, bytes of its weights file, bytes dequantized)."""
    d.mkdir()
    weights, _ = read_safetensors(tiny / "model.safetensors")
    out, dequantized = {}, 0
    for name, t in weights.items():
        mod = name.removesuffix(".weight")
        if name.endswith("proj.weight"):
            rows, cols = t.shape
            out[name] = Tensor("U32", np.zeros((rows, cols * bits // 32), np.uint32))
            out[mod + ".scales"] = Tensor("F16", np.ones((rows, cols // group), np.float16))
            out[mod + ".biases"] = Tensor("F16", np.zeros((rows, cols // group), np.float16))
            dequantized += rows * cols * 2  # in the scales' dtype, 16-bit
        else:
            out[name] = t
            dequantized += t.data.nbytes  # F32 as stored
    write_safetensors(d / "model.safetensors", out, {"format": "mlx"})
    config = json.loads((tiny / "config.json").read_text())
    config["quantization"] = {"bits": bits, "group_size": group}
    (d / "config.json").write_text(json.dumps(config))
    return d, (d / "model.safetensors").stat().st_size, dequantized


def test_merge_onto_a_quantized_base_without_dequantize_is_refused_with_both_sizes(tiny, tmp_path):
    qbase, now, after = _quantized_copy(tiny, tmp_path / "q4")
    src = mlx_adapter(tmp_path / "mlx", qbase)

    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB ({n:,} bytes)"

    assert size(after) == "0.00 GiB (280,832 bytes)"  # the tiny model: 70,208 parameters in 16 or 32 bits
    want = (f"base {qbase} is MLX-quantized (4-bit); an HF model needs it dequantized: {size(after)} on disk instead "
            f"of {size(now)}, about as much memory while merging; add --dequantize to do it")
    with pytest.raises(UserError) as e:
        merge(src, tmp_path / "merged", base=str(qbase))
    assert str(e.value) == want
    assert not (tmp_path / "merged").exists()



def test_targets_that_would_also_adapt_a_second_stack_are_refused_naming_the_extra_module(tiny, tmp_path):
    """A base with a second decoder stack (a vision tower, say) whose blocks share the
    language model's module names: PEFT's target_modules match by name suffix, so neither
    ``q_proj`` nor ``self_attn.q_proj`` can say "the language model's only"; export refuses
    rather than write an adapter PEFT would spread over the tower too."""
    base = tmp_path / "two-stacks"
    base.mkdir()
    (base / "config.json").write_bytes((tiny / "config.json").read_bytes())
    weights, meta = read_safetensors(tiny / "model.safetensors")
    for rel, out in OUT.items():
        weights[f"model.vision.layers.1.{rel}.weight"] = Tensor("F32", np.zeros((out, HIDDEN), np.float32))
    write_safetensors(base / "model.safetensors", weights, meta)
    src = mlx_adapter(tmp_path / "mlx", base)
    with pytest.raises(UserError) as e:
        convert(src, tmp_path / "peft", "peft", base=str(base))
    assert str(e.value) == (f"target_modules ['self_attn.q_proj', 'self_attn.v_proj'] would also adapt "
                            f"['model.vision.layers.1.self_attn.q_proj'] in base {base}; PEFT cannot say this set "
                            "of modules")
    assert not (tmp_path / "peft").exists()


def test_merge_with_mlx_onto_pickle_only_weights_is_refused_before_loading(tiny, tmp_path):
    """engine=mlx is kept as asked (transformers + PEFT installed or not), and mlx-lm loads no
    pickles: refused in one line, nothing written."""
    torch = pytest.importorskip("torch")
    base = tmp_path / "pickled"
    base.mkdir()
    (base / "config.json").write_bytes((tiny / "config.json").read_bytes())
    weights, _ = read_safetensors(tiny / "model.safetensors")
    torch.save({k: torch.from_numpy(v.data.copy()) for k, v in weights.items()}, base / "pytorch_model.bin")
    src = mlx_adapter(tmp_path / "mlx", base)
    with pytest.raises(UserError) as e:
        merge(src, tmp_path / "merged", base=str(base), engine="mlx", allow_pickle=True)
    assert str(e.value) == (f"base model {base} has only pickle weights, which mlx-lm does not load; convert them to "
                            "safetensors (or merge with transformers + peft installed)")
    assert not (tmp_path / "merged").exists()
