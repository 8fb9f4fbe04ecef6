"""Compiled one-token forwards (``[model] compile``): the same results as eager ones, on
every view; the same tokens in whole runs; a clear fallback where compiling fails.

Each tiny model compiles once per process (~15 s on a 2-core CPU without a warm
inductor cache), so these tests share the cached tiny models of ``tiny_model_for``.
"""

import json
import logging

import attrs

import pytest
import torch

from tokenswift import Pipeline, compile_costs, compiling
from tokenswift.compiling import CompileCalibration
from tokenswift.errors import SpecError
from tokenswift.model import compiled as compiled_module
from tokenswift.model.compiled import CompiledForward
from tokenswift.model.kv import CompactView, FullView, IndexView
from tokenswift.model.loading import tiny_model
from tokenswift.model.runner import Runner
from tokenswift.records import machine_key
from tokenswift.spec import ModelSpec
from tokenswift.testing import TINY_CONFIGS, assert_lossless, tiny_model_for

pytestmark = pytest.mark.skipif(
    compiled_module.compiler_problem(torch.device("cpu")) is not None, reason="no C++ compiler for inductor"
)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def one_token_forwards(runner: Runner, tokens: list[int], view_of=None, record=False):
    """Forward ``tokens`` one at a time after a prefill of PROMPT, committing each;
    ``view_of(runner)`` gives a drafting view for an extra forward before each commit.
    Returns (logits of every verify forward [n, vocab], extra outputs, the KV of the
    committed positions)."""
    runner.allocate(64)
    runner.prefill(torch.tensor(PROMPT))
    logits, extras = [], []
    for token in tokens:
        if view_of is not None:
            out = runner.forward(torch.tensor([token]), view=view_of(runner), record_attention=record)
            extras.append((out.logits, out.attention))
        logits.append(runner.forward(torch.tensor([token])).logits)
        runner.commit([0])
    length = runner.committed_length
    kv = [k[:, :, :length].clone() for k in runner.store.keys]
    return torch.cat(logits), extras, kv


def compare(name, dtype, view_of=None, record=False):
    model = tiny_model_for(name, dtype)
    results = {}
    for on in (False, True):
        runner = Runner(model)
        runner.use_compiled(on)
        results[on] = one_token_forwards(runner, [3, 1, 4, 1, 5, 9], view_of, record)
    # float64 too: the model's own code takes float32 detours (RMSNorm, the rotary
    # angles), which eager rounds and fused code need not.
    tolerance = {"float32": 1e-4, "float64": 1e-5}[dtype]
    eager, compiled = results[False], results[True]
    torch.testing.assert_close(compiled[0], eager[0], rtol=tolerance, atol=tolerance)
    for (eager_logits, eager_attention), (compiled_logits, compiled_attention) in zip(eager[1], compiled[1]):
        torch.testing.assert_close(compiled_logits, eager_logits, rtol=tolerance, atol=tolerance)
        if record:
            assert compiled_attention.keys() == eager_attention.keys()
            for layer in eager_attention:
                torch.testing.assert_close(compiled_attention[layer], eager_attention[layer], rtol=tolerance, atol=tolerance)
    for compiled_kv, eager_kv in zip(compiled[2], eager[2]):
        torch.testing.assert_close(compiled_kv, eager_kv, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "llama-mha"])
def test_compiled_one_token_forwards_equal_eager_ones(name):
    """Several models compiled in one process: each keeps its own graphs."""
    compare(name, "float32")


def test_compiled_forwards_over_drafting_views_equal_eager_ones():
    def compact(runner):
        view = CompactView(runner.store, capacity=8)
        view.load(runner.store, torch.tensor([0, 1, 2, runner.committed_length - 1]))
        return view

    compare("llama-gqa", "float32", view_of=lambda runner: FullView(runner.store))
    compare("llama-gqa", "float32", view_of=lambda runner: IndexView(torch.tensor([0, 2, runner.committed_length - 1])))
    compare("llama-gqa", "float32", view_of=compact, record=True)


def test_compiled_float64_forwards_equal_eager_ones():
    compare("llama-gqa", "float64")


@pytest.mark.parametrize("preset", ["ar", "tokenswift", "eagle"])
def test_compiled_runs_emit_what_eager_runs_emit(preset):
    """Same seed, float32: the same tokens with compile on and off; the stats say which."""
    model = tiny_model_for("llama-gqa", "float32")
    drafter = {"eagle": {"weights": "random"}, "tokenswift": {"heads": "random"}}.get(preset, {})
    results = {}
    for on in (False, True):
        overrides = {"model": {"compile": on}, **({"drafter": drafter} if drafter else {})}
        results[on] = Pipeline.from_spec(preset, model, overrides=overrides).generate([5, 6, 7, 8] * 4, 32, seed=3, ignore_eos=True)
    assert results[True].tokens == results[False].tokens
    assert results[True].stats.compiled and not results[False].stats.compiled


