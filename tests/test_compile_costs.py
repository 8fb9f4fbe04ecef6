"""What compiling costs a run: graphs that do not depend on the RoPE factor, a ledger of
cold and warm compiles, and ``compile = "auto"`` compiling only the tree graphs a run
can repay (issue 56)."""

import json
import logging

import pytest
import torch

from tokenswift import compile_costs
from tokenswift.compiling import (
    TREE_COMPILE_SHARE, WHOLE_TREES_FROM_TOKENS, CompileCalibration, affordable_tree_sizes, decide, one_token_compile_seconds,
)
from tokenswift.model import compiled as compiled_module
from tokenswift.model.compiled import ANY_SIZE, rope_scaling_as_input
from tokenswift.model.loading import tiny_model
from tokenswift.model.runner import Runner
from tokenswift.records import machine_key
from tokenswift.testing import TINY_CONFIGS

needs_compiler = pytest.mark.skipif(
    compiled_module.compiler_problem(torch.device("cpu")) is not None, reason="no C++ compiler for inductor"
)


@pytest.fixture
def ledger_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    return tmp_path


def yarn_model(factor: float):
    return tiny_model(TINY_CONFIGS["llama-gqa"], dtype="float32", rope={"type": "yarn", "factor": factor})


def test_the_rope_scaling_as_a_buffer_changes_no_output():
    model = yarn_model(2.5)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        before = model(tokens).logits
        assert rope_scaling_as_input(model) == 1
        after = model(tokens).logits
    rotary = model.model.rotary_emb
    assert isinstance(rotary.attention_scaling, torch.Tensor) and "attention_scaling" in dict(rotary.named_buffers())
    assert float(rotary.attention_scaling) == pytest.approx(0.1 * torch.log(torch.tensor(2.5)).item() + 1, rel=1e-6)
    assert torch.equal(before, after)
    assert rope_scaling_as_input(model) == 0  # once


@needs_compiler
def test_a_rope_factor_not_seen_before_finds_the_compiled_graph_in_inductors_cache():
    """The second factor's one-token graph is an FX graph cache hit: nothing compiled
    cold (with the factor baked into the graph as a constant, it was a miss)."""
    from torch._dynamo.utils import counters

    def compile_one(factor):
        runner = Runner(yarn_model(factor))
        runner.use_compiled(True)
        runner.allocate(16)
        runner.prefill(torch.tensor([5, 6, 7, 8]))
        hits, misses = compile_costs.cache_counts()
        compiled = runner.forward(torch.tensor([3])).logits
        runner.use_compiled(False)
        eager = runner.forward(torch.tensor([3])).logits
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
        now_hits, now_misses = compile_costs.cache_counts()
        return now_hits - hits, now_misses - misses

    compile_one(1.5)
    hits, misses = compile_one(3.25)
    assert (hits, misses) == (2, 0)  # the forward and the LM-head row, both from the cache


def test_the_ledger_tells_warm_compiles_from_cold_ones(ledger_home):
    key = compile_costs.graph_key("machine", "tree", 4)
    assert compile_costs.expected_seconds(key) == compile_costs.DEFAULT_COLD_SECONDS
    assert compile_costs.expected_seconds(key, cold_default=40.0) == 40.0
    assert compile_costs.expected_seconds(key, seen=True) == compile_costs.DEFAULT_WARM_SECONDS
    compile_costs.record(key, 91.0, warm=False)
    # seen compiled: inductor keeps its kernels, the next compile is warm
    assert compile_costs.expected_seconds(key) == compile_costs.DEFAULT_WARM_SECONDS
    compile_costs.record(compile_costs.graph_key("machine", "forward", 1), 6.0, warm=True)
    assert compile_costs.expected_seconds(key) == 6.0  # the warm compiles measured here
    compile_costs.record(key, 5.0, warm=True)
    assert compile_costs.expected_seconds(key) == 5.0
    other = compile_costs.graph_key("machine", "tree", 8)
    assert compile_costs.expected_seconds(other) == 91.0  # never compiled: cold, as measured here
    data = json.loads(compile_costs.ledger_path().read_text())
    assert data[key] == {"cold": 91.0, "warm": 5.0}


def test_a_broken_ledger_is_ignored_with_a_warning(ledger_home, caplog):
    path = compile_costs.ledger_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="tokenswift.compile_costs"):
        assert compile_costs.expected_seconds("m/tree/4") == compile_costs.DEFAULT_COLD_SECONDS
    assert "ignoring the compile ledger" in caplog.text
    compile_costs.record("m/tree/4", 3.0, warm=True)  # and rewritten whole
    assert compile_costs.expected_seconds("m/tree/4") == 3.0


