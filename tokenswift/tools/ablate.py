"""Ablation sweeps: run a grid of spec variants on one loaded model, same prompt and seeds.

A grid (TOML) names a base spec and either axes, whose Cartesian product gives the
cells, or an explicit list of cells. An axis key is a spec section (``"penalty"``,
value: a table) or a dotted option (``"retriever.top_k"``, value: a number, string or
list). Every cell is validated before anything runs; finished cells are skipped when a
sweep is run again (resume); speedups are measured against ``ar`` runs with the same
penalty and sampling, made in the same sweep.

```toml
base = "tokenswift"
model = { path = "smollm2", dtype = "bfloat16" }
prompt_tokens = 2048
new_tokens = 1024
seeds = [0]

[axes]
"retriever.top_k" = [0, 20]
penalty = [{ name = "none" }, { name = "contextual", value = 1.2, window = 1024 }]
```
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from tokenswift.errors import SpecError
from tokenswift.spec import COMPONENT_KINDS, PipelineSpec, load_toml, merge_overrides

logger = logging.getLogger(__name__)

METRICS = [
    "tokens_per_second", "speedup_vs_ar", "tokens_per_step", "acceptance_rate", "retriever_share",
    "verified_per_step", "candidates_per_step", "predicted_tokens_per_step",
    "distinct_1", "distinct_2", "distinct_3", "distinct_4", "peak_rss_mib", "new_tokens", "seconds",
]
SECTIONS = (*COMPONENT_KINDS, "sampling", "speculation")
AR_PREFIX = "ar: "  # labels of the reference runs


@attrs.frozen(kw_only=True)
class Grid:
    base: Any  # preset name or spec dict
    model: dict[str, Any] | None
    prompt_tokens: int
    new_tokens: int
    seeds: tuple[int, ...]
    cells: tuple[dict[str, Any], ...]  # each: overrides on top of base (a spec-shaped dict)
    labels: tuple[str, ...]  # each cell's axis settings, for tables

    @classmethod
    def load(cls, path: str | Path) -> Grid:
        return cls.from_dict(load_toml(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Grid:
        valid = {"base", "model", "prompt_tokens", "new_tokens", "seeds", "axes", "cells"}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise SpecError(f"grid has unknown key(s) {unknown}; valid: {sorted(valid)}")
        if ("axes" in data) == ("cells" in data):
            raise SpecError("a grid needs exactly one of [axes] (a Cartesian product) or [[cells]] (an explicit list)")
        if "axes" in data:
            axes = data["axes"]
            if not isinstance(axes, Mapping) or not axes or not all(isinstance(v, list) and v for v in axes.values()):
                raise SpecError("[axes] must map each key to a non-empty list of values")
            settings = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]
        else:
            settings = [dict(cell) for cell in data["cells"]]
        cells = tuple(_overrides(setting) for setting in settings)
        labels = tuple(", ".join(f"{k}={_short(v)}" for k, v in setting.items()) for setting in settings)
        return cls(
            base=data.get("base", "tokenswift"),
            model=data.get("model"),
            prompt_tokens=int(data.get("prompt_tokens", 2048)),
            new_tokens=int(data.get("new_tokens", 1024)),
            seeds=tuple(int(s) for s in data.get("seeds", [0])),
            cells=cells,
            labels=labels,
        )


def _short(value) -> str:
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{v}" for k, v in value.items()) + "}"
    return str(value)


def _overrides(setting: Mapping[str, Any]) -> dict[str, Any]:
    """Axis settings -> a spec-shaped overrides dict."""
    out: dict[str, Any] = {}
    for key, value in setting.items():
        section, _, option = key.partition(".")
        if section not in SECTIONS:
            raise SpecError(f"grid axis {key!r}: {section!r} is not a spec section; valid: {list(SECTIONS)}")
        if option:
            out.setdefault(section, {})[option] = value
        else:
            out[section] = value
    return out


def cell_specs(grid: Grid, registry) -> list[dict[str, Any]]:
    """Every cell's full spec dict; raises SpecError naming every invalid cell."""
    base = {"preset": grid.base} if isinstance(grid.base, str) else dict(grid.base)
    specs, problems = [], []
    for label, cell in zip(grid.labels, grid.cells):
        try:
            spec = PipelineSpec.from_dict(merge_overrides(base, cell), registry.presets)
            for kind in COMPONENT_KINDS:
                registry.make_options(kind, spec.component(kind))
            specs.append(spec.to_dict())
        except SpecError as exc:
            problems.append(f"[{label}] {exc}")
    if problems:
        raise SpecError(f"{len(problems)} invalid cell(s): " + "; ".join(problems))
    return specs