@pytest.mark.parametrize("preset", ["ar", "tokenswift"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_compiled_presets_are_lossless(preset, dtype):
    overrides = {"model": {"compile": True}, "sampling": {"temperature": 0.8, "top_p": 0.9}}
    if preset == "tokenswift":
        overrides["cache"] = {"name": "dynamic", "budget": 14, "sink": 2, "recent": 4}
    pipe = Pipeline.from_spec(preset, tiny_model_for("llama-gqa", dtype), overrides=overrides)
    result = assert_lossless(pipe, [5, 6, 7, 8] * 6, 40, seed=1)
    assert result.stats.compiled


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_runs_whose_one_token_steps_run_by_runs_of_layers_are_lossless(dtype, monkeypatch):
    """compile = "auto" choosing one-token graphs of a run of layers (as it does for runs
    too short to repay the whole decoder's): the emitted distribution is the target's,
    every step and tree through graphs of a run of layers."""
    from tokenswift import compiling

    monkeypatch.setattr(compiling, "_auto_mode", lambda *args: "layered")
    overrides = {"model": {"compile": "auto"}, "sampling": {"temperature": 0.8, "top_p": 0.9}}
    pipe = Pipeline.from_spec("tokenswift", tiny_model_for("llama-gqa", dtype), overrides=overrides)
    result = assert_lossless(pipe, [5, 6, 7, 8] * 6, 40, seed=1)
    graphs = pipe.runner.compiled
    assert result.stats.compiled and graphs.step_graph_name == "layered-forward"
    assert ("layered-forward", 1) in graphs._ready


def test_tree_forwards_on_trial_run_eagerly_and_compile_nothing():
    """While a run's trees are on trial (compiling.TreeTrial) a tree whose graph is not
    compiled runs eagerly, as eager forwards compute it, and compiles nothing."""
    model = tiny_model(TINY_CONFIGS["llama-gqa"], seed=12, dtype="float32")  # no graphs of other tests
    eager, compiled = Runner(model), Runner(model)
    graphs = compiled.use_compiled(True)
    compiled.use_compiled_trees((2, 4, 8))
    compiled.tree_trial = compiling.TreeTrial(compile_seconds=1.0, tokens=100)
    expected, got = tree_forwards(eager), tree_forwards(compiled)
    for want, have in zip(expected[0], got[0]):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    assert {key for key in graphs._ready if key[1] != 1} == set()
    assert not any(graphs.has_tree_graph(size) for size in (2, 4, 8))


@pytest.mark.parametrize("pays", [False, True])
def test_a_runs_tree_trial_decides_what_it_compiles_and_stays_lossless(pays, monkeypatch):
    """compile = "auto" with tree graphs the run may compile but has not got: its first
    steps verify trees eagerly, compiling nothing; once the trial has judged, the trees
    compile at their next forward (pays) or the run verifies none from then on. The
    emitted distribution is the target's throughout."""
    monkeypatch.setattr(compiling, "_auto_mode", lambda *args: "layered")
    monkeypatch.setattr(compiling, "tree_sizes", lambda *args: (2, 4, 8))
    monkeypatch.setattr(compiling, "affordable_tree_sizes", lambda runner, sizes, *args, **kwargs: sizes)
    # the compile's expected seconds decide the verdict whatever this machine's steps take
    monkeypatch.setattr(compiling, "tree_compile_seconds", lambda *args: -1.0 if pays else float("inf"))
    monkeypatch.setattr(compiling, "TRIAL_COSTS_SECONDS", float("-inf"))  # however cheap, on trial
    monkeypatch.setattr(compiling, "TRIAL_STEPS", 2)
    monkeypatch.setattr(compiling, "TRIAL_MAX_STEPS", 6)
    model = tiny_model(TINY_CONFIGS["llama-gqa"], seed=13, dtype="float32")  # no graphs of other tests
    pipe = Pipeline.from_spec("tokenswift", model, overrides={"model": {"compile": "auto"},
                                                              "sampling": {"temperature": 0.8, "top_p": 0.9}})
    judged = []  # (verdict, whether a tree graph was compiled by then) at each step of the trial
    observe = compiling.TreeTrial.observe

    def spy(self, *args, **kwargs):
        verdict = observe(self, *args, **kwargs)
        judged.append((verdict, any(pipe.runner.compiled.has_tree_graph(size) for size in (2, 4, 8))))
        return verdict

    monkeypatch.setattr(compiling.TreeTrial, "observe", spy)
    result = assert_lossless(pipe, [5, 6, 7, 8] * 6, 40, seed=1)
    runner = pipe.runner
    assert result.stats.compiled and runner.tree_trial is None
    verdicts = [verdict for verdict, _ in judged]
    assert 1 <= len(verdicts) <= 6 and verdicts[-1] is pays and set(verdicts[:-1]) <= {None}
    assert not any(compiled for _, compiled in judged)  # nothing compiled on trial
    if pays:
        assert runner.compiled_tree_sizes == (2, 4, 8)
    else:
        assert runner.compiled_tree_sizes == ()
        assert not any(runner.compiled.has_tree_graph(size) for size in (2, 4, 8))


def test_only_runs_shorter_than_the_whole_tree_graphs_put_their_trees_on_trial(monkeypatch):
    """A long run's trees gain as its context grows, which its first steps cannot show:
    runs of TRIAL_MAX_TOKENS new tokens or more compile their trees without a trial, as
    do runs whose trees are compiled already and runs whose cost model does not price trees."""
    monkeypatch.setattr(compiling, "_auto_mode", lambda *args: "layered")
    monkeypatch.setattr(compiling, "tree_sizes", lambda *args: (2, 4, 8))
    monkeypatch.setattr(compiling, "affordable_tree_sizes", lambda runner, sizes, *args, **kwargs: sizes)
    runner = Runner(tiny_model(TINY_CONFIGS["llama-gqa"], seed=15, dtype="float32"))  # no graphs of other tests

    def trial(new_tokens, prices_trees=True):
        compiling.decide(runner, "auto", prompt_tokens=24, new_tokens=new_tokens, prices_trees=prices_trees)
        assert runner.compiled_tree_sizes == (2, 4, 8)
        return runner.tree_trial

    assert trial(2000) is not None and trial(2000).tokens == 2000
    assert trial(compiling.TRIAL_MAX_TOKENS) is None
    assert trial(2000, prices_trees=False) is None
    monkeypatch.setattr(type(runner.compiled), "has_tree_graph", lambda self, size: True)
    assert trial(2000) is None


def test_auto_leaves_test_models_eager():
    result = Pipeline.from_spec("ar", tiny_model_for("llama-gqa", "float32")).generate([1, 2, 3], 4, seed=0)
    assert not result.stats.compiled and result.stats.compile_seconds == 0.0


def test_a_machine_without_a_compiler_decodes_eagerly_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(compiled_module, "compiler_problem", lambda device: "no C++ compiler (test)")
    monkeypatch.setattr(compiled_module, "_COMPILED", type(compiled_module._COMPILED)())
    model = tiny_model_for("llama-gqa", "float32")
    eager = Pipeline.from_spec("ar", model, overrides={"model": {"compile": False}}).generate([1, 2, 3], 8, seed=0)
    with caplog.at_level(logging.WARNING, logger="tokenswift"):
        result = Pipeline.from_spec("ar", model, overrides={"model": {"compile": True}}).generate([1, 2, 3], 8, seed=0)
    assert result.tokens == eager.tokens and not result.stats.compiled
    warnings = [r.getMessage() for r in caplog.records if "compile" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler (test)" in warnings[0]


def test_a_failing_compile_falls_back_to_eager_at_the_first_forward(monkeypatch, caplog):
    model = tiny_model_for("qwen2", "float32")
    eager = Pipeline.from_spec("ar", model, overrides={"model": {"compile": False}}).generate([1, 2, 3], 8, seed=0)
    broken = CompiledForward(model, model.get_decoder(), model.get_output_embeddings(), torch.float32)

    def fail(*args):
        raise RuntimeError("inductor exploded (test)")

    broken._graphs = {"forward": fail, "logits": fail}
    monkeypatch.setitem(compiled_module._COMPILED, model, {False: broken})
    with caplog.at_level(logging.WARNING, logger="tokenswift"):
        result = Pipeline.from_spec("ar", model, overrides={"model": {"compile": True}}).generate([1, 2, 3], 8, seed=0)
    assert result.tokens == eager.tokens
    warnings = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "inductor exploded (test)" in warnings[0]


def test_a_compile_failing_at_the_first_forward_leaves_the_cost_model_predicting_eager_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    model = tiny_model_for("qwen2", "float32")
    broken = CompiledForward(model, model.get_decoder(), model.get_output_embeddings(), torch.float32)

    def fail(*args):
        raise RuntimeError("inductor exploded (test)")

    broken._graphs = {"forward": fail, "logits": fail}
    monkeypatch.setitem(compiled_module._COMPILED, model, {False: broken})
    pipe = Pipeline.from_spec("ar", model, overrides={"model": {"compile": True}})
    # A measured comparison on file: compiled one-token steps at half the eager cost.
    CompileCalibration(
        key=machine_key(pipe.runner), machine="test", contexts=(16, 256), eager_ms=(2.0, 4.0), compiled_ms=(1.0, 2.0),
        compile_seconds=1.0,
    ).save()
    run = pipe.start([1, 2, 3], 8, seed=0)
    costs = run.setup.speculator.costs
    eager = costs.calibration.forward_seconds(1, 64)
    # priced at the compiled time measured (1.2 ms at 64 positions, between 16 and 256),
    # less the LM-head row it included (as this machine's calibration timed it)
    compiled = max(0.0012 - costs.calibration.head_ms / 1000, 0.2 * eager)
    assert run.setup.compiled and costs.forward_seconds(1, 64) == pytest.approx(compiled * costs.scale)
    records = list(run.steps())
    assert len(records) == 8 and pipe.runner.compiled is None and not run.compiled
    # eager again, as the forwards are (corrected by what they measured at their size)
    assert costs.forward_seconds(1, 64) == pytest.approx(eager * costs.scale * costs.size_factor(1))
    # ... and the next run does not try the failed compile again.
    assert not pipe.generate([1, 2, 3], 4, seed=0).stats.compiled


def test_compile_true_measures_what_prices_compiled_trees_where_the_cost_model_needs_it(tmp_path, monkeypatch):
    """With ``compile = true`` a preset whose cost model prices its trees measures the
    compile calibration where none is cached (once: then it is loaded), and the cost
    model prices its trees from it; a run without a cost model (``ar``) and a test-sized
    model measure nothing."""
    from tokenswift import compiling

    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    model = tiny_model_for("llama-gqa", "float32")
    measured = []

    def fake_measure(runner, **kwargs):
        measured.append(runner)
        return CompileCalibration(
            key=machine_key(runner), machine="test", contexts=(16, 256), eager_ms=(2.0, 4.0), compiled_ms=(1.0, 2.0),
            compile_seconds=1.0, tree_sizes=(4,), tree_eager_ms=(3.0,), tree_compiled_ms=(1.5,),
        )

    monkeypatch.setattr(compiling, "measure_compile", fake_measure)
    spec = {"preset": "eagle", "drafter": {"weights": "random"}, "model": {"compile": True}}
    assert Pipeline.from_spec(spec, model).start([1, 2, 3], 4, seed=0).setup.speculator.costs.compile_calibration is None
    assert not measured  # a test-sized model: nothing measured
    monkeypatch.setattr(compiling, "AUTO_MIN_PARAMETERS", 0)
    Pipeline.from_spec("ar", model, overrides={"model": {"compile": True}}).start([1, 2, 3], 4, seed=0)
    assert not measured  # no cost model prices ar's steps
    run = Pipeline.from_spec(spec, model).start([1, 2, 3], 4, seed=0)
    calibration = run.setup.speculator.costs.compile_calibration
    assert len(measured) == 1 and calibration is not None and calibration.tree_sizes == (4,)
    assert run.setup.runner.compiled_tree_sizes == (4,)  # the sizes it measured paying
    again = Pipeline.from_spec(spec, model).start([1, 2, 3], 4, seed=0)
    assert len(measured) == 1 and again.setup.speculator.costs.compile_calibration == calibration  # cached


def test_compile_option_values():
    assert ModelSpec(path="x").compile == "auto"
    assert ModelSpec(path="x", compile="true").compile is True
    assert ModelSpec(path="x", compile=False).compile is False
    assert ModelSpec(compile=True).compile_only  # a model object passed in, only the choice
    with pytest.raises(SpecError, match=r"model.compile must be \"auto\", true or false, got 'sometimes'"):
        ModelSpec(path="x", compile="sometimes")
    with pytest.raises(SpecError, match="exactly one of"):
        ModelSpec(dtype="float32", compile=True)
    with pytest.raises(SpecError, match="no model"):
        Pipeline.from_spec({"preset": "ar", "model": {"compile": True}})


def test_bench_compares_eager_compiled_and_auto_with_the_compile_time(model_dir, tmp_path, capsys):
    from tokenswift.cli import main

    out_dir = tmp_path / "compiled"
    code = main([
        "bench", "--interleaved", "--model", str(model_dir), "--dtype", "float32", "--methods", "tokenswift",
        "--heads", "random", "--prompt-tokens", "12", "--new-tokens", "16", "--seeds", "0", "--compile", "all",
        "--out", str(out_dir),
    ])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((out_dir / "interleaved.json").read_text())
    assert list(report["summary"]) == ["ar", "ar+compiled", "ar+auto", "tokenswift", "tokenswift+compiled", "tokenswift+auto"]
    assert all(report["per_seed"][0][name]["same_tokens_as_ar"] for name in report["summary"])  # float32: identical
    assert report["compile_seconds"] > 0 and report["config"]["compile"] == "all"
    assert set(report["roofline"]["ar"]) == {"ar", "ar+compiled", "ar+auto"} and report["roofline"]["bandwidth_gb_s"] > 0
    assert "Compiling the one-token forward (and the tree sizes compiled presets use) took" in out and "the memory floor" in out


def test_calibrate_compares_compiled_and_eager_steps(model_dir, tmp_path, monkeypatch, capsys):
    from tokenswift.cli import main

    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    code = main(["calibrate", "--model", str(model_dir), "--dtype", "float32", "--compile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "one-token step (forward + LM-head row), ms, eager vs compiled:" in out and "context 256: eager" in out
    assert "tree verify forward at context" in out and all(f"  {size} tokens: eager" in out for size in (4, 8, 16, 32))
    assert "a one-token step compiled at context 8192: " in out  # beside the trees' far times: their ratio is measured
    (record,) = (tmp_path / "calibration").glob("*-compile.json")
    # with the graph store off (as in these tests) no later run could load the whole
    # decoder's tree graph: the trees are timed through the graph runs then compile
    assert json.loads(record.read_text())["tree_graph"] == "layered-tree"
    code = main(["calibrate", "--model", str(model_dir), "--dtype", "float32", "--compile", "--show"])
    shown, _ = capsys.readouterr()
    assert code == 0 and shown == out


# -- compiled tree verify forwards ----------------------------------------------------

TREES = [  # (tokens, depths, parent of each node: -1 for the root)
    ([3, 1], [0, 1], [-1, 0]),
    ([3, 1, 4], [0, 1, 1], [-1, 0, 0]),
    ([3, 1, 4, 1], [0, 1, 2, 1], [-1, 0, 1, 0]),  # exactly a compiled size: no padding
    ([3, 1, 4, 1, 5, 9], [0, 1, 2, 1, 2, 3], [-1, 0, 1, 0, 3, 4]),
]


def tree_mask(parents):
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        while parent >= 0:
            mask[i, parent] = True
            parent = parents[parent]
    return mask


def tree_forwards(runner: Runner):
    """Each tree of TREES verified after a prefill, its deepest path committed, then one
    token more: (every tree's logits, the last token's logits, the committed KV)."""
    runner.allocate(64)
    runner.prefill(torch.tensor(PROMPT))
    logits = []
    for tokens, depths, parents in TREES:
        out = runner.forward(torch.tensor(tokens), tree_mask=tree_mask(parents), depths=torch.tensor(depths))
        logits.append(out.logits)
        path, node = [], len(tokens) - 1
        while node >= 0:
            path.append(node)
            node = parents[node]
        runner.commit(sorted(path))
    last = runner.forward(torch.tensor([2])).logits
    length = runner.committed_length
    return logits, last, [k[:, :, :length].clone() for k in runner.store.keys]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_one_token_forwards_by_runs_of_layers_equal_eager_ones(dtype, monkeypatch):
    """The one-token graph of a run of layers (the runs too short to repay the whole
    decoder's compile): the logits and the committed KV of eager forwards."""
    model = tiny_model_for("llama-gqa", dtype)
    want = one_token_forwards(Runner(model), [3, 1, 4, 1, 5, 9])
    runner = Runner(model)
    graphs = runner.use_compiled(True)
    monkeypatch.setattr(graphs, "layered_steps", True)
    got = one_token_forwards(runner, [3, 1, 4, 1, 5, 9])
    tolerance = {"float32": 1e-4, "float64": 1e-5}[dtype]
    torch.testing.assert_close(got[0], want[0], rtol=tolerance, atol=tolerance)
    for have, expected in zip(got[2], want[2]):
        torch.testing.assert_close(have, expected, rtol=tolerance, atol=tolerance)
    assert ("layered-forward", 1) in graphs._ready and graphs.compiled


# The graph of every size (what runs by default) in both dtypes; the other kinds, each
# a cold compile of ~20 s on a 2-core AVX2 CPU, in float64 by default and float32 with
# `python -m pytest -m slow`.
@pytest.mark.parametrize(("dtype", "graphs_of"), [
    ("float32", "every size"), ("float64", "every size"), ("float64", "each size"), ("float64", "whole decoder"),
    ("float64", "whole decoder, every size"),
    pytest.param("float32", "each size", marks=pytest.mark.slow),
    pytest.param("float32", "whole decoder", marks=pytest.mark.slow),
])
def test_compiled_tree_forwards_equal_eager_ones(dtype, graphs_of, monkeypatch):
    """Trees padded to a compiled size (3 tokens -> 4, 6 -> 8; 2 and 4 as they are), or
    at their own size through one graph of every size: the same logits for every node,
    the same committed KV; the padding is never seen nor kept.
    Every kind of tree graph: of a run of layers (each of the two layers' runs one call
    of one graph, each joining its own layer's KV), one for every size (the token count
    traced symbolic: compiled once) or one per size, and of the whole decoder (one per
    size, or one of every size)."""
    model = tiny_model_for("llama-gqa", dtype)
    eager = Runner(model)
    compiled = Runner(model)
    graphs = compiled.use_compiled(True)
    layered = not graphs_of.startswith("whole decoder")
    every_size = graphs_of.endswith("every size")
    monkeypatch.setattr(graphs, "layered_problem", None if layered else "whole decoder, for this test")
    monkeypatch.setattr(graphs, "one_tree_graph", every_size)
    monkeypatch.setattr(graphs, "_sized_graphs", {})
    monkeypatch.setattr(graphs, "_ready", {key for key in graphs._ready if key[1] == 1})
    monkeypatch.setattr(graphs, "graph_seconds", {})
    compiled.use_compiled_trees((2, 4, 8))
    sizes = [compiled.compiled_size(n) for n in (1, 2, 3, 4, 5, 8, 9)]
    # one graph of every size runs each tree at its own size: nothing padded
    assert sizes == ([1, 2, 3, 4, 5, 8, None] if every_size else [1, 2, 4, 4, 8, 8, None])
    expected = tree_forwards(eager)
    compiled.allocate(4)
    compiled.forward(torch.tensor([1]))  # the one-token graphs compiled: what is counted below is the trees'
    compiled.store.reset()
    before = sum(compile_costs.cache_counts())
    got = tree_forwards(compiled)
    inductor_compiles = sum(compile_costs.cache_counts()) - before  # a recompile at a new size counts too
    # float64 too: the model's float32 detours (RMSNorm, rotary angles) round
    # differently in fused multi-row code (measured: 2e-5); a seen padding token is ~1e-1.
    tolerance = 1e-4
    for want, have in zip(expected[0], got[0]):
        torch.testing.assert_close(have, want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got[1], expected[1], rtol=tolerance, atol=tolerance)
    for have, want in zip(got[2], expected[2]):
        torch.testing.assert_close(have, want, rtol=tolerance, atol=tolerance)
    assert all(compiled.compiled.has_tree_graph(size) for size in (2, 4, 8))
    kinds = {type(graph).__name__ for graph in graphs._sized_graphs.values()}
    assert kinds == ({"LayeredForward"} if layered else {"SymbolicTokens"} if every_size else {"function"}), kinds
    compiles = {key for key in graphs.graph_seconds if key[1] != 1}
    if every_size:  # one compile served 2, 3, 4, 5 and 8
        assert compiles == {("layered-tree" if layered else "tree", compiled_module.ANY_SIZE)}
        assert inductor_compiles == 1
    else:
        assert {size for _, size in compiles} == {2, 4, 8}
        assert inductor_compiles == 3


def test_a_tree_graph_of_every_size_that_fails_to_trace_compiles_one_per_size(monkeypatch, caplog):
    """Where tracing the token count symbolic fails, the tree sizes compile a graph each
    (said once) and the forwards stay what eager ones compute."""
    model = tiny_model_for("llama-gqa", "float32")
    eager, compiled = Runner(model), Runner(model)
    graphs = compiled.use_compiled(True)
    monkeypatch.setattr(graphs, "layered_problem", None)
    monkeypatch.setattr(graphs, "one_tree_graph", True)
    monkeypatch.setattr(graphs, "_sized_graphs", {})
    monkeypatch.setattr(graphs, "_ready", {key for key in graphs._ready if key[1] == 1})
    real = compiled_module.first_compiled_call

    def symbolic_fails(graph, args, what=""):
        if isinstance(graph, compiled_module.LayeredForward) and graph.tokens is not None:
            raise compiled_module.CompileUnavailable("torch.compile failed: ConstraintViolationError: planted")
        return real(graph, args, what)

    monkeypatch.setattr(compiled_module, "first_compiled_call", symbolic_fails)
    compiled.use_compiled_trees((2, 4, 8))
    with caplog.at_level(logging.WARNING, logger="tokenswift.model.compiled"):
        expected, got = tree_forwards(eager), tree_forwards(compiled)
    for want, have in zip(expected[0], got[0]):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)
    assert compiled.compiled is graphs and graphs.failure is None and not graphs.one_tree_graph
    assert caplog.text.count("compile a graph per size") == 1
    assert all(graphs.has_tree_graph(size) for size in (2, 4, 8))


@pytest.mark.parametrize(("layers", "run"), [(30, 6), (2, 1), (32, 8), (24, 6), (7, 7), (1, 1)])
def test_a_run_of_layers_is_the_smallest_divisor_of_the_stack_at_least_a_fifth_of_it(layers, run):
    assert compiled_module.layer_run_length(layers) == run


def test_only_decoders_of_alike_layers_and_the_plain_glue_compile_by_runs_of_layers():
    model = tiny_model_for("llama-gqa", "float32")
    decoder = model.get_decoder()
    assert compiled_module.layered_problem(model, decoder) is None
    assert compiled_module.layered_problem(tiny_model_for("qwen2", "float32"), tiny_model_for("qwen2", "float32").get_decoder()) is None
    config = model.config
    try:
        config.model_type = "gemma"  # scales its embeddings in the model's forward
        assert "gemma" in compiled_module.layered_problem(model, decoder)
        config.model_type = "llama"
        config.layer_types = ["full_attention", "sliding_attention"]
        assert "attend in several ways" in compiled_module.layered_problem(model, decoder)
    finally:
        config.model_type = "llama"
        config.layer_types = None


def test_every_compiled_graph_skips_the_module_guards(tmp_path, monkeypatch):
    """Each graph (the one-token forward, the LM-head row, the tree graph, the draft
    level's) is compiled with the guard filter that skips the model's module guards.
    torch.compile pops it out of the options it is given: a second graph compiled from
    the same dict went without it and checked ~5,000 guards at every call (1.2 ms of a
    2-token tree forward of SmolLM2 on a 2-core AMD EPYC Zen 4)."""
    from tests.test_eagle import decisive_net

    compile_calls = []

    def recording(fn, **kwargs):
        # what torch.compile does with the filter (it pops it out of ``options``), without
        # compiling: the graphs then run as the eager functions they were made from
        options = kwargs.get("options") or {}
        compile_calls.append((fn.__name__, options.pop("guard_filter_fn", None) is not None))
        return fn

    monkeypatch.setattr(torch, "compile", recording)
    model = tiny_model(TINY_CONFIGS["llama-gqa"], seed=11, dtype="float32")  # no graphs of other tests
    runner = Runner(model)
    runner.use_compiled(True)
    runner.use_compiled_trees((2, 4, 8))
    tree_forwards(runner)
    overrides = {"model": {"compile": True}, "drafter": {"weights": decisive_net(model, tmp_path)},
                 "speculation": {"tree": "fixed"}, "sampling": {"greedy": True}}
    pipe = Pipeline.from_spec("eagle", model, overrides=overrides)
    pipe.drafter.compile_now()
    assert len(compile_calls) >= 4  # forward, logits, one tree graph of every size, one draft level's of every row count
    assert all(filtered for _, filtered in compile_calls), compile_calls


@pytest.mark.parametrize("trees_through", ["layered graph", "whole decoder's graph of every size"])
def test_compiled_trees_in_whole_runs_are_lossless_and_emit_what_eager_runs_emit(trees_through, monkeypatch):
    """Runs whose trees go through either kind of tree graph (the whole decoder's where
    the run is long enough to repay it, or where it is stored: here made so by the
    threshold): lossless, and what an eager run emits."""
    if trees_through != "layered graph":
        monkeypatch.setattr(compiling, "WHOLE_TREES_FROM_TOKENS", 0)
    model = tiny_model_for("llama-gqa", "float32")
    # at most 8 drafted nodes: a size the tree graphs serve on every CPU (a fixed tree's
    # own size follows what the decode kernel serves here: 65 tokens on a Zen 4)
    spec = {"preset": "eagle", "drafter": {"weights": "random"}, "speculation": {"tree": "fixed", "max_nodes": 8}}
    eager = Pipeline.from_spec(spec, model, overrides={"model": {"compile": False}})
    compiled = Pipeline.from_spec(spec, model, overrides={"model": {"compile": True}})
    prompt = [5, 6, 7, 8] * 4
    result = assert_lossless(compiled, prompt, 32, seed=3)
    assert result.tokens == eager.generate(prompt, 32, seed=3, ignore_eos=True).tokens
    assert compiled.runner.compiled_tree_sizes and any(
        compiled.runner.compiled.has_tree_graph(size) for size in compiled.runner.compiled_tree_sizes)
    assert compiled.runner.compiled.tree_graph_name == ("layered-tree" if trees_through == "layered graph" else "tree")


def test_the_cost_model_prices_a_compiled_tree_at_its_padded_size():
    from tokenswift.compiling import CompileCalibration
    from tokenswift.costs import CostModel
    from tests.test_speculation import calibration

    measured = CompileCalibration(
        key="k", machine="m", contexts=(256, 2048), eager_ms=(20.0, 24.0), compiled_ms=(10.0, 12.0), compile_seconds=1.0,
        tree_sizes=(4, 8), tree_eager_ms=(30.0, 32.0), tree_compiled_ms=(14.0, 40.0),
    )
    assert measured.paying_tree_sizes == (4,)
    sizes = {1: 1, 2: 4, 3: 4, 4: 4}
    costs = CostModel(calibration(2.0), compiled_size=lambda n: sizes.get(n))
    eager = CostModel(calibration(2.0))
    costs.use_compile_calibration(measured)
    # 2 and 3 nodes cost what 4 do: the 14 ms measured compiled at 2,048 positions,
    # moved along the eager curve of 4 nodes to the context asked
    for nodes in (2, 3, 4):
        moved = eager.forward_seconds(4, 1000) - eager.forward_seconds(4, 2048)
        assert costs.forward_seconds(nodes, 1000) == pytest.approx(0.014 + moved)
    assert costs.forward_seconds(4, 2048) == pytest.approx(0.014)  # at the calibration's context: as measured
    assert costs.forward_seconds(5, 1000) == eager.forward_seconds(5, 1000)  # eager beyond the compiled sizes
    assert costs.forward_seconds(1, 2048) == pytest.approx(eager.forward_seconds(1, 2048) * 0.5)


def test_a_tree_at_its_own_size_is_priced_between_the_measured_sizes():
    """One graph of every tree size runs a tree at its own size: a size the compile
    calibration did not time is priced on the line between the sizes around it (at
    both of its contexts), never below or beyond them."""
    from tokenswift.compiling import CompileCalibration

    measured = CompileCalibration(
        key="k", machine="m", contexts=(256, 2048), eager_ms=(20.0, 24.0), compiled_ms=(10.0, 12.0), compile_seconds=1.0,
        tree_sizes=(2, 4, 8), tree_eager_ms=(30.0, 32.0, 36.0), tree_compiled_ms=(14.0, 16.0, 24.0),
        tree_far_context=8192, tree_far_compiled_ms=(20.0, 26.0, 40.0),
    )
    assert measured.tree_compiled_seconds(3) == pytest.approx(0.015)
    assert measured.tree_compiled_seconds(6) == pytest.approx(0.020)
    assert measured.tree_compiled_seconds(4) == pytest.approx(0.016)  # measured: as measured
    assert measured.tree_compiled_seconds(1) is None and measured.tree_compiled_seconds(9) is None
    # size 6 at 8,192 positions: (26 + 40) / 2 = 33 ms; at 2,048: 20 ms
    assert measured.tree_compiled_seconds_at(6, 8192) == pytest.approx(0.033)
    assert measured.tree_compiled_seconds_at(6, 5120) == pytest.approx(0.0265)
    assert measured.tree_compiled_seconds_at(12, 5120) is None


def test_a_tree_timed_at_two_contexts_is_priced_along_its_own_growth():
    """With compiled trees timed at a second context, a tree's cost at any context is
    the line through its two measurements, not the eager curve's growth (which put a
    5-token tree at 32K 35 ms above one token on a Sapphire Rapids, against 2 measured);
    a record from before (one context) loads and is priced as before."""
    from tokenswift.compiling import CompileCalibration
    from tokenswift.costs import CostModel
    from tests.test_speculation import calibration

    measured = CompileCalibration(
        key="k", machine="m", contexts=(256, 2048), eager_ms=(20.0, 24.0), compiled_ms=(10.0, 12.0), compile_seconds=1.0,
        tree_sizes=(4, 8), tree_eager_ms=(30.0, 32.0), tree_compiled_ms=(14.0, 20.0),
        tree_far_context=8192, tree_far_compiled_ms=(17.0, 29.0),
    )
    costs = CostModel(calibration(2.0), compiled_size=lambda n: {1: 1, 2: 4, 3: 4, 4: 4, 5: 8}.get(n))
    costs.use_compile_calibration(measured)
    assert costs.forward_seconds(3, 2048) == pytest.approx(0.014)
    assert costs.forward_seconds(4, 8192) == pytest.approx(0.017)
    assert costs.forward_seconds(4, 32768) == pytest.approx(0.014 + 0.003 * (32768 - 2048) / 6144)
    assert costs.forward_seconds(5, 32768) == pytest.approx(0.020 + 0.009 * (32768 - 2048) / 6144)
    old = {k: v for k, v in measured.to_dict().items() if not k.startswith("tree_far")}
    loaded = CompileCalibration.from_dict(old)
    assert loaded.tree_far_compiled_ms == () and loaded.tree_compiled_seconds_at(4, 32768) is None


def test_past_the_far_context_a_tree_keeps_its_ratio_to_one_token_measured_there():
    """Where the one-token step was timed at the far context too, a tree past it is
    priced at the ratio to a one-token forward measured there (both then read the KV),
    not on the line through its two timings, whose noise grows with the distance (a
    2-token tree at 32K priced 27% above one token on a Zen 4, 6-8% measured); up to
    the far context, and without the one-token far time, as before."""
    import attrs

    from tokenswift.compiling import CompileCalibration
    from tokenswift.costs import CostModel
    from tests.test_speculation import calibration

    measured = CompileCalibration(
        key="k", machine="m", contexts=(256, 2048), eager_ms=(20.0, 24.0), compiled_ms=(10.0, 13.0), compile_seconds=1.0,
        tree_sizes=(2, 4), tree_eager_ms=(30.0, 32.0), tree_compiled_ms=(12.5, 14.0),
        tree_far_context=8192, tree_far_compiled_ms=(21.0, 27.0), far_compiled_ms=19.0,
    )
    costs = CostModel(attrs.evolve(calibration(2.0), head_ms=1.0), compiled_size=lambda n: n)
    costs.use_compile_calibration(measured)
    one = costs.forward_seconds(1, 32768)
    assert one == pytest.approx(0.012 + 0.006 * 5)  # 13 -> 19 ms with the head row from 2K to 8K, less it
    assert costs.forward_seconds(2, 32768) == pytest.approx(one * 21 / 18)
    assert costs.forward_seconds(4, 32768) == pytest.approx(one * 27 / 18)
    assert costs.forward_seconds(3, 32768) == pytest.approx(one * 24 / 18)  # between the measured sizes
    # at and below the far context: on the line through the two timings
    assert costs.forward_seconds(2, 8192) == pytest.approx(0.021)
    assert costs.forward_seconds(2, 5120) == pytest.approx((0.0125 + 0.021) / 2)
    # without the one-token far time: along the tree's own line, as before
    costs.use_compile_calibration(attrs.evolve(measured, far_compiled_ms=0.0))
    assert costs.forward_seconds(2, 32768) == pytest.approx(0.0125 + 0.0085 * (32768 - 2048) / 6144)


def test_a_one_token_step_is_priced_from_the_compiled_times_the_trees_are_priced_from():
    """A compiled one-token forward is priced at the compile calibration's compiled time,
    less the LM-head row it includes, whatever its eager times were (a noisy eager time
    at 2K halved the one-token price against the trees' and no tree was verified); past
    the last context along its time at the far context, or without one, continuously
    along the eager curve scaled by compiled/eager; without the head's time, as before."""
    import attrs

    from tokenswift.compiling import CompileCalibration
    from tokenswift.costs import CostModel
    from tests.test_speculation import calibration

    noisy = CompileCalibration(
        key="k", machine="m", contexts=(256, 2048), eager_ms=(20.0, 40.0), compiled_ms=(10.0, 13.0), compile_seconds=1.0,
        tree_sizes=(2, 4), tree_eager_ms=(30.0, 32.0), tree_compiled_ms=(14.0, 16.0),
        tree_far_context=8192, tree_far_compiled_ms=(20.0, 26.0), far_compiled_ms=19.0,
    )
    with_head = attrs.evolve(calibration(2.0), head_ms=1.0)
    costs = CostModel(with_head, compiled_size=lambda n: {1: 1, 2: 2, 3: 4, 4: 4}.get(n))
    costs.use_compile_calibration(noisy)
    assert costs.forward_seconds(1, 2048) == pytest.approx(0.012)  # 13 ms with the head row, less its 1 ms
    assert costs.forward_seconds(1, 1152) == pytest.approx(0.0105)  # between the measured contexts
    assert costs.forward_seconds(2, 2048) / costs.forward_seconds(1, 2048) == pytest.approx(14 / 12)
    assert costs.forward_seconds(1, 8192) == pytest.approx(0.018)  # the far time, less the head row
    assert costs.forward_seconds(1, 14336) == pytest.approx(0.012 + 0.006 * 2)  # along its own growth
    # a record without the far time: past 2K, moved along the scaled eager curve from its 2K price
    near_only = attrs.evolve(noisy, far_compiled_ms=0.0)
    costs.use_compile_calibration(near_only)
    eager = CostModel(with_head)
    scaled = lambda at: eager.forward_seconds(1, at) * near_only.factor(at)  # noqa: E731
    assert costs.forward_seconds(1, 2048) == pytest.approx(0.012)
    assert costs.forward_seconds(1, 4096) == pytest.approx(0.012 + scaled(4096) - scaled(2048))
    # and without the head's time: the eager curve scaled by compiled/eager, as before
    costs = CostModel(calibration(2.0), compiled_size=lambda n: {1: 1}.get(n))
    costs.use_compile_calibration(noisy)
    assert costs.forward_seconds(1, 2048) == pytest.approx(CostModel(calibration(2.0)).forward_seconds(1, 2048) * 13 / 40)
    # a record written before the far one-token time loads without it
    old = {k: v for k, v in noisy.to_dict().items() if k != "far_compiled_ms"}
    loaded = CompileCalibration.from_dict(old)
    assert loaded.far_compiled_ms == 0.0 and loaded.one_token_compiled_seconds_at(8192) is None


def test_trees_compile_at_the_sizes_that_pay():
    from types import SimpleNamespace

    from tokenswift.compiling import CompileCalibration, tree_sizes

    class Compiled:
        compiled = object()
        config = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)

    measured = CompileCalibration(
        key="k", machine="m", contexts=(256,), eager_ms=(20.0,), compiled_ms=(10.0,), compile_seconds=1.0,
        tree_sizes=(4, 8, 16), tree_eager_ms=(30.0, 32.0, 40.0), tree_compiled_ms=(14.0, 40.0, 30.0),
    )
    untested = attrs.evolve(measured, tree_sizes=(), tree_eager_ms=(), tree_compiled_ms=())
    assert tree_sizes(Compiled, "auto", measured) == tree_sizes(Compiled, True, measured) == (4, 16)
    assert tree_sizes(Compiled, True, untested) == (2, 4, 5, 8, 16, 32) and tree_sizes(Compiled, "auto", untested) == ()
    Compiled.compiled = None
    assert tree_sizes(Compiled, True, measured) == ()
    with pytest.raises(ValueError, match="sizes must be >= 2"):
        Runner(tiny_model_for("llama-gqa", "float32")).use_compiled_trees((1, 4))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "sizes"),
    [(9, 3, (2, 4, 5, 8, 16, 32)), (32, 8, (2, 4, 8, 16, 32)), (4, 4, (2, 4, 8, 16, 32)), (64, 8, (2, 4, 8, 16, 32)), (8, None, (2, 4, 8, 16, 32))],
)
def test_a_tree_size_fills_one_tile_of_the_decode_kernels_rows(heads, kv_heads, sizes):
    """Besides 2, 4, 8, 16, 32: the most new tokens whose query rows (g per KV head) fit
    the kernel's 16-row tile, e.g. 5 for 9 query / 3 KV heads (a 5-token tree padded to
    8 would pay for a second row group)."""
    from types import SimpleNamespace

    from tokenswift.compiling import tree_sizes_for

    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
    assert tree_sizes_for(SimpleNamespace(config=config)) == sizes


def test_prompt_chunks_never_run_through_tree_graphs():
    runner = Runner(tiny_model_for("qwen2", "float32"))
    runner.use_compiled(True)
    runner.use_compiled_trees((4,))
    runner.allocate(16)
    runner.prefill(torch.tensor([5, 6, 7]))  # a 3-token chunk: eager, whatever sizes compile for trees
    assert runner.committed_length == 3 and not runner.compiled.has_tree_graph(4)


def test_a_compile_calibration_of_the_first_format_still_loads_without_trees():
    from tokenswift.compiling import CompileCalibration

    old = {"format": "tokenswift-compile-calibration/1", "key": "k", "machine": "m", "contexts": [256, 2048],
           "eager_ms": [40.0, 45.0], "compiled_ms": [25.0, 28.0], "compile_seconds": 9.0}
    loaded = CompileCalibration.from_dict(old)
    assert loaded.factor(2048) == pytest.approx(28.0 / 45.0)
    assert loaded.tree_sizes == () and loaded.paying_tree_sizes == () and loaded.tree_saving_seconds(4) is None


def test_compiled_forwards_through_kernel_linears_equal_eager_ones():
    """With tokenswift's few-rows kernel on, the compiled one-token and tree graphs call
    it (an operator in the graph) and give what eager PyTorch products give."""
    from tokenswift import kernels

    if not kernels.available():
        pytest.skip("the kernels cannot be built here")
    model = tiny_model_for("llama-gqa", "float32")
    eager = Runner(model)
    compiled = Runner(model)
    compiled.use_kernel_linears(True)
    compiled.use_compiled(True)
    compiled.use_compiled_trees((4, 8))
    assert compiled.compiled.kernel_linears and compiled.compiled is not CompiledForward.for_model(
        model, compiled.decoder, compiled.lm_head, compiled.logits_dtype)  # one set of graphs per setting
    expected, got = tree_forwards(eager), tree_forwards(compiled)
    for want, have in zip(expected[0], got[0]):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-4)
    assert compiled.compiled.has_tree_graph(4) and compiled.compiled.has_tree_graph(8)