def _calibration(step_ms: float, sizes=(2, 4, 8)) -> CompileCalibration:
    return CompileCalibration(
        key="k", machine="m", contexts=(256, 2048), eager_ms=(30.0, 32.0), compiled_ms=(step_ms, step_ms),
        compile_seconds=90.0, tree_sizes=sizes, tree_eager_ms=tuple(40.0 for _ in sizes),
        tree_compiled_ms=tuple(20.0 for _ in sizes), tree_compile_seconds=90.0 * len(sizes),
    )


@needs_compiler
def test_one_tree_graph_of_every_size_is_charged_once(ledger_home, monkeypatch):
    """A run of layers' tree graph traced with the token count symbolic serves every
    tree size: the run pays its compile once, for all the sizes or for none."""
    runner = Runner(tiny_model(TINY_CONFIGS["llama-gqa"], dtype="float32"))
    compiled = runner.use_compiled(True)
    monkeypatch.setattr(compiled, "layered_problem", None)
    assert compiled.one_tree_graph and compiled.tree_graph_name == "layered-tree"
    assert {compiled.graph_tokens("layered-tree", size) for size in (2, 4, 8, 32)} == {ANY_SIZE}
    assert compiled.graph_tokens("tree", 4) == ANY_SIZE and compiled.graph_tokens("layered-tree", 64) == 64
    assert compiled.graph_tokens("tree", 64) == 64
    key = compile_costs.graph_key(machine_key(runner), "layered-tree", ANY_SIZE)
    compile_costs.record(key, 3.0, warm=True)

    def affordable(new_tokens):
        return affordable_tree_sizes(runner, (2, 4, 8), _calibration(step_ms=20.0), context=2048, new_tokens=new_tokens)

    assert affordable(2000) == (2, 4, 8)  # 3 s of the 4 s allowed, once
    assert affordable(1000) == ()  # 2 s allowed: not even the smallest size
    compile_costs.record(key, 5.0, warm=True)
    assert affordable(2000) == ()
    monkeypatch.setattr(compiled, "has_tree_graph", lambda size: True)  # compiled already: free
    assert affordable(100) == (2, 4, 8)


@needs_compiler
@pytest.mark.parametrize("layered", [False, True])
def test_auto_compiles_only_the_tree_graphs_a_run_repays(ledger_home, monkeypatch, caplog, layered):
    """Tree graphs of the whole decoder or of a run of layers (their own name in the
    ledger), a graph per size: each compiled only where the run's share of compiling
    holds its expected cost."""
    runner = Runner(tiny_model(TINY_CONFIGS["llama-gqa"], dtype="float32"))
    compiled = runner.use_compiled(True)
    monkeypatch.setattr(compiled, "layered_problem", None if layered else "whole decoder, for this test")
    monkeypatch.setattr(compiled, "one_tree_graph", False)
    name = compiled.tree_graph_name
    assert name == ("layered-tree" if layered else "tree")
    machine = machine_key(runner)
    calibration = _calibration(step_ms=20.0)
    for size, seconds in ((2, 4.0), (4, 5.0), (8, 6.0)):
        compile_costs.record(compile_costs.graph_key(machine, name, size), seconds, warm=True)

    def affordable(new_tokens):
        return affordable_tree_sizes(runner, (2, 4, 8), calibration, context=2048, new_tokens=new_tokens)

    # 20 ms a step: 2,000 tokens decode in 40 s, of which TREE_COMPILE_SHARE (4 s) may go to compiling
    assert TREE_COMPILE_SHARE * 2000 * 0.020 == pytest.approx(4.0)
    with caplog.at_level(logging.INFO, logger="tokenswift.compiling"):
        assert affordable(2000) == (2,)
    assert "stay eager in this run" in caplog.text
    assert affordable(1000) == ()
    assert affordable(4500) == (2, 4)
    assert affordable(100_000) == (2, 4, 8)
    # a graph this process compiled already costs nothing
    monkeypatch.setattr(compiled, "has_tree_graph", lambda size: size == 8)
    assert affordable(1000) == (8,)
    # never compiled here: expected cold, at what the calibration's cold compiles took
    # (90 s: whole decoders), or for a run of layers at the cold compiles of its kind
    # (none here: DEFAULT_SECONDS), and not repaid
    monkeypatch.setattr(compiled, "has_tree_graph", lambda size: False)
    cold = compile_costs.DEFAULT_SECONDS["layered-tree"][1] if layered else 90.0
    repaid = int(cold / (TREE_COMPILE_SHARE * 0.020))  # tokens whose share of compiling holds it
    assert affordable_tree_sizes(runner, (16,), calibration, context=2048, new_tokens=repaid - 1000) == ()
    assert affordable_tree_sizes(runner, (16,), calibration, context=2048, new_tokens=repaid + 1000) == (16,)


