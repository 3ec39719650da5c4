"""mode=generate on mlx with an adapter whose effect on the tiny model is large: the printed
completion is mlx-lm's own generation from the base with that adapter loaded, not the base's.
The adapter is written by hand (no training). Written for survivors of the mutation run
(benchmarks/mutation/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_cfg

PROMPT = "Jo has 4 coins. How many coins does Jo have?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from finetune.model.source import resolve_model_dir

    return resolve_model_dir(make_cfg(tmp_path_factory.mktemp("unused")).model)


def _strong_mlx_adapter(d: Path, base: Path) -> Path:
    """Rank 4, scale 8, unit-normal A and B on both layers' q_proj and v_proj (mlx-lm's layout)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for layer in (0, 1):
        for rel, out in (("self_attn.q_proj", 64), ("self_attn.v_proj", 32)):
            tensors[f"model.layers.{layer}.{rel}.lora_a"] = rng.standard_normal((64, 4)).astype(np.float32)
            tensors[f"model.layers.{layer}.{rel}.lora_b"] = rng.standard_normal((4, out)).astype(np.float32)
    d.mkdir()
    save_file(tensors, str(d / "adapters.safetensors"), metadata={"format": "mlx"})
    (d / "adapter_config.json").write_text(json.dumps({
        "model": str(base), "fine_tune_type": "lora", "num_layers": 2,
        "lora_parameters": {"rank": 4, "scale": 8.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}))
    return d


def test_mlx_generation_is_mlx_lms_with_the_adapter_loaded_or_the_bases_without(tiny, tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    from finetune.cli import run
    from mlx_lm import stream_generate
    from mlx_lm.utils import load

    adapter = _strong_mlx_adapter(tmp_path / "adapter", tiny)

    def mlx_lm_says(adapter_path: Path | None) -> str:
        """mlx-lm's own greedy tokens, decoded as both backends decode (the tokenizer's
        ``decode``: mlx-lm's streaming detokenizer drops a first token's leading space)."""
        model, tok = load(str(tiny), adapter_path=str(adapter_path) if adapter_path else None)
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        out = [r.token for r in stream_generate(model, tok, ids, max_tokens=8)]
        return tok.decode([t for t in out if t not in tok.eos_token_ids], skip_special_tokens=True)

    want, base = mlx_lm_says(adapter), mlx_lm_says(None)
    assert want != base  # the adapter changes the greedy text
    out = run(make_cfg(tmp_path / "run", "mode=generate", "backend=mlx", f"generate.prompt={PROMPT}",
                       "generate.max_new_tokens=8", f"generate.adapter={adapter}"))
    assert out["completion"] == want and out["adapter_format"] == "mlx" and out["converted"] is False
    assert capsys.readouterr().out.endswith(want + "\n")
    plain = run(make_cfg(tmp_path / "plain", "mode=generate", "backend=mlx", f"generate.prompt={PROMPT}",
                         "generate.max_new_tokens=8"))  # no adapter: the base's own text
    assert (plain["completion"], plain["adapter"], plain["converted"]) == (base, None, False)
