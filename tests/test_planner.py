"""The planner against the real libraries: exact where the math is exact (parameter counts,
weight and optimizer-state bytes, census figures), tolerances for activations and peaks.

Nothing here mocks the planner's subject: counts are checked against transformers models built
on the meta device with PEFT adapters, bytes against bitsandbytes/torch/mlx objects and against
the backends' own census after a real optimizer step on the tiny model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from finetune.resolver import resolve
from conftest import HAS_MLX, HAS_TORCH, REPO, make_cfg, needs_mlx, needs_torch
import warm_cli

from finetune import planner
from finetune.budget import parse_budget
from finetune.errors import UserError

PRESETS = ("tiny", "qwen2-0.5b", "qwen2-7b", "qwen2-72b", "llama2-7b", "llama3-8b")
ALL_KEYS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _cfg(tmp_path: Path, *overrides: str):
    return make_cfg(tmp_path, *overrides)


# ---- parameter counts vs real (meta-device) models ---------------------------------------------

def _meta_counts(model_cfg, method: str, keys: list[str], rank: int, num_layers: int) -> tuple[int, int]:
    """(total, trainable) of the transformers model for the preset, with PEFT adapters as
    backends/cuda.py builds them, instantiated on the meta device (no memory, no download)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    m = model_cfg.config  # the preset's config.json facts
    kw = {"hidden_size": m.hidden_size, "num_hidden_layers": m.num_hidden_layers,
          "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_key_value_heads,
          "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
          "tie_word_embeddings": m.tie_word_embeddings}
    hf_cfg = Qwen2Config(**kw) if m.model_type == "qwen2" else LlamaConfig(
        attention_bias=m.get("attention_bias", False), mlp_bias=m.get("mlp_bias", False), **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    if method != "full":
        L = m.num_hidden_layers
        top = list(range(L - num_layers, L)) if 0 < num_layers < L else None
        model = get_peft_model(model, LoraConfig(r=rank, target_modules=keys, layers_to_transform=top,
                                                  use_dora=method == "dora"))
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


@needs_torch
@pytest.mark.parametrize("preset", PRESETS)
def test_param_counts_equal_meta_models(preset, tmp_path):
    """params_total and params_trainable equal a real transformers+PEFT model's for every
    preset and method; qlora trains exactly what lora trains."""
    for keys, rank, n in ((["q_proj", "v_proj"], 8, -1), (ALL_KEYS, 16, 3)):
        over = [f"model={preset}", f"method.lora.keys=[{','.join(keys)}]", f"method.lora.rank={rank}",
                f"method.lora.num_layers={n}", "backend=cuda"]
        counts = {}
        for method in ("lora", "dora", "full", "qlora"):
            cfg = _cfg(tmp_path, *over, f"method={method}")
            got = (planner.params_total(resolve(cfg)), planner.trainable_params(resolve(cfg)))
            counts[method] = got
            if method != "qlora":
                assert got == _meta_counts(cfg.model, method, keys, rank, n), (preset, method, keys)
        assert counts["qlora"] == counts["lora"]
        # both backends build the same adapters: mlx counts agree
        for method in ("lora", "dora", "full"):
            cfg = _cfg(tmp_path, *over[:-1], "backend=mlx", f"method={method}")
            assert (planner.params_total(resolve(cfg)), planner.trainable_params(resolve(cfg))) == counts[method]


def test_published_sizes(tmp_path):
    """Anchors independent of any library: Qwen2-0.5B has 494,032,768 parameters and
    Qwen2-72B 72,706,203,648 (their model cards round these to 0.49 B and 72.7 B)."""
    assert planner.params_total(resolve(_cfg(tmp_path, "model=qwen2-0.5b", "method=full"))) == 494_032_768
    assert planner.params_total(resolve(_cfg(tmp_path, "model=qwen2-72b", "method=full"))) == 72_706_203_648
    # LoRA r=8 on q,v of Llama-2-7B: 32 layers x 8 x ((4096+4096) + (4096+4096)) = 4,194,304
    assert planner.trainable_params(resolve(_cfg(tmp_path, "model=llama2-7b"))) == 4_194_304


def test_local_config_json_wins(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 1000, "tie_word_embeddings": False}))
    cfg = _cfg(tmp_path, "method=full", f"model.path={d}")
    h, kv, f, V = 128, 64, 256, 1000
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert planner.params_total(resolve(cfg)) == 2 * V * h + 3 * per_layer + h
    p = planner.plan(resolve(cfg), recommend=False)
    assert p["model"]["source"].endswith("config.json") and p["model"]["layers"] == 3