@needs_compiler
def test_a_compile_is_noted_in_the_ledger(ledger_home):
    runner = Runner(tiny_model(TINY_CONFIGS["llama-gqa"], dtype="float32", seed=7))
    compiled = runner.use_compiled(True)
    compiled.ledger_machine = "this-machine"
    runner.allocate(16)
    runner.prefill(torch.tensor([5, 6, 7, 8]))
    runner.forward(torch.tensor([3]))
    data = json.loads(compile_costs.ledger_path().read_text())
    entry = data["this-machine/forward/1"]
    assert set(entry) <= {"warm", "cold"} and len(entry) == 1 and next(iter(entry.values())) > 0
    assert compiled.graph_seconds[("forward", 1)] == pytest.approx(next(iter(entry.values())), abs=0.01)


def test_the_one_token_graphs_are_priced_as_the_forwards_warm_compile(ledger_home):
    """The calibration compiled them, so warm; the LM-head row's graph (~0.1 s) adds
    nothing, where pricing it at the ledger's median warm compile doubled the cost."""
    runner = Runner(tiny_model(TINY_CONFIGS["llama-gqa"], dtype="float32"))
    assert one_token_compile_seconds(runner) == compile_costs.DEFAULT_WARM_SECONDS
    compile_costs.record(compile_costs.graph_key(machine_key(runner), "forward", 1), 6.5, warm=True)
    assert one_token_compile_seconds(runner) == 6.5


def test_graphs_of_a_run_of_layers_are_priced_by_their_own_kind(ledger_home):
    """A tree graph of a run of layers compiles ~10x faster than one of the whole
    decoder: one never compiled here is priced by the layered graphs measured here, or
    by their own defaults, never by the whole decoder's compiles."""
    layered = compile_costs.graph_key("machine", "layered-tree", 8)
    warm, cold = compile_costs.DEFAULT_SECONDS["layered-tree"]
    compile_costs.record(compile_costs.graph_key("machine", "tree", 4), 91.0, warm=False)
    compile_costs.record(compile_costs.graph_key("machine", "forward", 1), 7.0, warm=True)
    assert compile_costs.expected_seconds(layered) == cold
    assert compile_costs.expected_seconds(layered, seen=True) == warm
    compile_costs.record(compile_costs.graph_key("machine", "layered-tree", 4), 6.5, warm=False)
    compile_costs.record(compile_costs.graph_key("machine", "layered-tree", 2), 0.9, warm=True)
    assert compile_costs.expected_seconds(layered) == 6.5
    assert compile_costs.expected_seconds(layered, seen=True) == 0.9
    assert compile_costs.expected_seconds(compile_costs.graph_key("machine", "tree", 8)) == 91.0
    assert compile_costs.expected_seconds(compile_costs.graph_key("machine", "tree", 8), seen=True) == 7.0


@needs_compiler
def test_shorter_runs_verify_through_layered_tree_graphs_longer_ones_through_whole_decoders(ledger_home):
    """A run repays compiling the whole decoder's tree graph (~10x the compile, ~1 ms
    faster forwards) only from WHOLE_TREES_FROM_TOKENS new tokens, and every run takes
    it once it is compiled or stored; the graphs of each kind are compiled and kept
    apart, so a process serving both kinds of run never mixes them."""
    runner = Runner(tiny_model(TINY_CONFIGS["llama-gqa"], dtype="float32", seed=5))
    for new_tokens, name in ((100, "layered-tree"), (WHOLE_TREES_FROM_TOKENS, "tree"), (WHOLE_TREES_FROM_TOKENS - 1, "layered-tree")):
        decision = decide(runner, True, prompt_tokens=8, new_tokens=new_tokens)
        assert decision.compiled and runner.compiled.tree_graph_name == name
    runner.use_compiled_trees((2,))
    runner.allocate(16)
    runner.prefill(torch.tensor([5, 6, 7, 8]))
    runner.forward(torch.tensor([3, 4]), tree_mask=torch.ones(2, 2, dtype=torch.bool).tril())
    assert runner.compiled.has_tree_graph(2)
    runner.compiled.layered_trees = False
    assert not runner.compiled.has_tree_graph(2)  # the whole decoder's graph of every size: not compiled yet
    # once it is (or is in the graph store: `tokenswift calibrate --compile` stores it),
    # runs of every length verify through it
    runner.forward(torch.tensor([3, 4]), tree_mask=torch.ones(2, 2, dtype=torch.bool).tril())
    assert runner.compiled.has_tree_graph(2) and runner.compiled.has_tree_graph(7)
    decision = decide(runner, True, prompt_tokens=8, new_tokens=100)
    assert decision.compiled and runner.compiled.tree_graph_name == "tree"


