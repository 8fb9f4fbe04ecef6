"""The graph store (:mod:`tokenswift.model.graph_store`): compiled graphs written once,
loaded by a later process without compiling, computing what they computed for the model
they are given; stored apart where anything they bake in differs; compiled again where
a stored graph does not load or does not take its inputs; priced at their load time.

"A later process" is a new model object: its compiled forwards are a new object with
code objects of their own, so no Dynamo cache of the first compile can serve them, and a
graph that compiled would show in inductor's counters. (``torch._dynamo.reset()`` would
say the same more bluntly, but it also empties the caches of the graphs other tests'
shared tiny models compiled, which then recompiled a graph per tree size, past Dynamo's
recompile limit, in a later test.)
"""

import copy
import logging
import shutil

import pytest
import torch

from tokenswift import Pipeline, compile_costs, compiling
from tokenswift.model import compiled as compiled_module
from tokenswift.model import graph_store
from tokenswift.model.loading import tiny_model
from tokenswift.model.runner import Runner
from tokenswift.testing import TINY_CONFIGS, assert_lossless

pytestmark = pytest.mark.skipif(
    compiled_module.compiler_problem(torch.device("cpu")) is not None, reason="no C++ compiler for inductor"
)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
TREE = (torch.tensor([3, 1, 4, 1, 5]), torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                                   [1, 0, 1, 0, 1]], dtype=torch.bool), torch.tensor([0, 1, 1, 2, 2]))


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store on, in a cache of this test's own; the store's root."""
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    monkeypatch.setenv(graph_store.STORE_ENV, "1")
    return graph_store.store_root()


@pytest.fixture(scope="module")
def stored_once(tmp_path_factory):
    """The graphs of the float32 tiny model (its one-token, LM-head and tree graphs)
    compiled and stored once for this module, in a cache of their own: a test whose
    first process only needs them stored copies them (``filled_store``) instead of
    compiling them again (~5 s each on two cores). Weights are inputs, so they serve a
    model of any seed."""
    root = tmp_path_factory.mktemp("stored-once")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENSWIFT_CACHE", str(root))
        patch.setenv(graph_store.STORE_ENV, "1")
        forwards(model_of(seed=20))
        return graph_store.store_root()


@pytest.fixture
def filled_store(store, stored_once):
    """:func:`store`, holding what a first process stored for the float32 tiny model."""
    shutil.copytree(stored_once, store)
    return store


def model_of(dtype="float32", seed=21, config="llama-gqa", **changes):
    return tiny_model({**TINY_CONFIGS[config], **changes}, seed=seed, dtype=dtype)


def forwards(model, compiled=True):
    """One-token forwards after PROMPT, then a 5-token tree: every logit row; the runner."""
    runner = Runner(model)
    if compiled:
        runner.use_compiled(True)
        runner.use_compiled_trees((2, 4, 8))
    runner.allocate(64)
    with torch.inference_mode():
        runner.prefill(torch.tensor(PROMPT))
        rows = []
        for token in (3, 1, 4):
            rows.append(runner.forward(torch.tensor([token])).logits)
            runner.commit([0])
        tokens, mask, depths = TREE
        rows.append(runner.forward(tokens, tree_mask=mask, depths=depths).logits)
    return torch.cat(rows), runner


def stored_graphs(runner) -> dict[str, bool]:
    """Per graph this runner's compiled forwards called: whether it was loaded from the store."""
    graphs = runner.compiled
    found = {name: graph for name, graph in graphs._graphs.items() if (name, 1) in graphs._ready}
    found.update({f"{name}-{tokens}": getattr(graph, "graph", graph) for (name, tokens), graph in graphs._sized_graphs.items()})
    return {name: graph.loaded for name, graph in found.items()}