# ---- bytes of weights and optimizer state vs the libraries -------------------------------------

@needs_torch
@pytest.mark.parametrize("shape,double", [((300, 256), True), ((300, 256), False), ((65, 63), True), ((4096, 70), True)])
def test_bnb_4bit_bytes_equal_quantize_4bit(shape, double):
    """Packed weight + every QuantState tensor (absmax, code, offset, nested state) of a real
    bitsandbytes NF4 quantization equal bnb4_bytes()."""
    import torch
    bnbF = pytest.importorskip("bitsandbytes.functional")

    w = torch.randn(*shape)
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=double, quant_type="nf4")

    def tensors(state):
        for v in vars(state).values():
            if torch.is_tensor(v):
                yield v
            elif type(v).__name__ == "QuantState":
                yield from tensors(v)

    consts = sum(t.numel() * t.element_size() for t in tensors(qs))
    assert planner.bnb4_bytes(w.numel(), double) == (packed.numel() * packed.element_size(), consts)


@needs_torch
def test_bnb_8bit_optimizer_state_equals_real_state():
    """AdamW8bit after one step on CPU: a 4096-element param has uint8 state1/state2 plus fp32
    absmax per 256-element block; a 100-element one keeps fp32 state (numel < min_8bit_size);
    the two 256-entry quantile maps are shared."""
    import torch
    bnb = pytest.importorskip("bitsandbytes")

    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(100)),
              torch.nn.Parameter(torch.randn(5000))]
    opt = bnb.optim.AdamW8bit(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    seen, total = set(), 0
    for p in params:
        mine, paged = planner.optimizer_state_bytes("adamw_8bit", "cuda", tuple(p.shape), 4, on_gpu=False)
        real = sum(v.numel() * v.element_size() for k, v in opt.state[p].items()
                   if torch.is_tensor(v) and not k.startswith("qmap"))
        assert (mine, paged) == (real, 0), tuple(p.shape)
        for k, v in opt.state[p].items():
            if k.startswith("qmap") and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    assert total == planner.BNB_QMAPS_BYTES
    # paged: on a GPU the uint8 states of tensors >= 1e5 elements move out of the allocator
    st, paged = planner.optimizer_state_bytes("paged_adamw_8bit", "cuda", (1000, 200), 2, on_gpu=True)
    assert paged == 2 * 200_000 and st == 2 * (200_000 // 256 + 1) * 4


@needs_torch
def test_torch_optimizer_state_equals_real_state():
    """torch AdamW/SGD and transformers Adafactor state after one step, per tensor."""
    import torch
    from transformers.optimization import Adafactor

    shapes = [(48, 32), (32,)]
    for name, make in {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
        "adafactor": lambda ps: Adafactor(ps, lr=1e-3, scale_parameter=False, relative_step=False),
    }.items():
        for dtype, nbytes in ((torch.float32, 4), (torch.bfloat16, 2)):
            ps = [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in shapes]
            opt = make(ps)
            for p in ps:
                p.grad = torch.randn_like(p)
            opt.step()
            for p in ps:
                real = sum(v.numel() * v.element_size() for v in opt.state[p].values() if torch.is_tensor(v))
                mine, _ = planner.optimizer_state_bytes(name, "cuda", tuple(p.shape), nbytes, on_gpu=False,
                                                        momentum=0.9, host_step=True)
                assert mine == real, (name, dtype, p.shape)


@needs_mlx
def test_mlx_optimizer_state_and_quantization_equal_real_arrays():
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    shapes = {"w": (48, 32), "b": (32,)}
    for name, make in {"adamw": lambda: optim.AdamW(1e-3), "sgd": lambda: optim.SGD(1e-3),
                       "adafactor": lambda: optim.Adafactor(1e-3)}.items():
        for dtype, nbytes in ((mx.float32, 4), (mx.bfloat16, 2)):
            params = {k: mx.zeros(s, dtype=dtype) for k, s in shapes.items()}
            opt = make()
            opt.init(params)
            mx.eval(opt.state)
            for k, s in shapes.items():
                real = sum(v.nbytes for _, v in tree_flatten(opt.state[k]))
                assert planner.optimizer_state_bytes(name, "mlx", s, nbytes, on_gpu=False)[0] == real, (name, k, dtype)
    for bits, group, out_f, in_f in ((4, 64, 96, 128), (8, 32, 40, 64)):
        q = nn.QuantizedLinear(in_f, out_f, bias=False, group_size=group, bits=bits)
        mx.eval(q.parameters())
        assert planner.mlx_quant_bytes(out_f, in_f, bits, group, 4) == (q.weight.nbytes, q.scales.nbytes + q.biases.nbytes)


def _fixed_batch(vocab: int, B: int, T: int, seed: int = 0):
    from finetune.backends.base import Batch

    ids = np.random.default_rng(seed).integers(1, vocab, (B, T)).astype(np.int32)
    return Batch(ids, np.ones((B, T), np.int8), np.full(B, T, np.int32))


CENSUS_CASES = {
    "cuda": [(), ("method=full",), ("method=dora",), ("method=qlora",), ("method=qlora", "method.double_quant=false"),
             ("optim=adamw_8bit", "method=full"), ("optim=sgd", "optim.momentum=0.9"), ("method=full", "optim=adafactor"),
             ("precision=bf16-true",), ("precision=bf16-mixed", "method=full")],
    "mlx": [(), ("method=full",), ("method=dora",), ("method=qlora",), ("optim=sgd",),
            ("method=full", "optim=adafactor"), ("method=qlora", "precision=bf16-true")],
}


@pytest.mark.parametrize("backend", ["cuda", "mlx"])
def test_plan_equals_backend_census_after_a_step(backend, tmp_path):
    """The real backend, one optimizer step on the tiny model: parameter counts equal ModelInfo
    and weights (quantization constants included), trainable weights and optimizer state equal
    the census to the byte (plan_error reports 0 relative error)."""
    if backend == "cuda" and not HAS_TORCH or backend == "mlx" and not HAS_MLX:
        pytest.skip(f"{backend} framework not installed")
    from finetune.model.source import resolve_model_dir

    if backend == "cuda":
        from finetune.backends.cuda.runtime import CudaBackend as Backend
    else:
        from finetune.backends.mlx.runtime import MlxBackend as Backend
    for over in CENSUS_CASES[backend]:
        cfg = _cfg(tmp_path, f"backend={backend}", "train.batch_size=2", *over)
        be = Backend()
        info = be.setup(resolve(cfg), resolve_model_dir(cfg.model))
        be.forward_backward(_fixed_batch(cfg.model.config.vocab_size, 2, 16), 1.0)
        be.optimizer_step(1e-3)
        p = planner.plan(resolve(cfg), seq_len=16, recommend=False)
        assert (p["params_total"], p["params_trainable"]) == (info.params_total, info.params_trainable), over
        err = planner.plan_error(p, be.census(), {})
        for k in ("weights", "trainable_weights", "optimizer_state", "optimizer_state_paged"):
            assert err[k]["error_bytes"] == 0, (over, k, err[k])
            assert err[k]["relative_error"] in (0.0, None)
        assert err["grads"]["measured"] is None  # released by the step: not measured, not 0


# ---- activations vs what the frameworks keep ---------------------------------------------------

def kept_by_autograd(be: Any, batch: Any) -> tuple[int, int]:
    """Bytes autograd saves for backward in one CudaBackend.forward_backward of ``batch``: (up to
    the output head, in the head and loss). Unique storages, parameters excluded
    (torch.autograd.graph.saved_tensors_hooks); the one-time head check runs first, uncounted."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in be.model.parameters()}
    seen: dict[int, tuple[str, int]] = {}
    region = ["model"]

    def pack(t: Any) -> Any:
        try:
            ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return t
        if ptr not in params and ptr not in seen:
            seen[ptr] = (region[0], nbytes)
        return t

    be.eval_loss(batch)  # the one-time head check's forward, before counting
    handle = be.hf.get_output_embeddings().register_forward_hook(lambda *a: region.__setitem__(0, "loss"))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            be.forward_backward(batch, 1.0)
    finally:
        handle.remove()
    return (sum(n for r, n in seen.values() if r == "model"), sum(n for r, n in seen.values() if r == "loss"))


@needs_torch
@pytest.mark.parametrize("over", [(), ("method=full",), ("precision=bf16-mixed",), ("precision=bf16-true", "method=full"),
                                  ("method.lora.keys=[o_proj,down_proj]", "method.lora.num_layers=1")])
def test_torch_saved_tensors_match_activation_model(over, tmp_path):
    """Every tensor autograd saves during the CudaBackend's forward (torch.autograd.graph.
    saved_tensors_hooks, unique storages, parameters excluded) up to the lm_head equals the
    plan's kept activations within 3%; the loss keeps the fp32 log-softmax."""
    import torch

    from finetune.backends.cuda.runtime import CudaBackend
    from finetune.model.source import resolve_model_dir

    B, T = 3, 40
    cfg = _cfg(tmp_path, "backend=cuda", f"train.batch_size={B}", *over)
    be = CudaBackend()
    be.setup(resolve(cfg), resolve_model_dir(cfg.model))
    kept, loss = kept_by_autograd(be, _fixed_batch(cfg.model.config.vocab_size, B, T))
    arch, s = planner.resolve(resolve(cfg), seq_len=T)
    _, _, d = planner.activations(arch, s)
    predicted = d["saved_layers"] + d["head"] - B * T * T  # no padding here: sdpa gets no mask
    assert predicted == pytest.approx(kept, rel=0.03), (over, predicted, kept)
    assert loss >= B * (T - 1) * arch.vocab * 4  # log_softmax output, fp32


@needs_torch
@pytest.mark.parametrize("over", [(), ("method=full",), ("precision=bf16-mixed",), ("train.grad_checkpointing=true",),
                                  ("method=dora",), ("model.config.intermediate_size=512", "precision=bf16-true"),
                                  ("method=full", "train.grad_accum=2")])
def test_torch_step_peak_matches_allocator_events(over, tmp_path):
    """A real CudaBackend step on the CPU under torch.profiler(profile_memory=True): the peak of
    the running sum of the CPU allocator's alloc/free events above what existed before (weights,
    optimizer state) equals the plan's peak_allocated - steady_state within 5%."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from finetune.backends.cuda.runtime import CudaBackend
    from finetune.model.source import resolve_model_dir

    B, T = 4, 128
    cfg = _cfg(tmp_path, "backend=cuda", f"train.batch_size={B}", *over)
    be = CudaBackend()
    be.setup(resolve(cfg), resolve_model_dir(cfg.model))
    be.forward_backward(_fixed_batch(cfg.model.config.vocab_size, B, T), 1.0)
    be.optimizer_step(1e-3)  # optimizer state exists from here on, as in the steady state
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for micro in range(int(cfg.train.grad_accum)):
            be.forward_backward(_fixed_batch(cfg.model.config.vocab_size, B, T, seed=1 + micro), 1.0)
        be.optimizer_step(1e-3)
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    p = planner.plan(resolve(cfg), seq_len=T, recommend=False)
    planned = p["peak_allocated_bytes"] - p["steady_state_allocated_bytes"]
    assert planned == pytest.approx(peak, rel=0.05), (over, planned, peak)


MLX_PEAK_CASES = [((), 4, 64), ((), 8, 128), (("method=full",), 4, 64), (("method=qlora",), 8, 100),
                  (("precision=bf16-true",), 8, 128), (("method=dora",), 4, 96), (("train.grad_accum=2",), 4, 96),
                  # mx.checkpoint: saved block inputs + part of one recomputed block
                  (("train.grad_checkpointing=true",), 8, 64),
                  (("train.grad_checkpointing=true", "method.lora.num_layers=1"), 8, 128),
                  (("train.grad_checkpointing=true",), 16, 256)]

# One process imports what a setup needs and allocates nothing with MLX, then forks a child per
# case: each child's MLX counters start where a fresh process's do, without paying the ~4 s of
# imports (mlx_lm, transformers, torch) a fresh process pays before its first step.
MLX_PEAK_SCRIPT = r"""
import gc, json, os, sys, traceback
sys.path.insert(0, {tests!r})
import mlx.core as mx
import mlx_lm.models.qwen2, mlx_lm.tuner.dora, mlx_lm.tuner.utils, mlx_lm.utils, transformers  # setup's imports
from test_planner import _cfg, _fixed_batch
from pathlib import Path
from finetune.backends.mlx.runtime import MlxBackend
from finetune.model.source import resolve_model_dir
from finetune.resolver import resolve
from finetune import planner
gc.collect()
gc.freeze()  # the imports' objects: shared with each child, scanned by no collection of theirs

def case(over, B, T):
    cfg = _cfg(Path({run!r}), "backend=mlx", f"train.batch_size={{B}}", *over)
    base = mx.get_active_memory()  # what the parent left (a few bytes of constants)
    be = MlxBackend()
    be.setup(resolve(cfg), resolve_model_dir(cfg.model))
    peak = 0
    for step in range(4):
        mx.reset_peak_memory()
        for micro in range(int(cfg.train.grad_accum)):
            be.forward_backward(_fixed_batch(cfg.model.config.vocab_size, B, T, seed=step * 10 + micro), 1.0)
        be.optimizer_step(1e-3)
        peak = max(peak, mx.get_peak_memory() - base)
    return [planner.plan(resolve(cfg), seq_len=T, recommend=False)["peak_allocated_bytes"], peak]

out = []
for over, B, T in {cases!r}:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            res = {{"ok": case(over, B, T)}}
        except BaseException:
            res = {{"error": traceback.format_exc()}}
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    out.append(json.loads(data) if data else {{"error": f"the case's process ended with status {{status}}"}})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def mlx_peaks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """[planned peak_allocated_bytes, measured peak] of every MLX_PEAK_CASES case (or its error)."""
    pytest.importorskip("mlx.core")
    script = MLX_PEAK_SCRIPT.format(tests=str(REPO / "tests"), run=str(tmp_path_factory.mktemp("mlx_peaks") / "run"),
                                    cases=MLX_PEAK_CASES)
    r = warm_cli.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_mlx
@pytest.mark.parametrize("case", range(len(MLX_PEAK_CASES)),
                         ids=[f"over{i}-{B}-{T}" for i, (_, B, T) in enumerate(MLX_PEAK_CASES)])
def test_mlx_peak_within_tolerance(case, mlx_peaks):
    """mx.get_peak_memory over four real optimizer steps (forward+backward and update) on the
    tiny model vs the planned peak_allocated_bytes: within 10% (calibrated model). Four, not
    two: on CPU the same step's peak is bimodal with MLX's thread timing (measured 24.34 or
    24.86 MB for the same batch), and the highest of four steps is the peak the plan prices.

    Measured in a fresh process per case (forked from one that allocated nothing with MLX):
    MLX's counters are process-wide, and arrays an earlier test left alive (then freed
    mid-measurement by the collector) would skew a baseline taken here."""
    over = MLX_PEAK_CASES[case][0]
    res = mlx_peaks[case]
    assert "ok" in res, res.get("error")
    planned, peak = res["ok"]
    assert planned == pytest.approx(peak, rel=0.10), (over, planned, peak)


def test_activation_mechanisms(tmp_path):
    """Directional checks of the mechanisms: checkpointing, fewer adapted layers, eager vs
    sdpa attention, and activations scaling with the micro-batch."""
    def act(*over, T=512):
        arch, s = planner.resolve(resolve(_cfg(tmp_path, "model=qwen2-0.5b", "backend=cuda", *over)), seq_len=T)
        return planner.activations(arch, s)

    base, logits, _ = act()
    assert act("train.grad_checkpointing=true")[0] < base / 4
    assert act("method.lora.num_layers=4")[0] < base / 3
    assert act("method.lora.num_layers=4")[2]["layers_with_grad"] == 4
    eager = act("backend.attn_implementation=eager")[0]
    # eager keeps the fp32 softmax: B * heads * T * T * 4 per layer more (and a bit else)
    assert eager - base >= 24 * 4 * 14 * 512 * 512 * 4
    assert act("train.batch_size=8")[0] == pytest.approx(2 * base, rel=0.02)
    assert logits == 12 * 4 * 512 * 151936


# ---- budgets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text,total,expected", [
    (None, 1000, 1000), (None, None, None), (2**21, None, 2**21), (str(2**21), None, 2**21),
    (" 40GiB ", None, 40 * 2**30),
    ("40GB", None, 40 * 10**9), ("512MiB", None, 512 * 2**20), ("1.5TB", None, 1_500_000_000_000),
    ("2gib", None, 2 * 2**30), ("90%", 1000, 900), ("100%", 2**30, 2**30), ("1KiB", None, 1024),
])
def test_parse_budget(text, total, expected):
    assert parse_budget(text, total) == expected


