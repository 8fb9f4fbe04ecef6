"""The benchmark runs every method on one model and writes JSON, markdown and a plot."""

import json

import pytest
import torch

from tokenswift.model.compiled import compiler_problem
from tokenswift.tools.bench import BenchConfig, PenaltyProcessor, distinct_n, run_bench, write_reports
from tokenswift.testing import word_tokenizer, looping_model


def test_bench_on_a_tiny_model(tmp_path):
    config = BenchConfig(prompt_tokens=16, new_tokens=40, greedy=True, heads="random", window=8)
    partial, counted = [], {}

    def progress(method, count):
        counted[method] = counted.get(method, 0) + count

    results, info = run_bench(
        config, progress, model=looping_model(dtype="float32"), tokenizer=word_tokenizer(),
        on_method=lambda so_far, _: partial.append([r.method for r in so_far]),
    )
    assert [len(p) for p in partial] == [1, 2, 3, 4, 5, 6, 7] and partial[-1] == [r.method for r in results]
    assert all(counted[r.method] == 40 for r in results), counted  # live progress, transformers' methods too
    by_method = {r.method: r for r in results}
    assert list(by_method) == ["hf-generate", "hf-prompt-lookup", "ar", "tokenswift", "medusa", "eagle", "prompt-lookup"]
    for r in results:
        assert r.error is None and r.new_tokens == 40 and r.tokens_per_second > 0 and r.speedup is not None
    # Greedy: every method emits exactly what ar emits (transformers' included, same windowed penalty).
    assert all(by_method[m].identical_to_ar == 1.0 for m in by_method)
    assert by_method["hf-generate"].speedup == 1.0
    paths = write_reports(results, info, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["config"]["new_tokens"] == 40 and len(data["results"]) == 7
    assert "| tokenswift |" in paths["markdown"].read_text()
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"


def test_distinct_n_and_the_baselines_windowed_penalty():
    assert distinct_n([1, 2, 1, 2, 3], 1) == 3 / 5 and distinct_n([1, 2, 1, 2], 2) == 2 / 3
    import torch

    from tokenswift import Pipeline
    from tokenswift.testing import tiny_model_for

    pipe = Pipeline.from_spec({"preset": "ar", "penalty": {"name": "contextual", "value": 2.0, "window": 2}}, tiny_model_for("llama-mha"))
    scores = torch.ones(1, 5)
    out = PenaltyProcessor(pipe.scorer)(torch.tensor([[0, 1, 2]]), scores.clone())
    assert out.tolist() == [[1.0, 0.5, 0.5, 1.0, 1.0]]  # only the last 2 tokens are penalised


def test_contexts_sweep_prefills_once_per_context_and_stays_lossless(tmp_path, monkeypatch):
    import torch

    from tokenswift.model.runner import Runner
    from tokenswift.testing import FIXED_TREE
    from tokenswift.tools.contexts import markdown, plot, run_contexts

    calls = []
    original = Runner.prefill_prompt
    monkeypatch.setattr(Runner, "prefill_prompt", lambda self, prompt, **kw: calls.append(len(prompt)) or original(self, prompt, **kw))
    model = looping_model(dtype="float32")
    text = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    reports = []
    report = run_contexts(
        model, None, lambda n: text[:n], contexts=[12, 30], new_tokens=10, presets=["tokenswift", "prompt-lookup"],
        decodings=["sampling", "greedy"], seeds=[0, 1], heads="random", overrides=FIXED_TREE, bandwidth=1e10,
        compiled_baseline=False, on_context=lambda r: reports.append(len(r["rows"])),
    )
    assert calls == [12, 30]  # one prefill per context, shared by 2 decodings x 3 presets x 2 seeds
    assert reports == [6, 12]
    rows = report["rows"]
    assert [(r["context"], r["decoding"], r["method"]) for r in rows[:3]] == [
        (12, "sampling", "ar"), (12, "sampling", "tokenswift"), (12, "sampling", "prompt-lookup")]
    assert all(r["same_tokens_as_ar"] for r in rows), rows  # same seed, same tokens: float32, every decoding
    assert all(r["ratio_to_ar"] == 1.0 for r in rows if r["method"] == "ar")
    drafted = [r for r in rows if r["method"] == "tokenswift" and r["decoding"] == "greedy"]
    assert all(r["tokens_per_step"] > 1.5 and r["drafting_passes_per_step"] == 1.0 for r in drafted)  # over the restored KV
    assert all(r["roofline_tokens_per_second"] > 0 for r in rows)
    assert "| 30 | greedy | tokenswift |" in markdown(report)
    plot(report, tmp_path / "contexts.png")
    assert (tmp_path / "contexts.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_started_from_a_shared_prefill_equals_a_fresh_run():
    from tokenswift import Pipeline
    from tokenswift.tools.bench import drafter_overrides

    model = looping_model(dtype="float32")
    prompt = [3, 9, 4, 1, 7, 7, 2, 5, 8]
    for preset in ("ar", "tokenswift", "eagle"):
        overrides = {"sampling": {"temperature": 0.9}, "drafter": drafter_overrides(preset, "random")}
        if not overrides["drafter"]:
            del overrides["drafter"]
        fresh = Pipeline.from_spec(preset, model, overrides=overrides)
        shared = Pipeline.from_spec(preset, model, overrides=overrides)
        expected = fresh.generate(prompt, 12, seed=4, ignore_eos=True).tokens
        prefilled = shared.runner.prefill_prompt(prompt, keep_hidden=max(1, shared.drafter.prompt_features))
        run = shared.start(prompt, 12, seed=4, ignore_eos=True)
        run.prefill(prefilled)
        for _ in run.steps():
            pass
        assert run.new_tokens == expected, preset


def test_auto_rope_covers_the_longest_run():
    from tokenswift.tools.contexts import auto_rope

    assert auto_rope(8192, 8192) is None
    assert auto_rope(8192, 16384) == {"type": "yarn", "factor": 2.0}
    assert auto_rope(8192, 16384 + 256 + 256) == {"type": "yarn", "factor": 2.5}


@pytest.mark.skipif(compiler_problem(torch.device("cpu")) is not None, reason="no C++ compiler for inductor")
def test_presets_are_also_reported_against_compiled_ar():
    from tokenswift.testing import FIXED_TREE
    from tokenswift.tools.contexts import markdown as contexts_markdown, run_contexts
    from tokenswift.tools.interleaved import compare_presets, markdown

    model = looping_model(dtype="float32")
    prompt = [3, 9, 4, 1, 7, 7, 2, 5, 8]
    report = compare_presets(model, None, ["tokenswift"], prompt, 12, seeds=[0], greedy=True, heads="random")
    summary = report["summary"]
    assert list(summary) == ["ar", "ar+compiled", "tokenswift"]  # the fastest plain decoding joins the turns
    speed = {name: row["tokens_per_second"] for name, row in summary.items()}
    assert summary["tokenswift"]["ratio_to_ar"] == pytest.approx(speed["tokenswift"] / speed["ar"], rel=2e-3, abs=1e-3)
    assert summary["tokenswift"]["ratio_to_ar_compiled"] == pytest.approx(
        speed["tokenswift"] / speed["ar+compiled"], rel=2e-3, abs=1e-3)
    assert summary["ar+compiled"]["ratio_to_ar"] == 1.0  # against ar with its own compile setting
    assert report["compile_seconds"] > 0 and "| vs ar compiled |" in markdown(report)
    both = compare_presets(model, None, ["tokenswift"], prompt, 8, seeds=[0], greedy=True, heads="random", compile="both")
    assert list(both["summary"]) == ["ar", "ar+compiled", "tokenswift", "tokenswift+compiled"]
    row = both["summary"]["tokenswift+compiled"]
    assert row["ratio_to_ar"] == row["ratio_to_ar_compiled"]  # same compile setting: ar+compiled

    sweep = run_contexts(model, None, lambda n: (prompt * 4)[:n], contexts=[16], new_tokens=8, presets=["tokenswift"],
                         decodings=["greedy"], seeds=[0], heads="random", overrides=FIXED_TREE, bandwidth=1e10)
    rows = {r["method"]: r for r in sweep["rows"]}
    assert list(rows) == ["ar", "ar+compiled", "tokenswift"] and rows["ar+compiled"]["same_tokens_as_ar"]
    assert rows["tokenswift"]["ratio_to_ar_compiled"] == pytest.approx(
        rows["tokenswift"]["tokens_per_second"] / rows["ar+compiled"]["tokens_per_second"], rel=2e-3, abs=1e-3)
    assert "| 16 | greedy | ar+compiled |" in contexts_markdown(sweep)


@pytest.mark.parametrize(("presets", "trees", "compiled"), [
    (["tokenswift"], True, None), (["ar"], False, None), (["eagle"], True, None), (["eagle"], True, True), (["ar"], False, True),
])
def test_contexts_sweep_compiles_tree_sizes_before_the_timed_turns(monkeypatch, presets, trees, compiled):
    """With the compiled baseline, or every method compiled (``bench --contexts --compile
    on``), the sweep compiles before any turn what a speculative preset's compiled run
    would compile mid-turn: its tree sizes."""
    import torch

    from tokenswift.testing import FIXED_TREE
    from tokenswift.tools import contexts

    asked = []
    monkeypatch.setattr(contexts, "compile_model_once", lambda model, tokenizer, trees=False: asked.append(trees) or 0.0)
    model = looping_model(dtype="float32")
    text = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    contexts.run_contexts(
        model, None, lambda n: text[:n], contexts=[12], new_tokens=4, presets=presets, decodings=["greedy"], seeds=[0],
        heads="random", overrides={**FIXED_TREE, **({"model": {"compile": True}} if compiled else {})}, bandwidth=1e10,
    )
    assert asked == [trees]


@pytest.mark.parametrize("preset, options", [("eagle", {"depth": 2, "width": 1}), ("medusa", {"tree": [2, 1]})])
def test_a_benchmarks_drafter_overrides_keep_the_callers_options(preset, options):
    """An ablation's drafter options (``variant_turns.py``: a fixed chain of depth 2) reach the
    drafter beside the options a benchmark adds (heads, weights); they were once replaced."""
    from tokenswift.tools.bench import preset_pipeline

    pipe = preset_pipeline(preset, looping_model(dtype="float32"), word_tokenizer(), heads="random",
                           overrides={"drafter": dict(options)})
    for name, value in options.items():
        assert getattr(pipe.drafter.options, name) == value
    added = "heads" if preset == "medusa" else "weights"  # what the benchmark adds beside them
    assert getattr(pipe.drafter.options, added) == "random"


def _variant_turns():
    """``benchmarks/variant_turns.py``: its path and the script loaded as a module."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "variant_turns.py"
    spec = importlib.util.spec_from_file_location("variant_turns", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return script, module


def test_variant_turns_takes_a_calibration_table_and_names_an_unknown_field():
    """``benchmarks/variant_turns.py``: a variant's ``calibration`` table (the fields its cost
    model prices with) is kept apart from its spec sections; a misspelt field is a clear
    error, before any model loads."""
    import subprocess
    import sys

    script, module = _variant_turns()
    assert module.parse_variant('warm=eagle:{"calibration": {"head_ms": 0.7}}') == (
        "warm", "eagle", {"calibration": {"head_ms": 0.7}})
    done = subprocess.run([sys.executable, str(script), "--variant", "ar=ar", "--variant",
                           'warm=eagle:{"calibration": {"hed_ms": 0.7}}'], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown calibration fields ['hed_ms']" in done.stderr and "head_ms" in done.stderr
    assert "Traceback" not in done.stderr


def test_variant_turns_reports_the_health_of_what_each_variant_wrote():
    """``benchmarks/variant_turns.py``'s table gives each variant's distinct-4 and recent
    self-NLL over its seeds beside its speed (speed on degenerate text is not speed a user
    gets), and "-" where a run measured none."""
    _, module = _variant_turns()
    row = {"preset": "ar", "overrides": {}, "tokens_per_second": 10.0, "ratio": 1.0, "tokens_per_step": 1.0,
           "speculated_steps": 0, "steps": 8, "passes_per_step": 0.0}
    report = {"machine": "cpu", "context": 16, "new_tokens": 8, "seeds": [0, 1], "greedy": True, "rows": [
        {**row, "variant": "ar", "health": [{"distinct_4": 1.0, "recent_self_nll": 2.0}, {"distinct_4": 0.5, "recent_self_nll": 3.0}]},
        {**row, "variant": "eagle", "health": [{"distinct_4": None, "recent_self_nll": None}]},
    ]}
    lines = module.table(report).splitlines()
    assert "distinct-4 | recent self-NLL |" in lines[2]
    assert lines[4].endswith("| 0.750 | 2.500 |") and lines[5].endswith("| - | - |")
