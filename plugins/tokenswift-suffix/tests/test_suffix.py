"""The suffix retriever, through tokenswift's public API and its lossless checks."""

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tokenswift import Pipeline
from tokenswift.registry import build_registry, get_plugin_manager
from tokenswift.testing import FIXED_TREE, assert_lossless, looping_model, tiny_model_for, word_tokenizer

pytest.importorskip("tokenswift_suffix", reason="install the plugin: pip install ./plugins/tokenswift-suffix")
from tokenswift_suffix.automaton import SuffixAutomaton  # noqa: E402


def test_registered_by_entry_point_with_its_distribution():
    registry = build_registry(get_plugin_manager())
    info = registry.get("retriever", "suffix")
    assert info.origin == "tokenswift-suffix 0.1.0 (plugin 'suffix')"
    assert registry.preset_origins["suffix"] == info.origin


@pytest.mark.parametrize("seed", range(30))
def test_automaton_finds_the_longest_earlier_match(seed):
    rng = random.Random(seed)
    tokens = [rng.randint(0, 3) for _ in range(rng.randint(2, 60))]
    automaton = SuffixAutomaton()
    for token in tokens:
        automaton.append(token)
    n = len(tokens)
    longest = max(
        (length for length in range(1, n) if any(tokens[e - length + 1 : e + 1] == tokens[n - length :] for e in range(length - 1, n - 1))),
        default=0,
    )
    matches = automaton.matches(10)
    assert (matches[0][0] if matches else 0) == longest
    for length, end in matches:
        assert end < n - 1 and tokens[end - length + 1 : end + 1] == tokens[n - length :]


@pytest.mark.parametrize("drafter", ["none", "tokenswift", "medusa"])
@pytest.mark.parametrize("cache", ["full", "dynamic"])
@settings(max_examples=4, deadline=None)
@given(
    arch=st.sampled_from(["llama-gqa", "qwen2", "looping"]),
    greedy=st.booleans(),
    prompt=st.lists(st.integers(0, 63), min_size=2, max_size=30),
    seed=st.integers(0, 1000),
)
def test_suffix_is_lossless(drafter, cache, arch, greedy, prompt, seed):
    model = looping_model("llama-gqa") if arch == "looping" else tiny_model_for(arch)
    spec = {
        "preset": "suffix",
        "drafter": {"name": drafter} if drafter == "none" else {"name": drafter, "heads": "random", "tree": [2, 2]},
        "cache": {"name": cache} if cache == "full" else {"name": cache, "budget": 12, "sink": 2, "recent": 3},
        "penalty": {"value": 1.3, "window": 6},
        "sampling": {"greedy": True} if greedy else {"temperature": 0.8, "min_p": 0.05},
    }
    assert_lossless(Pipeline.from_spec(spec, model), prompt, 24, seed=seed)


def test_suffix_branches_are_accepted_on_repetitive_text():
    spec = {"preset": "suffix", "sampling": {"greedy": True}, "penalty": {"name": "none"}, **FIXED_TREE}
    result = assert_lossless(Pipeline.from_spec(spec, looping_model()), [1, 2, 3, 4, 5, 6], 60)
    assert result.stats.tokens_per_step > 2 and result.stats.retriever_share == 1.0


def test_bad_option_is_a_clear_error():
    with pytest.raises(ValueError, match=r"retriever.branches must be an integer >= 1, got 0"):
        Pipeline.from_spec({"preset": "suffix", "retriever": {"branches": 0}}, tiny_model_for("llama-mha"))


def test_end_to_end_cli_generation(tmp_path, capsys):
    from tokenswift.cli import main

    model_dir = tmp_path / "model"
    looping_model(dtype="float32").save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    stats = tmp_path / "stats.json"
    code = main(["generate", "--preset", "suffix", "--model", str(model_dir), "--dtype", "float32",
                 "--prompt", "the cat sat on the mat the cat", "--max-new-tokens", "16", "--greedy", "--quiet",
                 "--stats-json", str(stats)])
    assert code == 0, capsys.readouterr().err
    assert '"preset": "suffix"' in stats.read_text()
