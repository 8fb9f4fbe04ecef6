"""The lossless contract: every component combination emits what AR decoding emits."""

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tokenswift import Pipeline
from tokenswift.testing import FIXED_TREE, assert_lossless, looping_model, tiny_model_for

DRAFTERS = {
    "none": {"name": "none"},
    "tokenswift": {"name": "tokenswift", "heads": "random", "tree": [2, 2, 2, 1]},
    "medusa": {"name": "medusa", "heads": "random", "tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]},
    "eagle": {"name": "eagle", "weights": "random", "depth": 3, "width": 2, "children": 2, "threshold": 0.0},
    "eagle-pass": {"name": "eagle", "weights": "random", "depth": 3, "width": 2, "children": 2, "threshold": 0.0, "root_pass": True},
}
RETRIEVERS = {
    "none": {"name": "none"},
    "ngram": {"name": "ngram", "top_k": 5},
    "prompt-lookup": {"name": "prompt-lookup", "num_tokens": 4},
}
# Small budgets, so that partial views and refreshes happen within a test.
CACHES = {
    "full": {"name": "full"},
    "dynamic": {"name": "dynamic", "budget": 14, "sink": 2, "recent": 4},
    "streaming": {"name": "streaming", "budget": 12, "sink": 2, "recent": 3},
}
PENALTIES = {"off": {"name": "none"}, "on": {"name": "contextual", "value": 1.5, "window": 8}}
SAMPLINGS = [
    {"greedy": True},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    {"eta": 0.01},
    {"temperature": 1.0, "min_p": 0.1, "sampler": "inverse-cdf"},  # what format-1 checkpoints resume with
]


@st.composite
def prompts(draw, vocab=64):
    """Prompts with repetition (a motif repeated, with noise), so reuse branches hit."""
    motif = draw(st.lists(st.integers(0, vocab - 1), min_size=2, max_size=6))
    repeats = draw(st.integers(1, 5))
    noise = draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    return (motif * repeats + noise)[:40] or motif


COMBINATIONS = list(itertools.product(DRAFTERS, RETRIEVERS, CACHES, PENALTIES))


@pytest.mark.parametrize(("drafter", "retriever", "cache", "penalty"), COMBINATIONS)
@settings(max_examples=3, deadline=None)
@given(
    arch=st.sampled_from(["llama-mha", "llama-gqa", "qwen2", "looping"]),
    dtype=st.sampled_from(["float32", "float64"]),
    sampling=st.sampled_from(SAMPLINGS),
    # auto trees with the plain guard (timings may then pick plain steps) and without it,
    # and with drafting passes left to the pass chooser whatever they cost (a tiny model's
    # forwards cost about the same over the view as over the context: no pass would run)
    speculation=st.sampled_from([{"tree": "auto"}, {"tree": "auto", "plain_guard": False},
                                 {"tree": "auto", "plain_guard": False, "pass_gain": 1000}, {"tree": "fixed"}]),
    prompt=prompts(),
    seed=st.integers(0, 2**31),
)
def test_every_combination_is_lossless(drafter, retriever, cache, penalty, arch, dtype, sampling, speculation, prompt, seed):
    spec = {
        "preset": "ar",
        "drafter": DRAFTERS[drafter],
        "retriever": RETRIEVERS[retriever],
        "cache": CACHES[cache],
        "penalty": PENALTIES[penalty],
        "sampling": sampling,
        "speculation": speculation,
    }
    model = looping_model("llama-gqa", dtype) if arch == "looping" else tiny_model_for(arch, dtype)
    assert_lossless(Pipeline.from_spec(spec, model), prompt, 24, seed=seed)


@pytest.mark.parametrize("preset", ["ar", "tokenswift", "medusa", "eagle", "prompt-lookup"])
@pytest.mark.parametrize("greedy", [True, False])
def test_presets_are_lossless(preset, greedy):
    overrides = {"cache": CACHES["dynamic"]} if preset == "tokenswift" else {}
    if preset == "eagle":
        overrides["drafter"] = {"weights": "random"}
    if greedy:
        overrides["sampling"] = {"greedy": True}
    pipe = Pipeline.from_spec(preset, tiny_model_for("llama-gqa"), overrides=overrides)
    assert_lossless(pipe, [5, 6, 7, 8] * 6, 40, seed=1)


@pytest.mark.parametrize("retriever", ["ngram", "prompt-lookup"])
def test_retriever_branches_are_taken_and_accepted(retriever):
    """The machinery is exercised for real: retrieved tokens get accepted, losslessly."""
    spec = {"preset": "ar", "retriever": RETRIEVERS[retriever], "sampling": {"greedy": True}, "penalty": {"name": "none"}, **FIXED_TREE}
    pipe = Pipeline.from_spec(spec, looping_model())
    result = assert_lossless(pipe, [1, 2, 3, 4, 5, 6], 40)
    assert result.stats.accepted_tokens > 10
    assert result.stats.retriever_share == 1.0
    assert result.stats.tokens_per_step > 1.5


def test_tokenswift_depth_one_is_always_right_with_a_full_cache_under_greedy():
    """With the paper's fixed tree (a drafting pass every step), its depth-1 guess is the
    model's own next token, so >= 2 tokens per step."""
    spec = {
        "preset": "tokenswift",
        "cache": {"name": "full"},
        "sampling": {"greedy": True},
        "penalty": {"name": "none"},
        "speculation": {"tree": "fixed"},
    }
    pipe = Pipeline.from_spec(spec, tiny_model_for("llama-gqa"))
    result = assert_lossless(pipe, [3, 1, 4, 1, 5, 9, 2, 6], 40)
    assert min(result.stats.tokens_per_step_histogram) >= 2 or result.stats.steps == 1
    assert result.stats.acceptance_rate > 0.25


@pytest.fixture(scope="module")
def fused_eagle(tmp_path_factory):
    """An eagle network that fuses the inner layer's output with the final-norm state
    (random, decisive weights), for the tiny float64 llama-gqa model."""
    import torch

    from tokenswift.drafters.feature_net import FeatureNet

    model = tiny_model_for("llama-gqa", "float64")
    net = FeatureNet.for_model(model).initialise(seed=5, std=0.3).with_fused_layers((1,))
    with torch.no_grad():
        net.reduce.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(6))
    directory = tmp_path_factory.mktemp("fused-eagle")
    net.save_pretrained(directory)
    return str(directory)


