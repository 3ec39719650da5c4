"""The planner on the models people fine-tune: released configs of MoE, soft-capped, plain-MLP
and dense models planned from their config.json alone (parameter counts against the meta-device
counts that tests/test_model_source.py checks), and the planned MLX peak against the measured one
on tiny checkpoints of every family mlx-lm loads (tests/families.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from finetune.resolver import resolve
from conftest import REPO, make_cfg, make_spec, needs_mlx, needs_torch
import warm_cli
from test_model_source import META_PARAMS, RELEASED

from finetune import planner
from finetune.errors import UserError

GIB = 1 << 30


@pytest.mark.parametrize("slug", ["Mixtral-8x7B-v0.1", "Qwen3-30B-A3B", "gpt-oss-20b", "StarCoder2-15B",
                                  "Gemma-2-9B", "Llama-3.1-8B", "Qwen3-8B"])
@pytest.mark.parametrize("backend", ["cuda", "mlx"])
def test_released_config_planned_params_equal_meta_count(slug, backend, tmp_path):
    """Every weight of the model, experts and routers included, from config.json alone: the
    plan's count is within 0.5% of a meta-device build (it is exact: the planner lists every
    weight transformers creates)."""
    p = planner.plan(make_spec(tmp_path, f"backend={backend}", f"model.path={RELEASED / slug}", "method=full",
                              "mode=plan"), recommend=False)
    assert abs(p["params_total"] - META_PARAMS[slug]) <= 0.005 * META_PARAMS[slug]
    assert p["params_total"] == META_PARAMS[slug]
    assert p["params_trainable"] == p["params_total"]


def test_moe_plans_every_expert_and_says_what_is_approximated(tmp_path):
    """Mixtral-8x7B's LoRA plan: 46.7 B parameters (not the 7.2 B of a dense Llama with its
    sizes), 87 GiB of bf16 weights; with 24 GiB per device it does not fit, and the plan names
    what would make it fit (the weights alone need more than one device)."""
    cfg = make_cfg(tmp_path, "backend=cuda", "model=mixtral-8x7b", "memory.budget=24GiB", "mode=plan")
    p = planner.plan(resolve(cfg))
    assert p["model"]["experts"] == 8 and p["model"]["top_k"] == 2 and p["model"]["moe_layers"] == 32
    assert p["params_total"] - p["params_trainable"] == META_PARAMS["Mixtral-8x7B-v0.1"]
    # bf16 weights, nothing quantized, and fp32 adapters
    assert p["bytes"]["weights"] == 2 * META_PARAMS["Mixtral-8x7B-v0.1"] + 4 * p["params_trainable"]
    assert p["fits"] is False
    levers = [lv["change"] for lv in p["recommendation"]["levers"]]
    assert any(lv.startswith("backend.device_map=auto backend.num_devices=") for lv in levers), levers
    split = next(lv for lv in p["recommendation"]["levers"] if lv["change"].startswith("backend.device_map"))
    assert split["peak_bytes"] <= 24 * GIB
    assert any("MoE" in n and "approximated" in n for n in p["notes"])
    table = planner.format_table(p)
    assert "fits: NO" in table and "backend.num_devices=" in table


def test_qlora_on_cuda_leaves_stacked_experts_unquantized(tmp_path):
    """bitsandbytes replaces nn.Linear only: transformers 5's stacked expert parameters stay in
    bf16 under method=qlora on cuda (checked on a real tiny Mixtral in tests/test_families.py's
    census); mlx-lm quantizes its SwitchLinear experts. The plan prices each and says so."""
    over = ["model=mixtral-8x7b", "method=qlora", "mode=plan"]
    cuda = planner.plan(make_spec(tmp_path, "backend=cuda", *over), recommend=False)
    mlx = planner.plan(make_spec(tmp_path, "backend=mlx", *over), recommend=False)
    experts = 32 * 8 * 3 * 4096 * 14336  # layers x experts x (gate, up, down) x hidden x intermediate
    assert cuda["bytes"]["weights"] > 2 * experts  # the experts alone, in bf16
    assert mlx["bytes"]["weights"] < experts  # 4-bit (+ scales and biases)
    assert any("experts" in n and "stay in bfloat16" in n for n in cuda["notes"])


@pytest.mark.parametrize("slug,keys,want", [
    ("Mixtral-8x7B-v0.1", "null", ("q_proj", "v_proj")),
    ("Mixtral-8x7B-v0.1", "all-linear", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("StarCoder2-15B", "all-linear", ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")),
    ("Gemma-2-9B", "[gate_proj,q_proj]", ("q_proj", "gate_proj")),
    ("Qwen3-30B-A3B", "[q_proj,experts]", ("q_proj", "experts")),
])
def test_lora_keys_follow_the_model(slug, keys, want, tmp_path):
    p = planner.plan(make_spec(tmp_path, f"model.path={RELEASED / slug}", f"method.lora.keys={keys}", "mode=plan"),
                     recommend=False)
    assert tuple(p["lora"]["keys"]) == want


def test_lora_keys_the_model_lacks_are_refused_with_its_own_names(tmp_path):
    with pytest.raises(UserError) as e:
        planner.plan(make_spec(tmp_path, f"model.path={RELEASED / 'StarCoder2-15B'}", "method.lora.keys=[gate_proj]",
                              "mode=plan"), recommend=False)
    msg = str(e.value)
    assert "\n" not in msg and "gate_proj is not a linear layer of this starcoder2 model" in msg
    assert "choose from: q_proj, k_proj, v_proj, o_proj, c_fc, c_proj, all-linear" in msg


def test_expert_adapters_are_priced_as_each_library_builds_them(tmp_path):
    """LoRA on Qwen3-30B-A3B's experts: PEFT's target_parameters wrap each stacked parameter
    with lora_A [E*r, in] and lora_B [out, E*r]; mlx-lm's LoRASwitchLinear adapts gate, up and
    down separately ([E, r, in] + [E, out, r] each). Exact counts from the released sizes."""
    over = [f"model.path={RELEASED / 'Qwen3-30B-A3B'}", "method.lora.keys=[experts]", "method.lora.rank=8", "mode=plan"]
    E, r, h, w, L = 128, 8, 2048, 768, 48
    cuda = planner.plan(make_spec(tmp_path, "backend=cuda", *over), recommend=False)
    mlx = planner.plan(make_spec(tmp_path, "backend=mlx", *over), recommend=False)
    assert cuda["params_trainable"] == L * (E * r * (h + 2 * w) + E * r * (w + h))
    assert mlx["params_trainable"] == L * 3 * E * r * (h + w)


def test_attention_the_model_cannot_run_is_refused_in_one_line(tmp_path):
    for slug in ("Gemma-2-9B", "gpt-oss-20b"):
        with pytest.raises(UserError) as e:
            planner.plan(make_spec(tmp_path, "backend=cuda", f"model.path={RELEASED / slug}",
                                  "backend.attn_implementation=sdpa", "mode=plan"), recommend=False)
        assert "only with eager attention" in str(e.value) and "attn_implementation=auto" in str(e.value)
        p = planner.plan(make_spec(tmp_path, "backend=cuda", f"model.path={RELEASED / slug}", "mode=plan"),
                         recommend=False)
        assert p["attn_implementation"] == "eager"


@needs_torch
def test_auto_attention_is_transformers_own_choice():
    """The description's default attention for each family is the one transformers picks when
    left to it (sdpa where the modeling code supports it, eager for Gemma-2 and gpt-oss)."""
    from families import FAMILIES, family_config
    from transformers import AutoModelForCausalLM

    from finetune.model.describe import describe

    for name in FAMILIES:
        cfg = family_config(name)
        model = AutoModelForCausalLM.from_config(cfg)
        desc = describe(cfg.to_dict(), name)
        assert desc.attn_default == model.config._attn_implementation, name
        assert sum(p.numel() for p in model.parameters()) == sum(
            t_numel(desc)), name


def t_numel(desc):
    """Every weight of a description (the planner's inventory without adapters)."""
    import math

    yield desc.vocab * desc.hidden * (1 if desc.tie else 2)
    for b in desc.blocks:
        for lin in b.linears:
            yield lin.numel + (lin.out_f if lin.bias else 0)
        for _, shape, _, _, _ in b.others:
            yield math.prod(shape)
    for _, shape, _, _, _ in desc.top:
        yield math.prod(shape)


MLX_PEAK_SCRIPT = r"""
import gc, json, sys
sys.path.insert(0, {tests!r})
import mlx.core as mx
from families import build_family
from test_planner import _fixed_batch
from finetune.config import compose
from finetune.backends.mlx.runtime import MlxBackend
from finetune.resolver import resolve
from finetune import planner
from finetune.errors import UserError
out = []
for fam, B, T, keys in {cases!r}:
    d = build_family(fam)
    cfg = compose({run!r}, "backend=mlx", f"model.path={{d}}", f"train.batch_size={{B}}", f"train.seq_len={{T}}",
                  "precision=32-true", f"method.lora.keys={{keys}}")
    gc.collect(); mx.clear_cache()
    gc.freeze()  # what outlived the earlier families (modules, caches): no later collection rescans it
    base = mx.get_active_memory()  # what an earlier family left alive (nothing, once collected)
    be = MlxBackend()
    be.setup(resolve(cfg), d)
    peak = 0
    for step in range(4):  # the highest of four steps (CPU peaks are bimodal with thread timing)
        mx.reset_peak_memory()
        be.forward_backward(_fixed_batch(512, B, T, seed=step), 1.0)
        be.optimizer_step(1e-3)
        peak = max(peak, mx.get_peak_memory() - base)
    p = planner.plan(resolve(cfg), seq_len=T, recommend=False)
    out.append([fam, B, T, keys, p["peak_allocated_bytes"], peak])
    del be
print(json.dumps(out))
"""


@needs_mlx
@needs_torch
def test_mlx_peak_within_ten_percent_for_every_family(tmp_path):
    """mx.get_peak_memory over four real LoRA steps of each family mlx-lm loads (dense, soft-capped,
    q/k-normed, fused-projection, MoE, plain-MLP) against the planned peak: within 10%. One fresh
    process for all (MLX's counters are process-wide); each family's baseline is what is alive
    before it loads."""
    cases = [(f, B, T, "null") for f in ("llama", "gemma2", "gemma3", "qwen3", "phi3", "olmo2", "mixtral",
                                          "qwen3_moe", "starcoder2", "granite", "smollm3", "olmoe", "qwen2_moe",
                                          "ministral3", "olmo3", "glm4")
             for B, T in ((4, 64), (16, 64))]
    cases += [(f, 4, 96, "all-linear") for f in ("gemma2", "phi3", "mixtral", "starcoder2", "qwen2_moe")]
    script = MLX_PEAK_SCRIPT.format(tests=str(REPO / "tests"), cases=cases, run=str(tmp_path / "run"))
    r = warm_cli.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    bad = [(f, B, T, k, planned, peak, round(planned / peak - 1, 3)) for f, B, T, k, planned, peak in rows
           if abs(planned / peak - 1) > 0.10]
    assert not bad, bad
    assert len(rows) == len(cases)


@needs_torch
def test_a_lora_on_the_head_is_counted_as_peft_builds_it(tmp_path):
    """method.lora.keys=[q_proj,lm_head] on cuda: PEFT adapts the (tied) output head too, and the
    plan counts its r x (hidden + vocab) adapter; mlx-lm cannot, and says so in one line."""
    from finetune.backends.cuda.runtime import CudaBackend
    from finetune.model.source import resolve_model_dir

    cfg = make_cfg(tmp_path, "backend=cuda", "backend.device=cpu", "method.lora.keys=[q_proj,lm_head]")
    be = CudaBackend()
    info = be.setup(resolve(cfg), resolve_model_dir(cfg.model))
    p = planner.plan(resolve(cfg), recommend=False)
    assert info.params_trainable == p["params_trainable"] == 2 * 8 * (64 + 64) + 8 * (64 + 512)
    with pytest.raises(UserError, match="lm_head cannot be adapted on backend=mlx"):
        planner.plan(make_spec(tmp_path, "backend=mlx", "method.lora.keys=[q_proj,lm_head]"), recommend=False)


# (family, keys) -> tolerance where the CPU keeps more than a GPU would, with the reason
SAVED_TOL = {
    # Phi-3's and GLM-4's partial RoPE concatenates, so q reaches sdpa contiguous in [B, H, T, d];
    # the CPU kernel returns its output in that layout and attention's transpose(1, 2).contiguous()
    # then copies it for the adapted o_proj (one [n, q] copy per layer; measured 6.4% and 5.7%
    # here). CUDA's flash and efficient kernels return [B, T, H, d] whatever q's layout, so the
    # plan does not price that copy.
    ("phi3", "all-linear"): 0.07,
    ("glm4", "all-linear"): 0.07,
}


@needs_torch
@pytest.mark.parametrize("name", sorted(__import__("families").FAMILIES))
def test_cuda_saved_tensors_match_activation_model_for_every_family(name, tmp_path):
    """Every tensor autograd saves in a real CudaBackend step of each family (unique storages,
    parameters excluded, up to the output head; torch.autograd.graph.saved_tensors_hooks)
    against the plan's kept activations, default keys and all-linear: within 3%. Covers what
    only some families do: a sliding-window layer whose rows reach the window (gemma3, gpt-oss:
    sdpa gets a mask, so transformers repeats k and v to every head), a fused qkv whose output v
    is a view of (phi3), gpt-oss's clamped SwiGLU experts, Qwen2-MoE's shared expert."""
    from families import VOCAB, build_family
    from test_planner import _fixed_batch, kept_by_autograd

    from finetune.backends.cuda.runtime import CudaBackend

    B, T = 3, 40  # past the 8-token windows of gemma3 and gpt_oss
    for keys in ("null", "all-linear"):
        cfg = make_cfg(tmp_path / keys, f"model.path={build_family(name)}", "backend=cuda", f"train.batch_size={B}",
                       f"train.seq_len={T}", "precision=32-true", f"method.lora.keys={keys}")
        be = CudaBackend()
        be.setup(resolve(cfg), build_family(name))
        kept, _ = kept_by_autograd(be, _fixed_batch(VOCAB, B, T))
        arch, s = planner.resolve(resolve(cfg), seq_len=T)
        _, _, d = planner.activations(arch, s)
        predicted = d["saved_layers"] + d["head"]
        tol = SAVED_TOL.get((name, keys), 0.03)
        assert predicted == pytest.approx(kept, rel=tol), (name, keys, predicted, kept, round(predicted / kept - 1, 4))


@pytest.mark.parametrize("model_type", ["olmo3", "gemma2"])
def test_local_global_layers_without_layer_types_follow_the_config_class(model_type):
    """A config.json without ``layer_types``: each layer's window as the family's config class
    builds it (Olmo3Config: every fourth layer global; Gemma2: every other, from the first)."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from finetune.model.describe import describe

    built = AutoConfig.for_model(model_type, num_hidden_layers=8, sliding_window=16).to_dict()
    want = [t == "sliding_attention" for t in built.pop("layer_types")]
    assert [b.sliding for b in describe(built, model_type).blocks] == want
