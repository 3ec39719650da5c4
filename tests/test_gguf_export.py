"""finetune-export --to gguf (issue 35): a tiny Qwen2 (tied head, q/k/v biases) and a tiny Llama
(untied head, q/k rows permuted for llama.cpp), each trained on both backends, exported to GGUF
and loaded by a reader that is not ours: transformers' ``from_pretrained(..., gguf_file=...)``,
which dequantizes through ``gguf``. Its logits are held to the merged model's, its tokenizer
(read back from the GGUF's metadata) to the model's own ids for a chat-formatted sample; what
cannot be exported is refused in one line, and a disk that fills in the middle of the write
leaves no file.

f16 is what llama.cpp's convert_hf_to_gguf.py writes: norms and biases F32, every other weight
rounded to f16 (numpy's round-to-nearest, as convert does). The GGUF's logits equal those of the
merged model with exactly that rounding (measured: 0.0 on all four runs), so the layout, the
permutation and the metadata are exact; the rounding itself moves the fp32 tiny models' logits
(Qwen2, whose weights are at a trained network's scale: ~2e-3; Llama at transformers' 0.02 init:
less), and that gap is all rounding: the f32 GGUF equals the fp32 merge.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import HAS_MLX, HAS_TORCH, fill_disk, make_cfg

from finetune.resolver import resolve

pytestmark = pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both torch+peft and mlx-lm")
gguf = pytest.importorskip("gguf")

IDS = [3, 17, 45, 101, 7, 250, 12, 9, 300, 64, 5, 33]
EXACT = 1e-5  # max abs logit difference where the weights are the same numbers (fp32 arithmetic only)
# q8_0 against the fp32 merge: measured 0.0067-0.064 over the four runs (Llama 0.007-0.008, Qwen2,
# whose weights are at a trained network's scale, 0.055-0.064); each 32-weight block keeps ~8 bits
Q8_TOL = 0.1
EFFECT = 1e-2  # the trained adapter moves the logits by at least this: the GGUF carries it
FAST = ("train.steps=3", "train.warmup_steps=0", "train.eval_every=0", "train.progress=false",
        "data.num_samples=64", "optim.lr=1e-2", "precision=32-true")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 plus 7?"},
        {"role": "assistant", "content": "19"}]


def tiny_llama() -> Path:
    """A tiny Llama with plain RoPE (transformers' GGUF reader reads no RoPE scaling for llama;
    tests/families.py's llama has Llama-3's), untied head, fp32; built once."""
    from families import COMMON, _build_once
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **{**COMMON, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 10000.0}})
    return _build_once("llama-gguf-v1-s0", lambda: AutoModelForCausalLM.from_config(config), 0)


def base_of(family: str) -> Path:
    if family == "llama":
        return tiny_llama()
    from finetune.model.source import resolve_model_dir

    return resolve_model_dir(make_cfg(Path("/nonexistent-run"), "model=tiny").model)


_RUNS: dict[tuple[str, str], Path] = {}


def trained(root: Path, family: str, backend: str) -> Path:
    """A run dir of ``family`` trained 3 steps on ``backend`` (default LoRA keys), once per session."""
    if (family, backend) not in _RUNS:
        from finetune.run.loop import train

        run = root / f"{family}-{backend}"
        extra = (f"model.path={tiny_llama()}",) if family == "llama" else ()
        train(resolve(make_cfg(run, f"backend={backend}", *FAST, *extra)))
        _RUNS[(family, backend)] = run
    return _RUNS[(family, backend)]


@pytest.fixture(scope="session")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "gguf-runs"


def logits(model_dir: Path, gguf_file: str | None = None, round_f16: bool = False) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), gguf_file=gguf_file, dtype=torch.float32).eval()
    with torch.no_grad():
        if round_f16:  # the merged model with its weights as convert_hf_to_gguf.py's f16 stores them
            for p in model.parameters():
                if p.ndim >= 2:
                    p.copy_(p.half().float())
        return model(torch.tensor([IDS])).logits[0].numpy()


# ---- the GGUF in transformers: logits and tokenizer ------------------------------------------
@pytest.mark.parametrize("family,backend", [("qwen2", "cuda"), ("qwen2", "mlx"), ("llama", "cuda"),
                                            ("llama", "mlx")])
def test_gguf_loads_in_transformers_with_the_merged_models_logits(family, backend, root, tmp_path):
    from finetune.export import export_gguf, merge

    run = trained(root, family, backend)
    merged = merge(run, tmp_path / "merged")
    want, rounded = logits(merged), logits(merged, round_f16=True)
    effect = np.abs(want - logits(base_of(family))).max()
    export_gguf(run, tmp_path / "m-f16.gguf", "f16")  # from the adapter: merged inside, as the CLI does
    export_gguf(merged, tmp_path / "m-q8_0.gguf", "q8_0")  # from the merged checkpoint
    f16, q8 = logits(tmp_path, "m-f16.gguf"), logits(tmp_path, "m-q8_0.gguf")
    d_exact, d_f16, d_round = np.abs(f16 - rounded).max(), np.abs(f16 - want).max(), np.abs(rounded - want).max()
    d_q8 = np.abs(q8 - want).max()
    print(f"{family} {backend}: f16 GGUF vs merge with f16-rounded weights {d_exact:.3g}, vs fp32 merge {d_f16:.3g} "
          f"(the rounding alone: {d_round:.3g}); q8_0 vs fp32 merge {d_q8:.3g}; adapter effect {effect:.3g}")
    assert effect > EFFECT, effect
    assert d_exact <= EXACT and abs(d_f16 - d_round) <= EXACT, (d_exact, d_f16, d_round)
    assert d_q8 <= Q8_TOL, d_q8

    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(str(merged))
    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m-f16.gguf")
    text = own.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert back.chat_template == own.chat_template
    assert back(text)["input_ids"] == own(text)["input_ids"], text
    assert back.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True) == own.apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True)

    mf = (tmp_path / "m-f16.Modelfile").read_text()
    assert "FROM ./m-f16.gguf\n" in mf and "<|im_start|>{{ .Role }}" in mf, mf
    assert [ln for ln in mf.splitlines() if ln.startswith("PARAMETER stop")] == [
        'PARAMETER stop "<|im_start|>"', 'PARAMETER stop "<|im_end|>"', 'PARAMETER stop "<|endoftext|>"']
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporaries left


def test_f32_gguf_equals_the_fp32_merge(root, tmp_path):
    """--quant f32 (convert_hf_to_gguf.py --outtype f32) stores the weights as they are: the
    logits are the fp32 merge's, so the f16 gap above is f16's rounding and nothing else."""
    from finetune.export import export_gguf, merge

    run = trained(root, "qwen2", "cuda")
    merged = merge(run, tmp_path / "merged")
    export_gguf(merged, tmp_path / "m.gguf", "f32")
    d = np.abs(logits(tmp_path, "m.gguf") - logits(merged)).max()
    print(f"f32 GGUF vs fp32 merge: {d:.3g}")
    assert d <= EXACT, d


def test_f16_gguf_of_an_f16_base_has_the_merged_models_logits(root, tmp_path):
    """The issue's 1e-3 at f16, where the merged model is what released checkpoints are: the
    trained Qwen2 adapter on its base stored at f16 (Qwen2 and Llama ship 16-bit weights), merged
    (the merge keeps the base's dtype) and exported at f16 (``--base``). Nothing is rounded that
    the merged model does not hold already, so the GGUF's logits are the merged model's to fp32
    arithmetic. (Against an fp32 merge, the fp32 tiny models above, the gap is f16's rounding
    alone: ~2e-3 on Qwen2.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.export import export_gguf, merge

    src, base = base_of("qwen2"), tmp_path / "base-f16"
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float16).save_pretrained(str(base))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (base / f.name).write_bytes(f.read_bytes())
    run = trained(root, "qwen2", "cuda")
    merged = merge(run, tmp_path / "merged", base=str(base))
    assert {v["dtype"] for v in _header_dtypes(merged)} == {"F16"}, "the merge keeps the base's f16"
    export_gguf(run, tmp_path / "m.gguf", "f16", base=str(base))
    want = logits(merged)
    d, effect = np.abs(logits(tmp_path, "m.gguf") - want).max(), np.abs(want - logits(base)).max()
    print(f"f16 GGUF vs the f16 merged model: {d:.3g} (adapter effect {effect:.3g})")
    assert effect > EFFECT, effect
    assert d <= EXACT, d  # the issue asks 1e-3


def _header_dtypes(model_dir: Path) -> list[dict]:
    from finetune.model.safetensors_io import header, tensors_of

    return [v for f in model_dir.glob("*.safetensors") for v in tensors_of(header(f)[0]).values()]


def test_chat_templates_become_ollamas_go_templates():
    """ChatML and Llama-3 templates (rendered by transformers for a probe conversation) map to
    Ollama's Go templates; a default system prompt becomes SYSTEM; anything else gets no TEMPLATE."""
    from transformers import AutoTokenizer

    from finetune.export.modelfile import template_shape

    tok = AutoTokenizer.from_pretrained(str(base_of("qwen2")))
    assert template_shape(tok) == ("chatml", None)
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                         "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    assert template_shape(tok) == ("llama3", None)
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
                         "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert template_shape(tok) == ("chatml", "You are helpful.")
    tok.chat_template = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert template_shape(tok) == (None, None)


# ---- refusals, and a full disk -------------------------------------------------------------
def _one_line_refusal(capsys, argv: list[str], words: str) -> None:
    from finetune import export

    capsys.readouterr()
    assert export.main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and words in err and "Traceback" not in err, err


def test_what_gguf_cannot_say_is_refused_in_one_line(root, tmp_path, capsys):
    from families import build_family

    out = tmp_path / "out"
    out.mkdir()
    # a family gguf's map does not name as transformers names it (fused qkv_proj / gate_up_proj)
    _one_line_refusal(capsys, ["--to", "gguf", str(build_family("phi3")), str(out / "p.gguf")], "family 'phi3'")
    # an adapter on the experts of an MoE: mlx-lm's switch LoRA, trained (1 step) on tiny Mixtral;
    # PEFT's target_parameters on the stacked experts, as backend=cuda writes its config
    # (training Mixtral's experts on cuda takes ~50 s on two shared cores: the config alone here)
    from finetune.run.loop import train

    moe = root / "mixtral-mlx-experts"
    if not (moe / "adapter").is_dir():
        train(resolve(make_cfg(moe, f"model.path={build_family('mixtral')}", "backend=mlx", "method.lora.keys=experts",
                               "train.steps=1", "train.warmup_steps=0", "train.eval_every=0", "train.progress=false",
                               "data.num_samples=24", "train.batch_size=2", "train.grad_accum=1",
                               "train.seq_len=32", "precision=32-true")))
    _one_line_refusal(capsys, ["--to", "gguf", str(moe), str(out / "m.gguf")], "experts of a mixture-of-experts")
    peft_dir = tmp_path / "peft-experts"
    peft_dir.mkdir()
    (peft_dir / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": [], '
        f'"base_model_name_or_path": "{build_family("mixtral")}", '
        '"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}')
    _one_line_refusal(capsys, ["--to", "gguf", str(peft_dir), str(out / "e.gguf")], "experts of a mixture-of-experts")
    run = trained(root, "qwen2", "mlx")
    # not a .gguf name, an existing file, a quantized base without --dequantize
    _one_line_refusal(capsys, ["--to", "gguf", str(run), str(out / "x.bin")], "must be a file name ending in .gguf")
    (out / "taken.gguf").write_text("")
    _one_line_refusal(capsys, ["--to", "gguf", str(run), str(out / "taken.gguf")], "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["taken.gguf"]


def test_a_full_disk_leaves_no_file(small_fs, tmp_path, capsys, monkeypatch):
    """The disk fills after the export's disk check passed and its header is written (a test-only
    pause, FINETUNE_FAULT_EXPORT_PAUSE): the tensors' writes meet a real ENOSPC, the command
    fails in one line and leaves nothing; on the full disk the check refuses before writing."""
    base, marker = base_of("qwen2"), tmp_path / "paused"
    monkeypatch.setenv("FINETUNE_FAULT_EXPORT_PAUSE", str(marker))

    def fill_when_paused() -> None:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        fill_disk(small_fs)
        marker.unlink()

    filler = threading.Thread(target=fill_when_paused, daemon=True)
    filler.start()
    _one_line_refusal(capsys, ["--to", "gguf", str(base), str(small_fs / "m.gguf")], "No space left on device")
    filler.join()
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]
    monkeypatch.delenv("FINETUNE_FAULT_EXPORT_PAUSE")
    _one_line_refusal(capsys, ["--to", "gguf", str(base), str(small_fs / "m.gguf")], "free on")
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_mistral_qwen3_and_an_mlx_quantized_checkpoint(tmp_path, capsys):
    """Mistral goes out as llama.cpp's llama architecture (q/k permuted) and Qwen3 as its qwen3
    (q/k norms), each coming back with its checkpoint's logits; an MLX-quantized model is refused without --dequantize and, with it, dequantized by
    mlx-lm first: its GGUF gives what mlx-lm gives on the quantized model."""
    import mlx.core as mx
    from families import build_family
    from mlx_lm import convert as mlx_convert
    from mlx_lm.utils import load

    from finetune.export import export_gguf

    mistral = build_family("mistral")
    export_gguf(mistral, tmp_path / "m.gguf", "f32")  # (general.name "mistral" exactly sends transformers to a gguf arch that gguf 0.19 lacks)
    d = np.abs(logits(tmp_path, "m.gguf") - logits(mistral)).max()
    print(f"mistral f32 GGUF vs the checkpoint: {d:.3g}")
    assert d <= EXACT, d

    # Qwen3 (q/k norms) at head_dim 128: transformers' GGUF reader reads no head_dim for qwen3
    # (no attention.key_length in its map, unlike qwen3_moe) and takes Qwen3Config's 128; llama.cpp
    # reads the key_length the file carries
    from families import COMMON, _build_once
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", **{**COMMON, "head_dim": 128, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1000000.0}})
    qwen3 = _build_once("qwen3-hd128-gguf-v1-s0", lambda: AutoModelForCausalLM.from_config(config), 0)
    export_gguf(qwen3, tmp_path / "q3.gguf", "f32")
    d = np.abs(logits(tmp_path, "q3.gguf") - logits(qwen3)).max()
    print(f"qwen3 f32 GGUF vs the checkpoint: {d:.3g}")
    assert d <= EXACT, d

    q8 = tmp_path / "q8"
    mlx_convert(str(base_of("qwen2")), str(q8), quantize=True, q_group_size=64, q_bits=8)
    _one_line_refusal(capsys, ["--to", "gguf", str(q8), str(tmp_path / "q.gguf")], "--dequantize")
    assert not (tmp_path / "q.gguf").exists()
    export_gguf(q8, tmp_path / "q.gguf", "f32", dequantize=True)
    model, _ = load(str(q8))
    want = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    d = np.abs(logits(tmp_path, "q.gguf") - want).max()
    print(f"MLX 8-bit model, dequantized to an f32 GGUF, vs mlx-lm on the quantized model: {d:.3g}")
    assert d <= 1e-4, d  # fp32 arithmetic of two libraries (tests/test_export.py's TOL)


def test_llama3_rope_goes_out_as_llama_cpps_rope_freqs(tmp_path):
    """Llama-3 RoPE has no GGUF metadata key: llama.cpp divides each rotary frequency by the
    ``rope_freqs`` tensor instead. Those factors, read back from the file, turn plain RoPE's
    frequencies into transformers' own Llama-3 ones (its rope init, not ours)."""
    import torch
    from families import build_family, family_config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from finetune.export import export_gguf

    export_gguf(build_family("llama"), tmp_path / "m.gguf", "f16")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    factors = next(np.array(t.data, dtype=np.float32) for t in reader.tensors if t.name == "rope_freqs.weight")
    config = family_config("llama")
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    dim, theta = config.head_dim, config.rope_parameters["rope_theta"]
    plain = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    assert len(set(np.round(factors, 3))) > 2, factors  # the tiny config's short context: all three regimes
    np.testing.assert_allclose(plain / factors, llama3.double().numpy(), rtol=1e-5)


def test_the_export_holds_one_tensor_at_a_time(tmp_path):
    """Streaming: the Python heap (tracemalloc: numpy's arrays included, the memory-mapped
    checkpoint not) peaks at a small part of the model during an export, never a copy of it.
    A 4-layer, 256-wide tiny Qwen2 (16 MB in fp32): measured peak 1.2 MB at q8_0."""
    import tracemalloc

    from transformers import AutoTokenizer

    from finetune.export import export_gguf
    from finetune.model.source import resolve_model_dir

    model = resolve_model_dir(make_cfg(tmp_path / "unused", "model.config.hidden_size=256",
                                       "model.config.intermediate_size=1024", "model.config.num_hidden_layers=4").model)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    AutoTokenizer.from_pretrained(str(model))  # the libraries' first-use caches, outside the measurement
    tracemalloc.start()
    try:
        export_gguf(model, tmp_path / "m.gguf", "q8_0")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"export peak heap {peak:,} bytes for a {size:,}-byte model")
    assert size > 10_000_000 and peak < size / 8, (peak, size)  # the q8_0 file alone is size / 3.7