def test_past_its_last_measured_context_a_compiled_step_saves_what_it_saved_there():
    """The 100K run's decision: a calibration whose compiled line rose a little faster
    than the eager one between its two contexts must not price compiled steps as
    losing at 50K positions (both paths attend through the same operator)."""
    measured = CompileCalibration(
        key="k", machine="m", contexts=(256, 2048), eager_ms=(29.41, 31.41), compiled_ms=(17.86, 20.53),
        compile_seconds=7.0,
    )
    assert measured.saving_seconds(1024) == pytest.approx((30.267 - 19.004) / 1000, abs=1e-4)  # within: the lines
    eager, compiled = measured.milliseconds(52048)
    assert eager == pytest.approx(29.41 + 2.0 * (52048 - 256) / 1792)
    assert measured.saving_seconds(52048) == pytest.approx((31.41 - 20.53) / 1000)
    assert compiled == pytest.approx(eager - (31.41 - 20.53))
    assert measured.factor(52048) == pytest.approx(compiled / eager) and measured.factor(52048) < 1.0


def _recorded_proposals(pipe) -> list:
    """Wraps ``pipe``'s drafter so that each proposal's (tokens, confidences) is kept."""
    proposals, propose = [], pipe.drafter.propose

    def recording(state, inputs):
        branches = propose(state, inputs)
        proposals.append([(branch.tokens, branch.confidence) for branch in branches])
        return branches

    pipe.drafter.propose = recording
    return proposals


