"""Each backend's capabilities (its one list of methods, optimizers, precisions) against what
its runtime, its memory model, the config and conf/ accept: a choice added in one place and
forgotten in another fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import REPO, make_cfg, make_spec
import warm_cli

from finetune import planner
from finetune.backends import BACKENDS, capabilities
from finetune.resolver import check_backend_support
from finetune.errors import UserError

RUNTIME_NEEDS = {"cuda": "torch", "mlx": "mlx"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_choice_has_a_yaml_and_a_price(backend: str, tmp_path: Path) -> None:
    caps = capabilities(backend)
    for group, names in (("method", caps.methods), ("optim", caps.optimizers), ("precision", tuple(caps.precisions))):
        for name in names:
            assert (REPO / "conf" / group / f"{name}.yaml").is_file(), f"conf/{group}/{name}.yaml"
    # the planner prices every optimizer and precision the backend says it runs, with its memory model
    mm = planner.memory_model(backend)
    for optim in caps.optimizers:
        assert mm.optimizer_state_bytes(optim, (4096, 64), 4, on_gpu=False)[0] >= 0
        p = planner.plan(make_spec(tmp_path / "p", f"backend={backend}", f"optim={optim}", "method=full"), recommend=False)
        assert p["optim"] == optim and p["bytes"]["optimizer_state"] + p["bytes"]["optimizer_state_paged"] >= 0
    for prec in caps.precisions:
        p = planner.plan(make_spec(tmp_path / "p", f"backend={backend}", f"precision={prec}"), recommend=False)
        assert p["precision"] == prec
    with pytest.raises(UserError, match="not valid"):
        mm.optimizer_state_bytes("lion", (8,), 4, on_gpu=False)  # a miss raises, never falls through


@pytest.mark.parametrize("backend", BACKENDS)
def test_config_refuses_what_the_backend_does_not_run(backend: str, tmp_path: Path) -> None:
    caps = capabilities(backend)
    others = {o for b in BACKENDS for o in capabilities(b).optimizers} - set(caps.optimizers)
    for optim in sorted(others):
        with pytest.raises(UserError, match=f"optim={optim}.*{backend} supports: {', '.join(caps.optimizers)}"):
            check_backend_support(backend, make_cfg(tmp_path / "r", f"backend={backend}", f"optim={optim}"))
    for optim in caps.optimizers:
        check_backend_support(backend, make_cfg(tmp_path / "r", f"backend={backend}", f"optim={optim}"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_runtime_builds_every_optimizer_the_capabilities_list(backend: str, tmp_path: Path) -> None:
    if importlib.util.find_spec(RUNTIME_NEEDS[backend]) is None:
        pytest.skip(f"{RUNTIME_NEEDS[backend]} not installed")
    runtime = importlib.import_module(f"finetune.backends.{backend}.runtime")
    # where the runtime's optimizers are built: the cuda runtime's own module for them
    builders = importlib.import_module("finetune.backends.cuda.optimizers") if backend == "cuda" else runtime
    caps = capabilities(backend)
    assert set(builders.OPTIMIZER_BUILDERS) == set(caps.optimizers)  # both ways: no builder without a name
    cfg = make_cfg(tmp_path / "r", f"backend={backend}")
    for optim in caps.optimizers:
        cfg.optim.name = optim
        if backend == "cuda":
            import torch

            param = torch.nn.Parameter(torch.zeros(4096, 2))
            opt = builders.build_optimizer(cfg.optim, [param])
            param.grad = torch.ones_like(param)
            opt.step()  # the optimizer really runs
        else:
            import mlx.core as mx

            be = runtime.MlxBackend()
            opt = be._make_optimizer(cfg.optim)
            params = {"w": mx.zeros((64, 8))}
            opt.update(params, {"w": mx.ones((64, 8))})
            mx.eval(params)
    cfg.optim.name = "lion"
    with pytest.raises(UserError, match="optim=lion is not supported"):
        builders.build_optimizer(cfg.optim, []) if backend == "cuda" else runtime.MlxBackend()._make_optimizer(cfg.optim)


def test_no_top_level_backends_package_outside_the_checkout(tmp_path: Path) -> None:
    r = warm_cli.run([sys.executable, "-c", "import finetune.backends as b, sys; print(b.__name__); import backends"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.stdout.strip() == "finetune.backends"
    assert r.returncode != 0 and "No module named 'backends'" in r.stderr