def later_process():
    """Nothing to do: each test's later runs use a new model object (see the module docstring)."""


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_later_process_loads_the_stored_graphs_and_computes_with_its_own_weights(store, dtype):
    """The first process compiles and stores the one-token, LM-head and tree graphs; a
    later one loads them all, compiles nothing, and computes what eager forwards of *its*
    model compute (another seed: the weights are the graphs' inputs, never baked in),
    and what the first process's graphs computed for the first model's weights."""
    first = model_of(dtype)
    first_rows, runner = forwards(first)
    identity = runner.compiled.store_identity
    assert sorted(path.name for path in (store / identity).iterdir()) == ["forward-1.bin", "layered-tree-0.bin", "logits-1.bin"]
    assert not any(stored_graphs(runner).values())

    later_process()
    before = compile_costs.cache_counts()
    again_rows, runner = forwards(copy.deepcopy(first))
    assert runner.compiled.store_identity == identity
    assert stored_graphs(runner) == {"forward": True, "logits": True, "layered-tree-0": True}
    assert compile_costs.cache_counts() == before  # inductor compiled nothing
    assert torch.equal(again_rows, first_rows)  # the very graphs

    later_process()
    other = model_of(dtype, seed=22)
    other_rows, runner = forwards(other)
    assert all(stored_graphs(runner).values())
    eager_rows, _ = forwards(other, compiled=False)
    torch.testing.assert_close(other_rows, eager_rows, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(other_rows, first_rows, rtol=1e-2, atol=1e-2)


GREEDY, SAMPLED = {"greedy": True}, {"temperature": 0.8, "top_p": 0.9}


@pytest.mark.parametrize(("preset", "sampling"), [
    ("tokenswift", GREEDY), ("eagle", SAMPLED),
    pytest.param("tokenswift", SAMPLED, marks=pytest.mark.slow), pytest.param("eagle", GREEDY, marks=pytest.mark.slow),
])
def test_runs_through_stored_graphs_are_lossless(store, preset, sampling):
    """A run in a later process, its forwards through loaded graphs: the target's tokens,
    greedy and sampled, as in the process that stored them."""
    drafter = {"eagle": {"weights": "random"}, "tokenswift": {"heads": "random"}}[preset]
    # fixed trees: every step verifies a tree, whatever this machine's costs would choose
    overrides = {"model": {"compile": True}, "sampling": sampling, "drafter": drafter,
                 "speculation": {"tree": "fixed", "max_nodes": 8}}
    first = model_of("float64", seed=23)
    stored = assert_lossless(Pipeline.from_spec(preset, first, overrides=overrides), [5, 6, 7, 8] * 6, 40, seed=1)
    later_process()
    pipe = Pipeline.from_spec(preset, copy.deepcopy(first), overrides=overrides)
    result = assert_lossless(pipe, [5, 6, 7, 8] * 6, 40, seed=1)
    assert result.tokens == stored.tokens and result.stats.compiled
    loaded = stored_graphs(pipe.runner)
    assert loaded.get("layered-tree-0") and all(loaded.values()), loaded  # every graph the run called was loaded
    if preset == "eagle":  # and the draft layer's levels
        levels = pipe.drafter.parts.level()._graphs
        assert levels and all(graph.loaded for graph in levels.values())


def test_what_a_graph_bakes_in_stores_it_apart_and_a_new_rope_factor_does_not(store):
    """The dtype, the model's shape and the products' kind each make a graph of their
    own; a RoPE type and factor, which only buffers carry, do not (a 16K prompt with
    YaRN at a factor not seen before loads the graphs stored without it); a RoPE type
    that recomputes its frequencies from the length in the forward keeps its factor."""
    def identity(model, kernel_linears=False):
        return compiled_module.store_identity(model, torch.float32, kernel_linears)

    base = model_of("float32")
    assert identity(base) == identity(model_of("float32", seed=24))  # weights are inputs
    assert identity(base) != identity(model_of("float64"))
    assert identity(base) != identity(model_of("float32", config="qwen2"))
    assert identity(base) != identity(base, kernel_linears=True)
    assert identity(base) != compiled_module.store_identity(base, torch.float64, False)

    def with_rope(rope):
        model = copy.deepcopy(base)
        model.config.rope_scaling = rope
        model.config.max_position_embeddings = 4096 * int(rope.get("factor", 1))
        return model

    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    assert identity(with_rope(yarn)) == identity(with_rope({**yarn, "factor": 4.0})) == identity(base)
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert identity(with_rope(dynamic)) != identity(with_rope({**dynamic, "factor": 4.0}))


def test_the_store_can_be_turned_off(store, monkeypatch):
    monkeypatch.setenv(graph_store.STORE_ENV, "0")
    rows, runner = forwards(model_of(seed=25))
    assert runner.compiled.store_identity is None and not store.exists()
    eager_rows, _ = forwards(model_of(seed=25), compiled=False)
    torch.testing.assert_close(rows, eager_rows, rtol=1e-4, atol=1e-4)


def test_a_stored_graph_that_does_not_load_is_compiled_again_and_replaced(filled_store, caplog):
    store = filled_store
    model = model_of(seed=26)
    rows, runner = forwards(model)
    assert all(stored_graphs(runner).values())  # loaded: what a first process stored
    path = store / runner.compiled.store_identity / "forward-1.bin"
    path.write_bytes(b"not a graph")
    later_process()
    with caplog.at_level(logging.WARNING, logger="tokenswift.model.graph_store"):
        again, runner = forwards(copy.deepcopy(model))
    assert "did not load" in caplog.text and str(path) in caplog.text
    assert not stored_graphs(runner)["forward"]
    assert torch.equal(again, rows)
    later_process()
    _, runner = forwards(copy.deepcopy(model))  # the replacement loads
    assert all(stored_graphs(runner).values())


def test_a_stored_graph_whose_guards_refuse_its_inputs_is_compiled_again(filled_store, caplog):
    """A tree graph stored for another hidden size, found where this model's belongs
    (loads, as its code is the same): its guards refuse this model's tensors at the
    first call, so it is removed, compiled again for this model and stored; the
    forwards are this model's."""
    store = filled_store
    small, large = model_of(seed=27), model_of(seed=27, hidden_size=64)
    _, small_runner = forwards(small)
    _, large_runner = forwards(large)
    small_dir = store / small_runner.compiled.store_identity
    large_dir = store / large_runner.compiled.store_identity
    assert small_dir != large_dir
    (small_dir / "layered-tree-0.bin").write_bytes((large_dir / "layered-tree-0.bin").read_bytes())
    later_process()
    with caplog.at_level(logging.WARNING, logger="tokenswift.model.graph_store"):
        rows, runner = forwards(copy.deepcopy(small))
    assert "does not take these inputs" in caplog.text
    assert stored_graphs(runner) == {"forward": True, "logits": True, "layered-tree-0": False}
    eager_rows, _ = forwards(small, compiled=False)
    torch.testing.assert_close(rows, eager_rows, rtol=1e-4, atol=1e-4)
    later_process()
    _, runner = forwards(copy.deepcopy(small))  # stored anew, for this model
    assert all(stored_graphs(runner).values())


def test_stored_graphs_are_priced_at_their_load_time_and_their_trees_need_no_trial(store, monkeypatch):
    """What compile = "auto" expects a graph to cost: its load time where it is stored
    (the ledger's, else the default), a warm compile's where not; a run whose missing
    tree graphs are all stored loads them at once, without verifying trees eagerly on
    trial first."""
    model = model_of(seed=28)
    runner = Runner(copy.deepcopy(model))  # a later process's model, never compiled before it prices
    machine = compiling.machine_key(runner)
    assert compiling.one_token_compile_seconds(runner) == compile_costs.expected_seconds(
        compile_costs.graph_key(machine, "forward", 1), seen=True)
    forwards(model)  # stores its graphs
    monkeypatch.setattr(graph_store, "_prepared", True)  # this process has loaded a stored graph before
    assert compiling.one_token_compile_seconds(runner) == compile_costs.DEFAULT_STORED_SECONDS
    compile_costs.record(compile_costs.graph_key(machine, "forward", 1), 0.04, warm=True, stored=True)
    assert compiling.one_token_compile_seconds(runner) == 0.04
    # in a process that has not, what the compiler stack's imports took too (once, not per graph)
    monkeypatch.setattr(graph_store, "_prepared", False)
    compile_costs.record(compile_costs.graph_key(machine, compiled_module.STORE_IMPORTS, 0), 1.1, warm=True, stored=True)
    assert compiling.one_token_compile_seconds(runner) == pytest.approx(1.14)

    monkeypatch.setattr(compiling, "_auto_mode", lambda *args: "whole")
    monkeypatch.setattr(compiling, "tree_sizes", lambda *args: (2, 4, 8))
    later_process()
    runner = Runner(copy.deepcopy(model))
    compiling.decide(runner, "auto", prompt_tokens=24, new_tokens=2000, prices_trees=True)
    assert runner.compiled_tree_sizes == (2, 4, 8) and runner.tree_trial is None
    # the same run without the store, its trees taken as affordable: they go on trial
    monkeypatch.setenv(graph_store.STORE_ENV, "0")
    monkeypatch.setattr(compiling, "affordable_tree_sizes", lambda runner, sizes, *args, **kwargs: sizes)
    runner = Runner(model_of(seed=29))
    compiling.decide(runner, "auto", prompt_tokens=24, new_tokens=2000, prices_trees=True)
    assert runner.tree_trial is not None



def test_graphs_stored_without_rope_scaling_compute_a_yarn_models_forwards(filled_store):
    """The graphs stored for a model without RoPE scaling, loaded for the same weights
    with YaRN at a factor never seen: the forwards are the YaRN model's (its rotary
    tables and attention scaling are the graphs' inputs), not the unscaled model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = model_of(seed=30)
    plain_rows, _ = forwards(plain)
    config = AutoConfig.for_model(**{**TINY_CONFIGS["llama-gqa"], "max_position_embeddings": 2048,
                                     "rope_scaling": {"rope_type": "yarn", "factor": 3.3, "original_max_position_embeddings": 16}})
    yarn = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    yarn.load_state_dict(plain.state_dict(), strict=False)
    later_process()
    rows, runner = forwards(yarn)
    assert all(stored_graphs(runner).values())
    eager_rows, _ = forwards(yarn, compiled=False)
    torch.testing.assert_close(rows, eager_rows, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(rows, plain_rows, rtol=1e-3, atol=1e-3)


def test_calibrate_stores_the_graphs_every_later_run_loads(store, model_dir, capsys):
    """`tokenswift calibrate --compile` stores the graphs it compiles and says where:
    with the whole decoder's tree graph of every size, which later runs of any length
    then verify through (loaded, not compiled), as the calibration timed them."""
    from tokenswift.cli import main
    from tokenswift.spec import ModelSpec
    from tokenswift.model.loading import load_model

    code = main(["calibrate", "--model", str(model_dir), "--dtype", "float32", "--compile"])
    _, err = capsys.readouterr()
    assert code == 0, err
    (directory,) = store.iterdir()
    assert {"forward-1", "layered-forward-1", "logits-1", "tree-0"} <= {path.stem for path in directory.glob("*.bin")}
    assert f"compiled graphs stored in {directory}" in err
    runner = Runner(load_model(ModelSpec(path=str(model_dir), dtype="float32"))[0])  # a later process's model
    assert compiling.decide(runner, True, prompt_tokens=8, new_tokens=100).compiled
    assert runner.compiled.tree_graph_name == "tree"
    assert compiling.load_compile_calibration(runner).tree_graph == "tree"