def test_draft_levels_compile_only_where_the_tree_forwards_do(tmp_path):
    """Where a run's one-token forwards are compiled but its tree forwards stay eager (a
    run too short to repay their graphs), the ``eagle`` levels stay eager too: no level
    graph is compiled. Where trees are compiled, so are the levels. Both emit the same
    tokens."""
    from tests.test_eagle import decisive_net

    results = {}
    for trees in (False, True):
        model = tiny_model_for("llama-gqa", "float32")  # its own drafter parts and graphs
        drafter = {"weights": decisive_net(model, tmp_path / str(trees)), "threshold": 0.0}
        overrides = {"model": {"compile": True}, "drafter": drafter, "sampling": {"greedy": True},
                     "retriever": {"name": "none"}, "speculation": {"tree": "fixed", "max_nodes": 8}}
        pipe = Pipeline.from_spec("eagle", model, overrides=overrides)
        generation = pipe.start([5, 6, 7, 8, 9, 3, 2] * 3, 24, seed=0, ignore_eos=True)
        generation.prefill()
        if not trees:
            pipe.runner.use_compiled_trees(())
        records = list(generation.steps())
        assert pipe.runner.compiled is not None and any(r.verified for r in records)
        level = pipe.drafter.parts._level
        assert pipe.drafter.levels_compiled == trees
        assert (level is not None and level.compiled_for(pipe.drafter.kv.size)) == trees
        results[trees] = [t for r in records for t in r.emitted]
    assert results[True] == results[False]


