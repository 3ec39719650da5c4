"""What train.overwrite=true removes and what a refusal names, on a run dir laid out by hand.
Written for survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

from pathlib import Path

from finetune.run.files import clear_results, results_in


def _run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    (d / "adapter").mkdir(parents=True)
    (d / "adapter" / "adapters.safetensors").write_bytes(b"x")
    (d / "summary.json").write_text("{}")
    (d / "metrics.jsonl").write_text("{}\n")
    return d


def test_results_name_the_summary_and_the_adapter_directory(tmp_path):
    assert results_in(_run_dir(tmp_path)) == ["summary.json", "adapter/"]
    assert results_in(tmp_path / "empty") == []


def test_overwrite_clears_the_results_of_a_run_that_saved_no_checkpoint(tmp_path):
    d = _run_dir(tmp_path)
    clear_results(d)  # no checkpoints/ here: nothing to remove there, and no error
    assert sorted(p.name for p in d.iterdir()) == ["metrics.jsonl"]
    assert results_in(d) == []
