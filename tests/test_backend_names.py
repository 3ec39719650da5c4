"""``finetune/`` never branches on a backend's name (ARCHITECTURE.md, Rooms): what differs
between backends is asked of ``Capabilities``, the memory model or the ``Backend`` itself.

The checker reads the code, not its comments or docstrings: a string literal that is a backend
name ("mlx", "cuda", "metal", "mps") compared with something, tested in a branch or used as a
dispatch key, and an identifier with such a name in it (``MLX_MIN_CACHE_LIMIT``,
``_generate_cuda``). The few places that must name a backend are listed in ALLOWED, each with
its reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("mlx", "cuda", "metal", "mps")
_TOKEN = re.compile(r"(?:^|_)(" + "|".join(NAMES) + r")(?:_|$)", re.IGNORECASE)

# (file under finetune/, the name or literal): why it may name a backend
ALLOWED: dict[tuple[str, str], str] = {
    ("export/conversion.py", "mlx"): "mlx-lm's adapter format, a file format export converts to and from without a "
                                     "backend",
    ("export/merging.py", "mlx"): "the mlx-lm merge engine, chosen by its own --engine name",
    ("export/adapters.py", "_read_mlx"): "reads mlx-lm's adapter format (a file format, not the backend)",
    ("export/conversion.py", "write_mlx"): "writes mlx-lm's adapter format (a file format, not the backend)",
    ("export/merging.py", "_merge_mlx"): "the mlx-lm merge engine export picks where torch is absent (its own --engine)",
    ("export/merging.py", "mlx_model_config"): "mlx-lm's config keys for that merge engine",
    ("export/adapters.py", "MLX_CONFIG"): "mlx-lm's adapter_config.json file name (a file format)",
    ("export/basemodel.py", "MLX_CONFIG"): "adapter_config.json, the file name the adapter names its base in",
    ("export/conversion.py", "MLX_CONFIG"): "adapter_config.json, the file name export defines for both formats",
    ("export/adapters.py", "MLX_WEIGHTS"): "mlx-lm's adapters.safetensors file name (a file format)",
    ("export/conversion.py", "MLX_WEIGHTS"): "mlx-lm's adapters.safetensors file name (a file format)",
    ("export/adapters.py", "MLX_TEXT_PREFIX"): "the name under which an mlx-lm adapter of a multimodal base names its "
                                               "modules (mlx-lm's wrapper's language_model.: a file format)",
    ("export/conversion.py", "MLX_TEXT_PREFIX"): "the same prefix, written into an mlx-lm adapter of a multimodal base",
    ("export/gguf_file.py", "MLX_CONFIG"): "adapter_config.json, the file name export defines for both formats",
    ("export/gguf_file.py", "MLX_WEIGHTS"): "mlx-lm's adapters.safetensors file name (a file format)",
    ("export/gguf_file.py", "mlx_convert"): "mlx-lm's convert, the only reader that dequantizes an MLX-quantized "
                                            "checkpoint (a file format GGUF export takes in)",
    ("generate.py", "MLX_CONFIG"): "adapter_config.json, the file name export defines for both formats",
    ("accounting/accountant.py", "cuda_context"): "the samples' cuda_context bytes, a field of the metrics schema",
    ("records.py", "cuda_context"): "a field of the Sample record, named as metrics.jsonl has always named it",
    ("records.py", "mlx_active"): "a field of the Sample record, named as metrics.jsonl has always named it",
    ("records.py", "mlx_cache"): "a field of the Sample record, named as metrics.jsonl has always named it",
    ("records.py", "mlx_peak"): "a field of the Sample record, named as metrics.jsonl has always named it",
    ("records.py", "mlx_memory_limit"): "a field of the Sample record, named as metrics.jsonl has always named it",
    ("records.py", "mlx_cache_limit"): "a field of the Sample record, named as metrics.jsonl has always named it",
    ("records.py", "mlx_wired_limit"): "a field of the Sample record, named as metrics.jsonl has always named it",
    ("records.py", "mlx_recommended_working_set"): "a field of the Sample record, named as metrics.jsonl has always named it",
    ("planner/__init__.py", "CUDA_CONTEXT_BYTES"): "a re-export of the cuda memory model's constant by its old name",
    ("planner/__init__.py", "mlx_quant_bytes"): "a re-export of the mlx memory model's function by its old name",
    ("budget.py", "cuda_devices"): "the NVML device count the memory models ask for (a device probe)",
    ("accounting/probes.py", "cuda_index"): "NVML's handle for a device as CUDA numbers it (a device probe)",
    ("report.py", "cuda"): "the sweep chart's title wording ('cuda backend on GPU'), a label, not behaviour",
    ("records.py", "metal"): "plan.json's key for the peak against Metal's working set, a field of the Plan record "
                             "that the mlx memory model fills (its device_checks)",
}


def offences(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, name) of each backend name ``source`` branches on or carries in an identifier."""
    tree = ast.parse(source, filename)
    found: list[tuple[int, str]] = []

    def literal(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in NAMES:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [v for e in node.elts for v in literal(e)]
        return []

    def ident(name: str | None, line: int) -> None:
        if name and _TOKEN.search(name):
            found.append((line, name))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                found += [(node.lineno, v) for v in literal(side)]
        elif isinstance(node, (ast.If, ast.IfExp, ast.While)):
            found += [(node.lineno, v) for v in literal(node.test)]
        elif isinstance(node, ast.Dict):
            found += [(node.lineno, v) for k in node.keys if k is not None for v in literal(k)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, v) for v in literal(node.value)]
        elif isinstance(node, ast.Name):
            ident(node.id, node.lineno)
        elif isinstance(node, ast.Attribute):
            ident(node.attr, node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            ident(node.name, node.lineno)
        elif isinstance(node, ast.arg):
            ident(node.arg, node.lineno)
        elif isinstance(node, ast.alias):
            ident(node.asname or node.name.rsplit(".", 1)[-1], getattr(node, "lineno", 0))
        elif isinstance(node, ast.keyword):
            ident(node.arg, node.value.lineno)
    return sorted(set(found))


def scan(root: Path, allowed: dict[tuple[str, str], str]) -> list[str]:
    """``file:line: name`` for every offence under ``root`` that ``allowed`` does not list."""
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        for line, name in offences(f.read_text(), str(f)):
            if (rel, name) not in allowed and (rel, name.lower()) not in allowed:
                out.append(f"finetune/{rel}:{line}: {name}")
    return out


def test_finetune_never_branches_on_a_backend_name() -> None:
    bad = scan(ROOT / "finetune", ALLOWED)
    assert not bad, "finetune/ branches on a backend's name (ask Capabilities or the Backend):\n" + "\n".join(bad)


def test_every_allowance_is_still_needed() -> None:
    used = set()
    for (rel, name) in ALLOWED:
        path = ROOT / "finetune" / rel
        if any(n.lower() == name.lower() for _, n in offences(path.read_text(), str(path))):
            used.add((rel, name))
    assert set(ALLOWED) == used, f"allowances nothing needs any more: {sorted(set(ALLOWED) - used)}"


def test_the_checker_catches_a_planted_branch(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "planted.py").write_text(
        '"""Docstrings may say mlx and cuda."""\n'
        "# so may comments: if backend == 'mlx'\n"
        "MLX_MIN_CACHE_LIMIT = 32 << 20\n"
        "def pad(backend, device):\n"
        "    if backend == 'mlx':\n"
        "        return 32\n"
        "    x = 1 if device in ('cuda', 'cpu') else 2\n"
        "    table = {'metal': 1}\n"
        "    label = 'cuda'  # a plain string names nothing it branches on\n"
        "    return x + table[backend]\n")
    bad = scan(pkg, {})
    assert bad == ["finetune/planted.py:3: MLX_MIN_CACHE_LIMIT", "finetune/planted.py:5: mlx",
                   "finetune/planted.py:7: cuda", "finetune/planted.py:8: metal"]
    assert scan(pkg, {("planted.py", "mlx"): "r", ("planted.py", "cuda"): "r", ("planted.py", "metal"): "r",
                      ("planted.py", "MLX_MIN_CACHE_LIMIT"): "r"}) == []