def test_a_runs_compile_seconds_count_the_draft_levels_compile_too(tmp_path):
    """The summary's compile seconds are every graph's first call in the run: the
    target's one-token and tree graphs and the ``eagle`` draft level's."""
    from tests.test_eagle import decisive_net

    model = tiny_model(TINY_CONFIGS["llama-gqa"], seed=14, dtype="float32")  # no graphs of other tests
    overrides = {"model": {"compile": True}, "drafter": {"weights": decisive_net(model, tmp_path), "threshold": 0.0},
                 "sampling": {"greedy": True}, "retriever": {"name": "none"}, "speculation": {"tree": "fixed"}}
    pipe = Pipeline.from_spec("eagle", model, overrides=overrides)
    result = pipe.generate([5, 6, 7, 8, 9, 3, 2] * 3, 24, seed=0, ignore_eos=True)
    level = pipe.drafter.parts.level()
    assert level is not None and level.compile_seconds > 0 and pipe.runner.compiled.compile_seconds > 0
    assert result.stats.compile_seconds == pytest.approx(pipe.runner.compiled.compile_seconds + level.compile_seconds, abs=0.02)


def test_compiled_draft_levels_propose_what_eager_levels_do(tmp_path, monkeypatch):
    """The ``eagle`` drafter's levels compiled (one graph for every row count of
    LEVEL_ROWS, one row padded to two, the cache in fixed buffers) propose, step by step, the candidates the
    eager levels do, with their confidences to float32 rounding; the runs emit the same
    tokens; one graph served every level. Both runs compile the target's
    forwards, so the drafter starts from the same features and only the levels differ
    (with eager verify forwards on one side the rounding of the features drifted the
    confidences by up to 1.2e-3 over four levels on an AMD EPYC with AVX-512; from
    the same features they differ by ~1.2e-4 there, and by 1.1e-3 at one depth-6 node
    once the verify trees ran as graphs of runs of layers, each level's rounding
    carried into the next; a wrong mask or padding row moves confidences by ~1e-1)."""
    from tests.test_eagle import decisive_net
    from tokenswift.drafters.eagle import _DraftParts

    model = tiny_model_for("llama-gqa", "float32")
    drafter = {"weights": decisive_net(model, tmp_path), "threshold": 0.0}
    overrides = {"model": {"compile": True}, "drafter": drafter, "sampling": {"greedy": True}, "retriever": {"name": "none"},
                 "speculation": {"tree": "fixed", "max_nodes": 24}}
    runs = {}
    for levels_compiled in (True, False):
        with monkeypatch.context() as patch:
            if not levels_compiled:
                patch.setattr(_DraftParts, "level", lambda self: None)
            pipe = Pipeline.from_spec("eagle", model, overrides=overrides)
            proposals = _recorded_proposals(pipe)
            runs[levels_compiled] = pipe, proposals, pipe.generate([5, 6, 7, 8, 9, 3, 2] * 3, 40, seed=0, ignore_eos=True)
    (pipe, compiled, compiled_result), (_, eager, eager_result) = runs[True], runs[False]
    assert compiled_result.tokens == eager_result.tokens and compiled_result.stats.compiled and eager_result.stats.compiled
    assert len(compiled) == len(eager) > 5
    for got, want in zip(compiled, eager):
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        for (_, got_confidence), (_, want_confidence) in zip(got, want):
            assert got_confidence == pytest.approx(want_confidence, rel=2e-3, abs=1e-5)
    level = pipe.drafter.parts.level()
    assert level is not None and level.one_graph and level.rows_to_compile(pipe.drafter.kv.size) == ()