def _cell_id(spec: Mapping[str, Any], seed: int, grid: Grid) -> str:
    key = json.dumps([spec, seed, grid.prompt_tokens, grid.new_tokens], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _ar_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {"preset": "ar", "penalty": spec["penalty"], "sampling": spec["sampling"]}


def run_ablation(
    grid: Grid,
    out_dir: str | Path,
    *,
    model=None,
    tokenizer=None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every cell (and its ``ar`` reference) and write ``ablation.csv``; returns the rows."""
    from tokenswift import Pipeline, hookimpl
    from tokenswift.memory import peak_rss_mib, reset_peak_rss
    from tokenswift.tools.bench import distinct_n
    from tokenswift.model.loading import load_model
    from tokenswift.prompts import prompt_ids
    from tokenswift.registry import build_registry, get_plugin_manager
    from tokenswift.spec import ModelSpec

    registry = build_registry(get_plugin_manager())
    specs = cell_specs(grid, registry)  # everything is validated before the model loads
    if model is None:
        if grid.model is None:
            raise SpecError("the grid needs a [model] table (path, dtype)")
        model, tokenizer = load_model(ModelSpec.from_value(grid.model))
    prompt = prompt_ids(tokenizer, grid.prompt_tokens)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "ablation.csv"
    rows = _read_rows(csv_path)
    done = {row["cell_id"] for row in rows}
    curves_path = out_dir / "curves.json"
    curves = json.loads(curves_path.read_text()) if curves_path.exists() else {}

    jobs = []
    for label, spec in zip(grid.labels, specs):
        for seed in grid.seeds:
            jobs.append((f"{AR_PREFIX}penalty={_short(spec['penalty'])}; sampling={_short(spec['sampling'])}", _ar_spec(spec), seed))
            jobs.append((label, spec, seed))
    for label, spec, seed in jobs:
        cell_id = _cell_id(spec, seed, grid)
        if cell_id in done:
            if progress:
                progress(f"skip {label} (done)")
            continue
        if progress:
            progress(label)
        pipe = Pipeline.from_spec(spec, model, tokenizer)
        curve: list[tuple[int, float]] = []
        accepted = depth = 0

        class Curve:
            @hookimpl
            def tokenswift_step_end(self, pipeline, step):
                nonlocal accepted, depth
                accepted += step.accepted
                depth += step.depth
                curve.append((step.generated, accepted / depth if depth else 0.0))

        pipe.plugin_manager.register(Curve())
        reset_peak_rss()
        started = time.perf_counter()
        result = pipe.generate(prompt, grid.new_tokens, seed=seed, ignore_eos=True)
        seconds = time.perf_counter() - started
        stats = result.stats
        row = {
            "cell_id": cell_id, "label": label, "seed": seed,
            **{k: json.dumps(spec.get(k)) for k in SECTIONS},
            "tokens_per_second": round(result.stats.new_tokens / seconds, 3),
            "speedup_vs_ar": "",
            "tokens_per_step": round(stats.tokens_per_step, 3),
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "retriever_share": round(stats.retriever_share, 4),
            "verified_per_step": stats.decisions()["verified_per_step"],
            "candidates_per_step": stats.decisions()["candidates_per_step"],
            "predicted_tokens_per_step": stats.decisions()["predicted_tokens_per_step"] or "",
            **{f"distinct_{n}": round(distinct_n(result.tokens, n), 4) for n in (1, 2, 3, 4)},
            "peak_rss_mib": round(peak_rss_mib(), 1),
            "new_tokens": stats.new_tokens,
            "seconds": round(seconds, 2),
        }
        rows.append(row)
        done.add(cell_id)
        step = max(1, len(curve) // 64)
        curves[cell_id] = curve[step - 1 :: step]
        _write_rows(csv_path, _with_speedups(rows))  # after every cell: an interrupted sweep resumes
        curves_path.write_text(json.dumps(curves))
    rows = _with_speedups(rows)
    _write_rows(csv_path, rows)
    return rows


def _with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ar = {(r["penalty"], r["sampling"], str(r["seed"])): float(r["tokens_per_second"]) for r in rows if r["label"].startswith(AR_PREFIX)}
    out = []
    for r in rows:
        base = ar.get((r["penalty"], r["sampling"], str(r["seed"])))
        out.append({**r, "speedup_vs_ar": round(float(r["tokens_per_second"]) / base, 3) if base else ""})
    return out


def _columns() -> list[str]:
    return ["cell_id", "label", "seed", *SECTIONS, *METRICS]


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_columns())
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def write_reports(rows: list[dict[str, Any]], out_dir: str | Path) -> dict[str, Path]:
    """ablation.md and the plots acceptance.png, speedup.png, distinct.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    paths = {
        "markdown": out_dir / "ablation.md",
        "acceptance": out_dir / "acceptance.png",
        "speedup": out_dir / "speedup.png",
        "distinct": out_dir / "distinct.png",
    }
    cols = ["label", "seed", "tokens_per_second", "speedup_vs_ar", "tokens_per_step", "acceptance_rate",
            "retriever_share", "verified_per_step", "predicted_tokens_per_step", "distinct_1", "distinct_2", "distinct_3",
            "distinct_4", "peak_rss_mib"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    paths["markdown"].write_text("\n".join(lines) + "\n")
    curves = json.loads((out_dir / "curves.json").read_text()) if (out_dir / "curves.json").exists() else {}
    cells = [r for r in rows if not r["label"].startswith(AR_PREFIX)]

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in cells:
        points = curves.get(r["cell_id"]) or []
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=f"{r['label']} (seed {r['seed']})")
    ax.set(xlabel="generated tokens", ylabel="acceptance rate (cumulative)", title="acceptance vs length")
    ax.grid(alpha=0.3)
    if cells:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["acceptance"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [f"{r['label']} s{r['seed']}" for r in cells]
    ax.barh(names, [float(r["speedup_vs_ar"] or 0) for r in cells])
    ax.axvline(1.0, color="grey", lw=1)
    ax.set(xlabel="speedup over ar (same sweep)", title="speedup per cell")
    fig.tight_layout()
    fig.savefig(paths["speedup"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    by_penalty: dict[str, list[dict]] = {}
    for r in cells:
        by_penalty.setdefault(r["penalty"], []).append(r)
    width = 0.8 / max(1, len(by_penalty))
    for i, (penalty, group) in enumerate(sorted(by_penalty.items())):
        means = [sum(float(g[f"distinct_{n}"]) for g in group) / len(group) for n in (1, 2, 3, 4)]
        ax.bar([n + i * width for n in range(4)], means, width, label=_short(json.loads(penalty)))
    ax.set_xticks([n + 0.4 - width / 2 for n in range(4)], ["distinct-1", "distinct-2", "distinct-3", "distinct-4"])
    ax.set(ylabel="distinct-n (mean over cells)", title="diversity per penalty setting")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["distinct"], dpi=110)
    plt.close(fig)
    return paths
