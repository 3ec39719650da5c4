"""Range bounds as a user meets them: the value on each edge of a range is accepted or refused
as documented, independently of the RANGES table (tests/test_bad_input.py derives its
out-of-range values from that table, so a wrong bound there moves the test with it).
Written for survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from finetune.config import compose
from finetune.resolver import check_ranges
from finetune.errors import UserError

# counts that must be at least 1: 1 is accepted, 0 refused
AT_LEAST_ONE = ["backend.num_devices", "model.config.hidden_size", "model.config.num_hidden_layers",
                "model.config.num_attention_heads", "model.config.num_key_value_heads", "model.config.head_dim",
                "model.config.intermediate_size", "model.config.vocab_size", "model.config.max_position_embeddings",
                "method.lora.rank", "method.quant_group_size", "data.num_samples",
                "data.max_samples", "train.steps", "train.batch_size", "train.grad_accum",
                "train.keep_checkpoints", "memory.phase_every", "generate.max_new_tokens"]
# (key, value, accepted?) on the other edges: inclusive edges accepted, exclusive ones refused
EDGES = [(k, 1, True) for k in AT_LEAST_ONE] + [(k, 0, False) for k in AT_LEAST_ONE] + [
    ("train.seed", 2**32 - 1, True),  # seeds are 32-bit
    ("train.seed", 2**32, False),
    ("train.seed", 0, True),
    ("train.seed", -1, False),
    ("model.config.rms_norm_eps", 1.0, False),  # (0, 1): both ends open
    ("model.config.rms_norm_eps", 0.0, False),
    ("model.config.rope_theta", 0.0, False),  # > 0
    ("method.lora.alpha", 0.0, False),  # > 0
    ("method.lora.dropout", 0.0, True),  # [0, 1)
    ("method.lora.dropout", 1.0, False),
    ("method.quant_bits", 2, True),  # [2, 8]
    ("method.quant_bits", 8, True),
    ("method.quant_bits", 1, False),
    ("method.quant_bits", 9, False),
    ("optim.lr", 0.0, False),  # > 0
    ("optim.weight_decay", 0.0, True),  # >= 0
    ("optim.eps", 1.0, False),  # (0, 1)
    ("optim.eps", 0.0, False),
    ("optim.momentum", 0.0, True),  # [0, 1)
    ("optim.momentum", 1.0, False),
    ("optim.max_grad_norm", 0.0, False),  # > 0 or null
    ("optim.betas", [0.0, 0.999], True),  # [0, 1) each
    ("optim.betas", [0.9, 1.0], False),
    ("optim.betas", [1.0, 0.999], False),
    ("data.val_fraction", 0.0, True),  # [0, 1)
    ("data.val_fraction", 1.0, False),
    ("data.max_val_samples", 0, True),  # >= 0
    ("train.seq_len", 8, True),  # >= 8
    ("train.seq_len", 7, False),
    ("train.loss_chunk", 0, True),  # 0: off
    ("train.warmup_steps", 0, True),
    ("train.eval_every", 0, True),
    ("train.eval_batches", 0, True),
    ("train.save_every", 0, True),
    ("train.pad_multiple", 0, True),
    ("memory.sample_every", 0, True),
    ("generate.temperature", 0.0, True),  # 0: greedy
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return compose(tmp_path_factory.mktemp("edges") / "run", "backend=cuda")


@pytest.mark.parametrize(("key", "value", "accepted"), EDGES, ids=[f"{k}={v}" for k, v, _ in EDGES])
def test_range_edges(base: Any, key: str, value: Any, accepted: bool) -> None:
    cfg = copy.deepcopy(base)
    OmegaConf.update(cfg, key, value)
    if accepted:
        check_ranges(cfg)
    else:
        with pytest.raises(UserError, match=key.replace(".", r"\.")):
            check_ranges(cfg)


def test_an_override_on_the_edge_reaches_the_check(tmp_path: Path) -> None:
    """The path a user takes: the command-line override, composed, then checked."""
    check_ranges(compose(tmp_path / "a", "backend=cuda", "train.seed=4294967295"))
    with pytest.raises(UserError, match=r"train\.seed=4294967296 must be in \[0, 4294967295\]"):
        check_ranges(compose(tmp_path / "b", "backend=cuda", "train.seed=4294967296"))


@pytest.mark.parametrize("betas", [[0.9], [0.9, 0.99, 0.999]])
def test_betas_need_exactly_two(base: Any, betas: list[float]) -> None:
    cfg = copy.deepcopy(base)
    OmegaConf.update(cfg, "optim.betas", betas)
    with pytest.raises(UserError, match=r"optim\.betas=.* needs two values; set optim\.betas=\[0\.9,0\.999\]"):
        check_ranges(cfg)


def test_each_data_source_names_what_it_lacks(tmp_path: Path) -> None:
    from finetune.resolver import validate

    with pytest.raises(UserError, match=r"^data=hf needs a data set: add data.hf_name=<hub id>$"):
        validate(compose(tmp_path / "a", "data=hf"))
    with pytest.raises(UserError, match=r"^data=jsonl needs a file: add data.path=/path/to/train.jsonl$"):
        validate(compose(tmp_path / "b", "data=jsonl"))
    validate(compose(tmp_path / "c", "data=hf", "data.hf_name=openai/gsm8k"))