def test_drafters_of_other_cache_sizes_on_one_model_compile_their_own_levels(tmp_path):
    """Two ``eagle`` drafters of one model whose draft caches differ in size (another
    depth) share the compiled level object, each with graphs of its own: once both
    have compiled (``compile_now``), a run of either compiles nothing more (keyed by
    row count alone, the second's calls recompiled the first's graphs mid-run)."""
    from tests.test_eagle import decisive_net
    from torch._dynamo.utils import counters

    from tokenswift.compiling import compile_trees_now

    model = tiny_model_for("llama-gqa", "float32")
    weights = decisive_net(model, tmp_path)
    warm = Pipeline.from_spec("ar", model, overrides={"model": {"compile": True}})
    warm.generate([5, 9], 2, seed=0, ignore_eos=True)  # the target's one-token graphs
    compile_trees_now(warm.runner)  # and its tree sizes: only the draft levels are counted below
    pipes = []
    for depth in (4, 2):
        overrides = {"model": {"compile": True}, "drafter": {"weights": weights, "depth": depth},
                     "sampling": {"greedy": True}, "speculation": {"tree": "fixed"}}
        pipe = Pipeline.from_spec("eagle", model, overrides=overrides)
        pipe.drafter.compile_now()
        pipes.append(pipe)
    assert pipes[0].drafter.kv.size != pipes[1].drafter.kv.size
    level = pipes[1].drafter.parts.level()
    assert level is pipes[0].drafter.parts.level()
    assert level.rows_to_compile(pipes[0].drafter.kv.size) == level.rows_to_compile(pipes[1].drafter.kv.size) == ()
    for pipe in reversed(pipes):
        graphs = counters["stats"]["unique_graphs"]
        pipe.generate([5, 9, 17, 3, 8, 1] * 2, 24, seed=0, ignore_eos=True)
        assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled in the run


