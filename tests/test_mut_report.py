"""finetune-report's chart and help as a user sees them. Written for survivors of the
mutation run (benchmarks/mutation/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from finetune.report import GIB, main, write_chart

BUDGET_RED = np.array([0xD6, 0x27, 0x28]) / 255  # the budget line's colour (#d62728)


def _job(name: str, peak_gib: float, budget_gib: float | None) -> dict:
    return {"job": name, "status": "ran", "weights_bytes": int(0.5 * GIB), "activations_bytes": int(0.3 * GIB),
            "peak_reserved_bytes": int(peak_gib * GIB), "budget_bytes": int(budget_gib * GIB) if budget_gib else None,
            "peak_rss_bytes": int(2 * GIB), "tokens_per_sec": 100.0}


def _widest_red_run(png: Path) -> int:
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]
    red = np.all(np.abs(img - BUDGET_RED) < 0.06, axis=-1)
    return int(red.sum(axis=1).max())


def test_chart_draws_the_sweeps_one_budget_as_a_line(tmp_path: Path) -> None:
    write_chart([_job("optim=adamw", 1.0, 2.0), _job("optim=sgd", 1.5, 2.0)], tmp_path / "one.png")
    write_chart([_job("optim=adamw", 1.0, 2.0), _job("optim=sgd", 1.5, 3.0)], tmp_path / "two.png")
    write_chart([_job("optim=adamw", 1.0, None), _job("optim=sgd", 1.5, None)], tmp_path / "none.png")
    # one budget shared by the jobs: a red line across the axes (880 px wide at 8 in x 110 dpi)
    assert _widest_red_run(tmp_path / "one.png") > 400
    # two budgets, or none: no line to draw
    assert _widest_red_run(tmp_path / "two.png") < 50
    assert _widest_red_run(tmp_path / "none.png") < 50


def test_help_opens_with_what_the_command_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "finetune-report DIR``: one run or a whole sweep side by side." in capsys.readouterr().out


# -- memory.png and the memory table of a finished run (finetune/accounting/render.py) --------
GiB_ = 1 << 30


def test_units_of_the_memory_charts() -> None:
    from finetune.accounting.render import unit_for

    assert unit_for(3 * GiB_) == (float(GiB_), "GiB")
    assert unit_for(5 << 20) == (float(1 << 20), "MiB")
    assert unit_for(1023 << 10) == (1024.0, "KiB")
    assert unit_for(100) == (1.0, "B")


def _drawn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, samples: list, budget: int | None):
    """memory.png's figure, caught as matplotlib saves it."""
    from matplotlib.figure import Figure

    from finetune.accounting.render import write_plot

    caught = []
    save = Figure.savefig

    def savefig(fig, *a, **kw):
        caught.append(fig)
        return save(fig, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    write_plot(samples, tmp_path / "memory.png", budget=budget)
    assert (tmp_path / "memory.png").stat().st_size > 0
    return caught[0]


def test_memory_png_draws_the_budget_at_its_height_and_labels_its_units(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    samples = [{"step": s, "phase": "optimizer", "allocated": GiB_ + s * (GiB_ // 4), "reserved": 2 * GiB_,
                "rss": 300 << 10} for s in range(4)]
    fig = _drawn(monkeypatch, tmp_path, samples, budget=3 * GiB_)
    ax, hax = fig.axes[0], fig.axes[1]
    budget = [ln for ln in ax.get_lines() if ln.get_label().startswith("memory budget")]
    assert [ln.get_label() for ln in budget] == ["memory budget 3.00 GiB"]
    assert list(budget[0].get_ydata()) == [3.0, 3.0]  # in GiB, the axis's unit
    assert ax.get_ylabel() == "allocator / device, GiB\n(GiB = 2^30 bytes)"
    assert hax.get_ylabel() == "host, KiB\n(KiB = 2^10 bytes)"


def test_the_memory_table_of_a_finished_run_has_a_row_per_device_and_overall() -> None:
    from finetune.accounting.render import render_summary_table

    mem = {"last": {"memory_step": 5, "memory_phase": "optimizer", "allocated_bytes": 2 * GiB_,
                    "reserved_bytes": 3 * GiB_, "device_used_bytes": 4 * GiB_, "rss_bytes": GiB_},
           "peaks": {"allocated_bytes": 5 * GiB_, "reserved_bytes": 6 * GiB_, "rss_bytes": 2 * GiB_},
           "devices": [{"index": 0, "allocated_bytes": 2 * GiB_, "reserved_bytes": 3 * GiB_,
                        "peak_allocated_bytes": 5 * GiB_, "peak_reserved_bytes": 6 * GiB_,
                        "device_used_bytes": 4 * GiB_, "device_total_bytes": 80 * GiB_}]}
    rows = {ln.split()[0]: ln.split() for ln in render_summary_table(mem).splitlines() if ln.strip()}
    assert rows["Device"][:14] == ["Device", "0", "2.00", "GiB", "3.00", "GiB", "5.00", "GiB", "6.00", "GiB",
                                   "4.00", "GiB", "80.0", "GiB"]
    assert rows["Overall"][:11] == ["Overall", "2.00", "GiB", "3.00", "GiB", "5.00", "GiB", "6.00", "GiB",
                                    "4.00", "GiB"]


# -- finetune-report's sentences and its write failures (finetune/report.py) -------------------
def _ran(job: str, tps: float, peak: int, budget: int | None, loss: float) -> dict:
    return {"job": job, "status": "ran", "tokens_per_sec": tps, "peak_reserved_bytes": peak, "budget_bytes": budget,
            "final_train_loss": loss, "peak_bytes": peak}


def test_the_winner_sentences_name_the_fastest_that_fits_and_the_leanest() -> None:
    from finetune.report import winners

    rs = [_ran("optim=adamw", 900.0, 3 * GiB_, 2 * GiB_, 1.50),  # fastest, but over its budget
          _ran("optim=sgd", 500.0, GiB_, 2 * GiB_, 1.505), _ran("optim=adafactor", 400.0, GiB_ + GiB_ // 2, 2 * GiB_, 1.5)]
    assert winners(rs)[:2] == [
        "fastest that fits the budget: optim=sgd (500 tokens/s, peak reserved 1.000 GiB of 2.000 GiB)",
        ("least memory at equal loss: optim=sgd (peak 1.000 GiB, train loss 1.5050; 3 of 3 jobs within noise of "
         "the best 1.5000)")]


def test_a_report_that_cannot_be_written_is_one_line_and_exit_2(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"backend": "cuda", "steps": 1}')
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main([str(run), "--out", str(blocked / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write ") and err.rstrip().endswith("; free space or choose another --out")
