"""mode=plan's "what do I need" (planner.fit ``_needs``) on released configs (conf/model presets):
the fewest levers that fit N devices of a size, with the host RAM, or what would fit."""

from __future__ import annotations

import pytest

from conftest import make_spec
from finetune import planner

GIB = 1 << 30


def _replanned(tmp_path, base: tuple[str, ...], change: str) -> dict:
    """The plan of the run with the needs' overrides typed in, as a user would."""
    return planner.plan(make_spec(tmp_path, *base, *change.split()), recommend=False)


@pytest.mark.parametrize("model,devices,gib", [("llama2-70b", 2, 24), ("llama3.1-405b", 8, 80)])
def test_needs_finds_the_levers_that_fit_released_models_with_their_host_ram(model, devices, gib, tmp_path):
    """QLoRA of Llama-2-70B on 2 x 24 GiB and of Llama-3.1-405B on 8 x 80 GiB: as configured
    (ddp, every rank a whole 4-bit replica) nothing fits, not even micro-batch 1 with
    checkpointing; the needs name overrides that, typed in, plan under the budget on every
    device, with the host memory the replanned run holds."""
    base = ("mode=plan", f"model={model}", "method=qlora", "backend=cuda", f"backend.num_devices={devices}",
            f"memory.budget={gib}GiB")
    from finetune.run.state import RunState

    spec = make_spec(tmp_path, *base)
    p = planner.plan(spec, recommend=False, needs=True)
    smallest = planner.plan(spec, recommend=False, state=RunState("cuda", 1, 4, True))
    assert p["fits"] is False and smallest["fits_bytes"] > gib * GIB
    need = p["needs"]
    assert need["fits"] and need["devices"] == devices and need["levers"]
    assert need["peak_bytes"] <= gib * GIB
    again = _replanned(tmp_path, base, need["change"])
    assert again["fits_bytes"] == need["peak_bytes"]
    assert all(max(ph["device_bytes"] for ph in dv["phases"].values()) <= gib * GIB for dv in again["per_device"])
    assert again["batch_size"] * again["grad_accum"] * again["world_size"] == 4 * devices  # the samples of a step kept
    anon = max(ph["host_bytes"] - ph.get("host_file_bytes", 0) for ph in again["phases"].values())
    assert need["host_bytes"] == anon > 0
    assert "host RAM" in planner.format_table(p)


def test_needs_says_what_would_fit_when_nothing_does(tmp_path):
    """Llama-2-70B QLoRA on one 24 GiB device: no lever fits it there; the needs say the budget
    every lever together needs, and the fewest such devices the layers fit over."""
    base = ("mode=plan", "model=llama2-70b", "method=qlora", "backend=cuda", "backend.num_devices=1",
            "memory.budget=24GiB")
    need = planner.plan(make_spec(tmp_path, *base), recommend=False, needs=True)["needs"]
    assert need["fits"] is False and need["every_lever_peak_bytes"] > 24 * GIB
    assert any("backend.num_devices=2 " in w for w in need["would_fit"]), need