def test_a_failing_draft_level_compile_drafts_eagerly_with_one_warning(tmp_path, caplog):
    from tests.test_eagle import decisive_net
    from tokenswift.drafters.draft_graphs import CompiledLevel

    model = tiny_model_for("llama-gqa", "float32")
    overrides = {"model": {"compile": True}, "drafter": {"weights": decisive_net(model, tmp_path)}, "sampling": {"greedy": True}}
    reference = Pipeline.from_spec("ar", model, overrides={"model": {"compile": True}, "sampling": {"greedy": True}}).generate(
        [1, 2, 3] * 3, 16, seed=0)
    pipe = Pipeline.from_spec("eagle", model, overrides=overrides)
    parts = pipe.drafter.parts
    parts._level = CompiledLevel(parts.net, parts.embed, parts.head, parts.kernel_head, torch.device("cpu"))

    def broken(*args):
        raise RuntimeError("inductor fell over (test)")

    parts._level._level = broken
    with caplog.at_level(logging.WARNING, logger="tokenswift"):
        first = pipe.generate([1, 2, 3] * 3, 16, seed=0)
        second = pipe.generate([1, 2, 3] * 3, 16, seed=0)
    assert first.tokens == second.tokens == reference.tokens and first.stats.compiled
    warnings = [r.getMessage() for r in caplog.records if "draft levels run eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "torch.compile of the draft level failed" in warnings[0]
    assert parts.level() is None


def test_compiled_eagle_with_the_papers_sampling_is_lossless(tmp_path):
    """Compiled target forwards and compiled draft levels, coupled sampling: the
    distribution test of every run (assert_lossless) and ar's tokens for the same seed."""
    from tests.test_eagle import decisive_net

    model = tiny_model_for("llama-gqa", "float32")
    # fixed trees: whether this machine's measured costs make auto trees draft is no part of it
    overrides = {"model": {"compile": True}, "drafter": {"weights": decisive_net(model, tmp_path)},
                 "sampling": {"temperature": 0.8, "top_p": 0.9}, "speculation": {"tree": "fixed"}}
    result = assert_lossless(Pipeline.from_spec("eagle", model, overrides=overrides), [5, 6, 7, 8] * 6, 40, seed=1)
    assert result.stats.compiled and result.stats.accepted_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_staged_kernel_path_of_compiled_forwards_computes_what_the_general_path_does(dtype, monkeypatch):
    """A compiled verify forward's attention takes the fast path (the store's staging
    written and the decode kernel called on its buffers, settled once per forward) where
    the kernel serves it: the trees' logits, the last token's and the committed KV equal
    the general path's bit for bit, and every layer of every forward took it (planted:
    the new keys written one position late fails)."""
    from tokenswift import kernels
    from tokenswift.model import attention

    if not kernels.available():
        pytest.skip("the decode kernel could not be built here")
    model = tiny_model_for("llama-gqa", dtype)
    results, calls = {}, []
    for fast in (False, True):
        monkeypatch.setattr(attention, "FAST_STAGED", fast)
        runner = Runner(model)
        runner.use_compiled(True)
        runner.use_compiled_trees((2, 4, 8))
        if fast:
            original = attention._StagedKernel.__call__
            monkeypatch.setattr(attention._StagedKernel, "__call__", lambda self, *a: calls.append(a[0]) or original(self, *a))
        results[fast] = tree_forwards(runner)
    general, fast = results[False], results[True]
    for want, have in zip(general[0], fast[0]):
        assert torch.equal(have, want)
    assert torch.equal(fast[1], general[1])
    assert all(torch.equal(have, want) for have, want in zip(fast[2], general[2]))
    # every forward the kernel serves (its padded size within the kernel's tokens for this
    # dtype on this CPU, the last one-token forward included), every layer in order
    served = [size for size in (*(runner.compiled_size(len(tokens)) for tokens, _, _ in TREES), 1)
              if size <= kernels.max_tokens(getattr(torch, dtype))]
    layers = model.config.num_hidden_layers
    assert served and calls == list(range(layers)) * len(served)