@pytest.mark.parametrize("text,total", [("lots", 10), ("40 gigs", 10), ("-5GiB", 10), ("0", 10), ("90%", None),
                                        ("150%", 100), ("GiB", 10), (True, 10)])
def test_parse_budget_rejects_bad_text_naming_valid_forms(text, total):
    with pytest.raises(UserError, match="GiB|unit|size"):
        parse_budget(text, total)


@pytest.mark.parametrize("text,says", [(40, "is 40 bytes: did you mean 40GB?"), ("40", "is 40 bytes: did you mean 40GB?"),
                                       ("1048575", "is 1,048,575 bytes: did you mean 1048575MB?")])
def test_a_unitless_budget_below_one_mib_is_refused_as_bytes(text, says):
    """memory.budget=40 meant 40 GB: a number without a unit counts bytes, and below 1 MiB that
    is never a real budget."""
    with pytest.raises(UserError) as e:
        parse_budget(text, None)
    assert says in str(e.value) and "\n" not in str(e.value)


# ---- fitting to a budget ------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_lever", [True, False])
def test_fit_to_budget_lowers_micro_batch_keeping_effective_batch(tmp_path, chunk_lever):
    """The chunked loss first (12 x 1,024 tokens is twelve chunks), then the micro-batch;
    where the lever is not available (train.compile on cuda) the micro-batch alone."""
    from finetune.planner.fit import LOSS_CHUNK_LEVER

    extra = () if chunk_lever else ("train.compile=true",)
    priced = (f"train.loss_chunk={LOSS_CHUNK_LEVER}",) if chunk_lever else ()
    cfg = _cfg(tmp_path, "model=qwen2-0.5b", "backend=cuda", "train.batch_size=12", "train.grad_accum=2",
               "train.seq_len=1024", *extra)
    peaks = {b: planner.plan(resolve(_cfg(tmp_path, "model=qwen2-0.5b", "backend=cuda", f"train.batch_size={b}",
                                  "train.seq_len=1024", *priced)), recommend=False)["max_device_peak_bytes"]
             for b in (12, 8, 6, 4)}
    budget = (peaks[6] + peaks[8]) // 2  # 8 does not divide 24? it does; 8 > budget, 6 fits
    res = planner.fit_to_budget(resolve(cfg), budget)
    assert res.fits and res.batch_size == 6 and res.grad_accum == 4 and not res.grad_checkpointing
    assert res.batch_size * res.grad_accum == 24
    assert res.loss_chunk == (LOSS_CHUNK_LEVER if chunk_lever else 0)
    assert [e["action"] for e in res.events] == ["enable_loss_chunk"] * chunk_lever + ["lower_micro_batch"]
    ev = res.events[-1]
    assert ev["before"]["batch_size"] == 12 and ev["after"]["batch_size"] == 6
    assert set(ev) == {"trigger", "action", "before", "after"}
    assert res.plan["fits"] and res.plan["batch_size"] == 6 and res.plan["max_device_peak_bytes"] <= budget
    # a budget that already fits changes nothing
    same = planner.fit_to_budget(resolve(cfg), peaks[12] * 3)
    assert same.fits and not same.events and same.batch_size == 12 and same.loss_chunk == 0