@settings(max_examples=6, deadline=None)
@given(
    retriever=st.sampled_from(sorted(RETRIEVERS)),
    sampling=st.sampled_from(SAMPLINGS),
    tree=st.sampled_from(["auto", "fixed"]),
    prompt=prompts(),
    seed=st.integers(0, 2**31),
)
def test_an_eagle_drafter_on_fused_features_is_lossless(fused_eagle, retriever, sampling, tree, prompt, seed):
    spec = {
        "preset": "eagle", "drafter": {"weights": fused_eagle, "threshold": 0.0}, "retriever": RETRIEVERS[retriever],
        "sampling": sampling, "speculation": {"tree": tree},
    }
    assert_lossless(Pipeline.from_spec(spec, tiny_model_for("llama-gqa", "float64")), prompt, 24, seed=seed)


@settings(max_examples=6, deadline=None)
@given(
    preset=st.sampled_from(["eagle", "medusa", "prompt-lookup"]),
    sampling=st.sampled_from(SAMPLINGS),
    prompt=prompts(),
    seed=st.integers(0, 2**31),
)
def test_compiled_tree_verify_forwards_are_lossless(preset, sampling, prompt, seed):
    """compile = true: one-token forwards and trees (padded to 2/4/8/16/32) compiled."""
    from tokenswift.model.compiled import compiler_problem
    import torch

    if compiler_problem(torch.device("cpu")) is not None:
        pytest.skip("no C++ compiler for inductor")
    drafter = {"eagle": {"weights": "random"}, "medusa": {"heads": "random"}}.get(preset)
    spec = {"preset": preset, "model": {"compile": True}, "sampling": sampling, "speculation": {"tree": "fixed"},
            **({"drafter": drafter} if drafter else {})}
    pipe = Pipeline.from_spec(spec, tiny_model_for("llama-gqa", "float32"))
    assert_lossless(pipe, prompt, 24, seed=seed)
    assert pipe.runner.compiled_tree_sizes


@settings(max_examples=6, deadline=None)
@given(
    preset=st.sampled_from(["eagle", "medusa", "prompt-lookup", "tokenswift"]),
    sampling=st.sampled_from(SAMPLINGS),
    prompt=prompts(),
    seed=st.integers(0, 2**31),
)
def test_kernel_linears_are_lossless(preset, sampling, prompt, seed):
    """Products of a few rows through tokenswift's kernel (forced, whatever this CPU's
    default): steps, trees, drafting passes and LM-head rows."""
    from tokenswift import kernels

    if not kernels.available():
        pytest.skip("the kernels cannot be built here")
    drafter = {"eagle": {"weights": "random"}, "medusa": {"heads": "random"}, "tokenswift": {"heads": "random"}}.get(preset)
    spec = {"preset": preset, "sampling": sampling, "speculation": {"tree": "fixed"}, **({"drafter": drafter} if drafter else {})}
    pipe = Pipeline.from_spec(spec, tiny_model_for("llama-gqa", "float32"))
    pipe.runner.use_kernel_linears(True)
    assert_lossless(pipe, prompt, 24, seed=seed)