@needs_compiler
def test_auto_compiles_one_token_steps_by_runs_of_layers_where_the_whole_decoder_would_not_repay(ledger_home, monkeypatch):
    """Eager steps 30 ms, compiled 20 (by runs of layers 6% longer); compiling the whole
    decoder's graph ~7 s, a run of layers' ~1.5 s: 100 tokens stay eager, 512 compile by
    runs of layers, 5,000 the whole decoder; a decoder that cannot run by runs of layers
    stays eager at 512."""
    from tokenswift import compiling

    monkeypatch.setattr(compiling, "AUTO_MIN_PARAMETERS", 0)
    runner = Runner(tiny_model(TINY_CONFIGS["llama-gqa"], dtype="float32", seed=3))
    calibration = _calibration(step_ms=20.0)
    monkeypatch.setattr(compiling, "load_compile_calibration", lambda runner: calibration)
    machine = machine_key(runner)
    compile_costs.record(compile_costs.graph_key(machine, "forward", 1), 7.0, warm=True)
    compile_costs.record(compile_costs.graph_key(machine, "layered-forward", 1), 1.5, warm=True)
    monkeypatch.setattr(compiling.CompiledForward, "ready_for", classmethod(lambda cls, model: False))

    def mode(new_tokens):
        decision = decide(runner, "auto", prompt_tokens=2048 - new_tokens // 2, new_tokens=new_tokens)
        if not decision.compiled:
            return None
        return {"layered-forward": "layered", "forward": "whole"}[runner.compiled.step_graph_name]

    assert [mode(100), mode(512), mode(5000)] == [None, "layered", "whole"]
    monkeypatch.setattr(compiling, "layered_problem", lambda model, decoder: "not alike, for this test")
    assert mode(512) is None


def test_a_tree_trial_compiles_only_what_its_speculative_steps_repay():
    """Speculative steps counted as compiled against plain ones: compile where the rate
    they show saves more than the compile over the tokens left; undecided until
    TRIAL_STEPS speculative steps (or TRIAL_MAX_STEPS of either kind)."""
    from tokenswift.compiling import TRIAL_MAX_STEPS, TRIAL_STEPS, TreeTrial

    def judged(emitted, seconds, compile_seconds=2.0, tokens=2000):
        trial = TreeTrial(compile_seconds=compile_seconds, tokens=tokens)
        for _ in range(4):
            assert trial.observe(1, 0.015, speculative=False) is None
        verdicts = [trial.observe(emitted, seconds, speculative=True) for _ in range(TRIAL_STEPS)]
        assert verdicts[:-1] == [None] * (TRIAL_STEPS - 1)
        return trial, verdicts[-1]

    trial, verdict = judged(2, 0.020)  # 1.5x: ~9.5 s saved over ~1,972 tokens
    assert verdict is True and trial.speedup() == pytest.approx(1.5)
    assert trial.saving_seconds() == pytest.approx((2000 - 4 - 2 * TRIAL_STEPS) * 0.015 / 3)
    assert judged(1, 0.020)[1] is False  # slower than plain steps
    trial, verdict = judged(1.05, 0.015)  # 1.05x: ~1.4 s saved, less than the 2 s compile
    assert verdict is False and 1.0 < trial.saving_seconds() < 2.0
    assert judged(2, 0.020, tokens=120)[1] is False  # too few tokens left to repay it
    never = TreeTrial(compile_seconds=0.5, tokens=2000)
    verdicts = [never.observe(1, 0.015, speculative=False) for _ in range(TRIAL_MAX_STEPS)]
    assert verdicts[-1] is False and set(verdicts[:-1]) == {None}  # no speculative step: nothing to compile