def test_fit_to_budget_turns_on_checkpointing_then_gives_up_with_suggestions(tmp_path):
    over = ("model=qwen2-0.5b", "backend=cuda", "train.batch_size=4", "train.grad_accum=3", "train.seq_len=2048")
    chunked = "train.loss_chunk=1024"  # what the fit turns on first: 2,047 targets a row
    one = planner.plan(resolve(_cfg(tmp_path, *over[:2], "train.batch_size=1", "train.seq_len=2048", chunked)), recommend=False)
    ck = planner.plan(resolve(_cfg(tmp_path, *over[:2], "train.batch_size=1", "train.seq_len=2048",
                           "train.grad_checkpointing=true", chunked)), recommend=False)
    assert ck["max_device_peak_bytes"] < one["max_device_peak_bytes"]
    res = planner.fit_to_budget(resolve(_cfg(tmp_path, *over)), (one["max_device_peak_bytes"] + ck["max_device_peak_bytes"]) // 2)
    assert res.fits and res.grad_checkpointing and res.batch_size * res.grad_accum == 12
    assert [e["action"] for e in res.events][-1] == "enable_grad_checkpointing"
    # below the weights themselves nothing in the run's own knobs fits
    tiny_budget = one["steady_state_allocated_bytes"] // 2
    res = planner.fit_to_budget(resolve(_cfg(tmp_path, *over)), tiny_budget)
    assert not res.fits and res.plan["fits"] is False and res.batch_size == 1 and res.grad_checkpointing
    assert res.batch_size * res.grad_accum == 12
    # a budget where only other levers help: suggestions name them
    res = planner.fit_to_budget(resolve(_cfg(tmp_path, *over)), int(ck["steady_state_allocated_bytes"] * 1.02))
    assert not res.fits and res.suggestions
    assert any(s.startswith(("method=qlora", "precision=bf16-true", "train.seq_len=")) for s in res.suggestions)


def test_recommendation_and_per_device_split(tmp_path):
    p = planner.plan(resolve(_cfg(tmp_path, "model=qwen2-7b", "backend=cuda", "backend.device=cuda", "train.batch_size=8",
                          "memory.budget=24GiB", "train.seq_len=1024")))
    assert p["budget_bytes"] == 24 * 2**30 and p["fits"] is False
    rec = p["recommendation"]
    # exactly the largest micro-batch (a divisor of the effective batch 8) whose own plan fits
    fitting = [d for d in (8, 4, 2, 1) if planner.plan(
        resolve(_cfg(tmp_path, "model=qwen2-7b", "backend=cuda", "backend.device=cuda", f"train.batch_size={d}",
             f"train.grad_accum={8 // d}", "memory.budget=24GiB", "train.seq_len=1024")),
        recommend=False)["fits"]]
    assert rec["max_micro_batch"] == (fitting[0] if fitting else None)
    assert rec["max_micro_batch"] != 8  # the configured one does not fit
    assert rec["levers"] and all(lv["peak_bytes"] <= p["budget_bytes"] for lv in rec["levers"])
    assert p["bytes"]["overhead"] >= planner.CUDA_CONTEXT_BYTES
    # the balanced split puts every layer on some GPU, evenly-ish
    assign = planner._split_layers([("embed", 1200)] + [(f"layer.{i}", 1000) for i in range(80)] + [("head", 1300)], 4)
    per = [sum(1 for k, v in assign.items() if k.startswith("layer") and v == d) for d in range(4)]
    assert sum(per) == 80 and min(per) >= 15 and max(per) <= 22, per
    assert assign["embed"] == 0 and assign["head"] == 3


def test_split_over_gpus_prices_each_device(tmp_path):
    over = ("model=qwen2-72b", "method=qlora", "backend=cuda", "backend.device=cuda", "precision=bf16-true",
            "memory.budget=40GiB")
    one = planner.plan(resolve(_cfg(tmp_path, *over)), recommend=False)
    four = planner.plan(resolve(_cfg(tmp_path, *over, "backend.device_map=auto", "backend.num_devices=4")), recommend=False)
    assert one["devices"] == 1 and len(one["per_device"]) == 1 and four["devices"] == 4
    devs = four["per_device"]
    assert sum(d["bytes"]["weights"] for d in devs) == one["bytes"]["weights"]
    assert sum(d["bytes"]["optimizer_state"] for d in devs) == one["bytes"]["optimizer_state"]
    assert devs[-1]["bytes"]["logits"] == one["bytes"]["logits"] and devs[0]["bytes"]["logits"] == 0
    assert all(d["bytes"]["overhead"] >= planner.CUDA_CONTEXT_BYTES for d in devs)  # a context per GPU
    assert four["max_device_peak_bytes"] < one["max_device_peak_bytes"] / 2
    assert four["fits"] is True and one["fits"] is False


def test_dataclass_config_plans_like_the_composed_one(tmp_path):
    from finetune.config import Config

    plain = planner.plan(resolve(Config(run_dir=str(tmp_path))), recommend=False)
    composed = planner.plan(resolve(_cfg(tmp_path)), recommend=False)
    assert plain["bytes"] == composed["bytes"] and plain["params_trainable"] == composed["params_trainable"]
    _, s = planner.resolve(resolve(_cfg(tmp_path, "optim.max_grad_norm=null")))
    assert s.clip is False


def test_qlora_and_8bit_shrink_the_plan(tmp_path):
    base = ("model=llama3-8b", "backend=cuda", "backend.device=cuda", "precision=bf16-true")
    lora = planner.plan(resolve(_cfg(tmp_path, *base)), recommend=False)["bytes"]
    qlora = planner.plan(resolve(_cfg(tmp_path, *base, "method=qlora")), recommend=False)["bytes"]
    # NF4 + double quant: 0.5 B/param on Linear weights + constants (1 B per 64-block absmax,
    # 4 B per 256 blocks: 0.127 bit/param, +3.17%); bf16 embeddings and lm_head
    # (2 x 128256 x 4096 x 2 B) are not quantized.
    emb = 2 * 128256 * 4096 * 2
    assert qlora["weights"] - emb == pytest.approx((lora["weights"] - emb) / 4 * (1 + 1 / 32 + 1 / 2048), rel=0.005)
    full = planner.plan(resolve(_cfg(tmp_path, *base, "method=full")), recommend=False)["bytes"]
    full8 = planner.plan(resolve(_cfg(tmp_path, *base, "method=full", "optim=paged_adamw_8bit")), recommend=False)["bytes"]
    assert full["optimizer_state"] == 2 * full["trainable_weights"]  # bf16 state: 2 x 2 B/param
    assert full8["optimizer_state_paged"] > 0.9 * 2 * 8.03e9 and full8["optimizer_state"] < 0.02 * 8.03e9 * 2


def test_plan_error_reports_relative_errors():
    plan = {"bytes": {"weights": 110, "trainable_weights": 10, "grads": 10, "optimizer_state": 20,
                      "optimizer_state_paged": 0},
            "steady_state_allocated_bytes": 130, "peak_allocated_bytes": 300}
    census = {"frozen_weights": 90, "trainable_weights": 10, "grads": 0, "optimizer_state": 25,
              "optimizer_state_paged": 0, "quant_buffers": 0}
    err = planner.plan_error(plan, census, {"allocated": 130, "step_peak_allocated": 250})
    assert err["weights"]["relative_error"] == pytest.approx(0.1) and err["weights"]["error_bytes"] == 10
    assert err["optimizer_state"]["relative_error"] == pytest.approx(-0.2)
    assert err["peak_allocated"]["relative_error"] == pytest.approx(0.2)
    assert err["grads"]["measured"] is None and err["grads"]["relative_error"] is None
    assert err["optimizer_state_paged"]["relative_error"] == 0.0


# ---- mode=plan end to end ------------------------------------------------------------------------

REQUIRED = ("params_total", "params_trainable", "bytes", "steady_state_allocated_bytes", "peak_bytes",
            "per_device", "budget_bytes", "fits", "recommendation")
BYTES = ("weights", "trainable_weights", "grads", "optimizer_state", "optimizer_state_paged", "activations",
         "logits", "overhead")


def test_run_plan_writes_plan_json_and_prints_table(tmp_path, capsys):
    cfg = _cfg(tmp_path, "model=qwen2-7b", "method=qlora", "memory.budget=40GiB", "backend=cuda")
    p = planner.run_plan(resolve(cfg))
    out = capsys.readouterr().out
    written = json.loads((Path(cfg.run_dir) / "plan.json").read_text())
    assert written == json.loads(json.dumps(p))
    assert all(k in written for k in REQUIRED) and all(isinstance(written["bytes"][k], int) for k in BYTES)
    assert "GiB" in out and "peak" in out and out.splitlines()[0].startswith("plan:")
    assert not list(Path(cfg.run_dir).glob(".plan.json.*"))  # no temporary left behind


def test_plan_imports_no_framework(tmp_path):
    """The 72B plan in a fresh interpreter: -X importtime lists no torch, mlx or transformers
    module, which is what keeps it fast (benchmarks/cli_latency.py prints the wall time)."""
    code = (
        "import sys; sys.path.insert(0, 'tests');"
        "from omegaconf import OmegaConf; from finetune.config import Config; from finetune import planner;"
        "from finetune.resolver import resolve;"
        "c = OmegaConf.structured(Config(run_dir=sys.argv[1]));"
        "c.model = OmegaConf.merge(c.model, OmegaConf.load('conf/model/qwen2-72b.yaml'));"
        "c.method.name = 'qlora'; c.memory.budget = '80GiB';"
        "planner.run_plan(resolve(c))"
    )
    r = warm_cli.run([sys.executable, "-X", "importtime", "-c", code, str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = {ln.split("|")[-1].strip().split(".")[0] for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert not imported & {"torch", "mlx", "transformers", "mlx_lm", "bitsandbytes", "peft"}, imported
    assert (tmp_path / "plan.json").is_file()


def test_mlx_backend_rejects_what_mlx_cannot_run(tmp_path):
    with pytest.raises(UserError, match="mlx supports"):
        planner.plan(resolve(_cfg(tmp_path, "backend=mlx", "optim=adamw_8bit")))
    with pytest.raises(UserError, match="mlx supports"):
        planner.plan(resolve(_cfg(tmp_path, "backend=mlx", "precision=bf16-mixed")))
    with pytest.raises(UserError, match="choose from"):
        planner.plan(resolve(_cfg(tmp_path, "method.lora.keys=[qproj]")))
