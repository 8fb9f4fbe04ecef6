"""A tiny-model sweep: CSV columns, resume, plots, and invalid cells reported up front."""

import csv

import pytest

from tokenswift.tools.ablate import Grid, run_ablation, write_reports
from tokenswift.cli import main
from tokenswift.errors import SpecError
from tokenswift.testing import looping_model, word_tokenizer

GRID = {
    "base": "tokenswift",
    "prompt_tokens": 8,
    "new_tokens": 12,
    "seeds": [0],
    "axes": {
        "retriever.top_k": [0, 5],
        "penalty": [{"name": "none"}, {"name": "contextual", "value": 1.2, "window": 8}],
    },
}


def sweep(tmp_path, grid=GRID, calls=None):
    labels = []
    rows = run_ablation(
        Grid.from_dict({**grid, "base": {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 64, "sink": 2}}}),
        tmp_path,
        model=looping_model(dtype="float32"),
        tokenizer=word_tokenizer(),
        progress=labels.append,
    )
    return rows, labels


def test_sweep_writes_csv_resumes_and_plots(tmp_path):
    rows, labels = sweep(tmp_path)
    with (tmp_path / "ablation.csv").open() as f:
        reader = csv.DictReader(f)
        columns = reader.fieldnames
        written = list(reader)
    for column in ("drafter", "retriever", "cache", "verifier", "penalty", "sampling", "tokens_per_second",
                   "speedup_vs_ar", "tokens_per_step", "acceptance_rate", "retriever_share",
                   "distinct_1", "distinct_4", "peak_rss_mib"):
        assert column in columns
    cells = [r for r in written if not r["label"].startswith("ar: ")]
    assert len(cells) == 4 and len(written) == 6  # 2 x 2 cells + one ar run per penalty setting
    assert all(float(r["speedup_vs_ar"]) > 0 for r in cells)
    assert {r["label"] for r in cells} == {
        "retriever.top_k=0, penalty={name:none}",
        "retriever.top_k=5, penalty={name:none}",
        "retriever.top_k=0, penalty={name:contextual,value:1.2,window:8}",
        "retriever.top_k=5, penalty={name:contextual,value:1.2,window:8}",
    }
    # Resume: a second run finds every cell done and runs nothing.
    again, labels = sweep(tmp_path)
    assert all(label.startswith("skip ") for label in labels) and len(again) == 6
    paths = write_reports(again, tmp_path)
    for name in ("acceptance", "speedup", "distinct"):
        assert paths[name].read_bytes()[:4] == b"\x89PNG"
    assert "| retriever.top_k=5, penalty={name:none} |" in paths["markdown"].read_text()


def test_invalid_cells_are_reported_before_anything_runs(tmp_path):
    grid = {**GRID, "axes": {"drafter.name": ["tokenswift", "wizard"], "retriever.top_k": [-1, 5]}}
    with pytest.raises(SpecError, match=r"3 invalid cell\(s\): \[drafter.name=tokenswift, retriever.top_k=-1\] .*top_k must be an integer >= 0.*\[drafter.name=wizard, retriever.top_k=-1\]"):
        sweep(tmp_path, grid)
    assert not (tmp_path / "ablation.csv").exists()


def test_grid_errors(tmp_path, capsys):
    with pytest.raises(SpecError, match="exactly one of"):
        Grid.from_dict({"base": "ar"})
    with pytest.raises(SpecError, match="'sampler' is not a spec section"):
        Grid.from_dict({"axes": {"sampler.top_k": [1]}})
    path = tmp_path / "g.toml"
    path.write_text('base = "ar"\n[axes]\n"drafter.name" = ["nope"]\n[model]\ntiny = {model_type = "llama"}\n')
    assert main(["ablate", "--grid", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "1 invalid cell(s): [drafter.name=nope] unknown drafter 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["token_reuse", "penalty", "cache", "drafter", "tree", "sampler"])
def test_shipped_grids_are_valid(name):
    from pathlib import Path

    from tokenswift.tools.ablate import cell_specs
    from tokenswift.registry import build_registry, get_plugin_manager

    grid = Grid.load(Path(__file__).resolve().parent.parent / "benchmarks" / "grids" / f"{name}.toml")
    assert len(cell_specs(grid, build_registry(get_plugin_manager()))) == len(grid.cells) >= 2
