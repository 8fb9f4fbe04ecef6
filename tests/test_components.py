"""Component behaviour: heads, tree templates, n-gram table, drafting caches."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from tokenswift import ModelLoadError, Pipeline, SpecError
from tokenswift.caches.dynamic import DynamicPolicy
from tokenswift.drafters.draft_heads import DraftHeads, model_fingerprint
from tokenswift.drafters.template import index_paths
from tokenswift.interfaces import DecodeState
from tokenswift.model.kv import CompactView
from tokenswift.testing import looping_model, reference_generate, tiny_model_for
from tokenswift.tree import DraftTree

# -- heads -------------------------------------------------------------------------


def test_heads_round_trip_through_safetensors(tmp_path):
    model = tiny_model_for("llama-gqa")
    heads = DraftHeads.random(model, num_heads=3, seed=5, std=0.3)
    heads.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_heads"] == 3 and config["fingerprint"] == model_fingerprint(model)
    loaded = DraftHeads.from_pretrained(tmp_path, model)
    hidden = torch.randn(4, 32, dtype=torch.float64)
    torch.testing.assert_close(loaded.logits(hidden, model.lm_head), heads.logits(hidden, model.lm_head))
    assert heads.logits(hidden, model.lm_head).shape == (4, 3, 64)


def test_heads_made_for_another_model_are_refused(tmp_path):
    DraftHeads.random(tiny_model_for("llama-gqa")).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="made for another model: fingerprint"):
        DraftHeads.from_pretrained(tmp_path, tiny_model_for("llama-gqa", seed=1))
    with pytest.raises(ModelLoadError, match="made for another model"):
        Pipeline.from_spec({"preset": "tokenswift", "drafter": {"heads": str(tmp_path)}}, tiny_model_for("qwen2", seed=3))
    with pytest.raises(ModelLoadError, match="no draft heads at"):
        DraftHeads.from_pretrained(tmp_path / "missing")


def test_identity_initialised_heads_repeat_the_lm_head_guess():
    model = tiny_model_for("llama-mha")
    heads = DraftHeads.for_model(model, num_heads=2)
    hidden = torch.randn(3, 32, dtype=torch.float64)
    per_head = heads.logits(hidden, model.lm_head).argmax(-1)
    base = model.lm_head(hidden).argmax(-1)
    assert torch.equal(per_head[:, 0], base) and torch.equal(per_head[:, 1], base)


# -- trees and templates --------------------------------------------------------------


def test_default_template_is_1_3_9_27():
    paths = index_paths([1, 3, 3, 3])
    assert [sum(len(p) == d for p in paths) for d in (1, 2, 3, 4)] == [1, 3, 9, 27]


@pytest.mark.parametrize("bad", [[], [1, 0], "133", [[0], []], [[0, -1]], [1, [0]], 3])
def test_malformed_templates(bad):
    with pytest.raises(SpecError, match="drafter.tree"):
        index_paths(bad)


def test_template_deeper_than_the_heads_is_refused():
    with pytest.raises(SpecError, match=r"is 5 deep, but 'tokenswift' with 3 heads drafts at most 4"):
        Pipeline.from_spec({"preset": "tokenswift", "drafter": {"tree": [1, 1, 1, 1, 1]}}, tiny_model_for("llama-mha"))


def test_draft_tree_merges_duplicate_branches_and_derives_mask_and_paths():
    tree = DraftTree.from_branches(9, [[1, 2], [1, 3], [4]])
    tree.add_branches([[1, 2, 5], [4]], source=1)
    assert tree.tokens == [9, 1, 2, 3, 4, 5] and tree.parents == [-1, 0, 1, 1, 0, 2]
    assert tree.depths == [0, 1, 2, 2, 1, 3] and tree.sources == [0, 0, 0, 0, 0, 1]
    assert sorted(tree.paths()) == [[1, 2, 5], [1, 3], [4]]
    mask = tree.mask()
    assert mask[5].tolist() == [True, True, True, False, False, True]
    assert mask[4].tolist() == [True, False, False, False, True, False]


# -- n-gram table -----------------------------------------------------------------------


def build(spec, model=None):
    return Pipeline.from_spec(spec, model or tiny_model_for("llama-mha"))


def test_ngram_table_holds_only_ngrams_that_left_the_penalty_window():
    pipe = build({"preset": "tokenswift", "penalty": {"window": 4}})
    retriever = pipe.retriever
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 6, 7, 8, 9]
    retriever.start(DecodeState(tokens=list(tokens), prompt_length=len(tokens)))
    # n-grams wholly before the last 4 tokens: starts 0..4 of tokens[:8]
    assert retriever.fed == 5
    assert retriever.continuations(1) == [(2, 3, 4), (2, 3, 5)]
    assert retriever.continuations(6) == []
    tokens += [10]
    retriever.observe(DecodeState(tokens=tokens, prompt_length=12), None)
    assert retriever.continuations(2) == [(3, 4, 1), (3, 5, 6)]


def test_ngram_ranks_by_count_and_keys_on_depth_one_candidates():
    pipe = build({"preset": "tokenswift", "penalty": {"name": "none"}, "retriever": {"top_k": 2}})
    tokens = [0, 7, 1, 1, 1, 7, 2, 2, 2, 7, 2, 2, 2, 7, 3, 3, 3, 0]
    state = DecodeState(tokens=tokens, prompt_length=len(tokens))
    pipe.retriever.start(state)
    branches = pipe.retriever.retrieve(state, [7])
    assert [list(b.tokens) for b in branches] == [[7, 2, 2, 2], [7, 1, 1, 1]]
    # a continuation's first token is as likely as its share of the key's n-grams
    assert [b.confidence for b in branches] == [[None, 2 / 4, None, None], [None, 1 / 4, None, None]]  # of 4 n-grams after 7
    keyed_on_root = pipe.retriever.retrieve(state, [])
    assert [list(b.tokens) for b in keyed_on_root] == [[7, 1, 1]]  # keyed on the root (token 0)


def test_ngram_proposes_the_windows_ngrams_after_the_tables_with_no_estimate():
    """A loop inside the penalty window: the paper's rule (``recent = false``) has nothing
    to reuse; by default its n-grams come after the table's, with no confidence."""
    tokens = [1, 2, 3, 4, 5] + [8, 9] * 6
    state = DecodeState(tokens=tokens, prompt_length=len(tokens))
    paper = build({"preset": "tokenswift", "penalty": {"window": 16}, "retriever": {"recent": False}}).retriever
    paper.start(state)
    assert paper.retrieve(state, []) == [] and paper.retrieve(state, [8]) == []
    retriever = build({"preset": "tokenswift", "penalty": {"window": 16}}).retriever
    retriever.start(state)
    assert [(list(b.tokens), b.confidence) for b in retriever.retrieve(state, [])] == [([8, 9, 8], [None] * 3)]
    assert [list(b.tokens) for b in retriever.retrieve(state, [8])] == [[8, 9, 8, 9]]
    # once older than the window, an n-gram is the table's (with its share), not proposed twice
    tokens = tokens + [6] * 9
    retriever.observe(DecodeState(tokens=tokens, prompt_length=len(state.tokens)), None)
    assert [(list(b.tokens), b.confidence) for b in retriever.retrieve(DecodeState(tokens=tokens[:-9] + [8], prompt_length=1), [])] == [
        ([9, 8, 9], [1.0, None, None]), ([9, 6, 6], [None, None, None])
    ]
    assert [list(b.tokens) for b in retriever.retrieve(DecodeState(tokens=tokens, prompt_length=1), [])] == [[6, 6, 6]]


@settings(max_examples=40, deadline=None)
@given(text=st.lists(st.integers(0, 4), min_size=0, max_size=40), steps=st.lists(st.integers(1, 5), max_size=8),
       window=st.integers(0, 12))
def test_ngram_table_and_window_hold_every_ngram_once_as_the_text_grows(text, steps, window):
    """Every n-gram of the text is counted once: in the table when all its tokens have
    left the penalty window, else among the window's (planted: an n-gram left in the
    window's counts as it joins the table fails)."""
    import collections

    pipe = build({"preset": "tokenswift", "penalty": {"window": max(window, 1)}})
    retriever, n = pipe.retriever, 4
    tokens = list(text)
    retriever.start(DecodeState(tokens=list(tokens), prompt_length=len(tokens)))
    for extra in [0, *steps]:
        tokens += [(len(tokens) * 7 + i) % 5 for i in range(extra)]
        retriever.observe(DecodeState(tokens=list(tokens), prompt_length=len(text)), None)
        limit = len(tokens) - max(window, 1) - n
        expected_table, expected_recent = collections.Counter(), collections.Counter()
        for start in range(len(tokens) - n + 1):
            (expected_table if start <= limit else expected_recent)[(tokens[start], tuple(tokens[start + 1 : start + n]))] += 1
        have_table = collections.Counter({(k, c): v for k, counts in retriever.table.items() for c, v in counts.items() if v})
        have_recent = collections.Counter({(k, c): v for k, counts in retriever.recent.items() for c, v in counts.items() if v})
        assert have_table == expected_table and have_recent == expected_recent


def test_prompt_lookup_continues_the_latest_match():
    pipe = build({"preset": "prompt-lookup", "retriever": {"num_tokens": 3}})
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6]
    state = DecodeState(tokens=tokens, prompt_length=len(tokens))
    assert pipe.retriever.retrieve(state, []) == [[8, 2, 9]]


# -- drafting caches ---------------------------------------------------------------------


def prefilled(model, tokens, capacity=64):
    pipe = Pipeline.from_spec(
        {"preset": "tokenswift", "cache": {"budget": 12, "sink": 2, "recent": 4}, "sampling": {"greedy": True}}, model
    )
    pipe.runner.allocate(capacity)
    pipe.runner.prefill(torch.tensor(tokens[:-1]))
    state = DecodeState(tokens=list(tokens), prompt_length=len(tokens))
    pipe.cache_policy.start(state)
    return pipe, state


@pytest.mark.parametrize(("arch", "block"), [("llama-mha", 4096), ("llama-gqa", 4096), ("qwen2", 4096), ("llama-gqa", 7)])
def test_dynamic_selection_equals_brute_force_attention_top_k(arch, block, monkeypatch):
    from tokenswift.model import plan

    monkeypatch.setattr(plan, "RECORD_BLOCK", block)  # 7: the recorder's keys in blocks, a ragged last one
    model = tiny_model_for(arch)
    tokens = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    pipe, state = prefilled(model, tokens)
    selected = pipe.cache_policy.select(state, pipe.runner.store.length)  # [layers, kv_heads, 8]
    # Brute force: transformers' eager attention over the whole sequence, last row.
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            attentions = model(torch.tensor([tokens]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation("tokenswift")
    kv_heads = model.config.num_key_value_heads
    for layer, attention in enumerate(attentions):
        last = attention[0, :, -1, : len(tokens) - 1]  # [q_heads, committed]
        per_kv = last.view(kv_heads, -1, last.shape[-1]).sum(1)
        expected = per_kv[:, 2:].topk(8 - 2, dim=-1).indices + 2
        for head in range(kv_heads):
            assert set(selected[layer, head, :2].tolist()) == {0, 1}
            assert set(selected[layer, head, 2:].tolist()) == set(expected[head].tolist())


def test_dynamic_view_adapts_to_short_prompts_then_refreshes_when_the_window_fills():
    model = tiny_model_for("llama-gqa")
    pipe, state = prefilled(model, list(range(1, 11)))  # 9 committed < budget 12
    policy = pipe.cache_policy
    assert policy.update_view(state) is None  # the whole context fits the budget
    sizes, refreshes = [], []
    for step in range(12):
        pipe.runner.forward(torch.tensor([state.tokens[-1]]))
        pipe.runner.commit([0])
        state.tokens.append(step % 7)
        view = policy.update_view(state)
        sizes.append(pipe.runner.store.length if view is None else view.size)
        refreshes.append(policy.refreshes)
    committed = [10 + i for i in range(12)]
    assert [s for s, c in zip(sizes, committed) if c <= 12] == [c for c in committed if c <= 12]
    # Beyond the budget: 8 selected + up to 4 recent, reselected when they are full.
    assert sizes[3:] == [8, 9, 10, 11, 12, 8, 9, 10, 11]
    assert refreshes[-1] == 2


def test_compact_view_matches_an_index_gather():
    model = tiny_model_for("llama-gqa")
    pipe, state = prefilled(model, list(range(20)))
    store = pipe.runner.store
    view = CompactView(store, 10)
    view.load(store, torch.tensor([0, 3, 4, 9]))
    view.append(store, 15, 18)
    keys, values = view.contents(1)
    positions = torch.tensor([0, 3, 4, 9, 15, 16, 17])
    assert torch.equal(keys, store.keys[1][:, :, positions]) and torch.equal(values, store.values[1][:, :, positions])


def test_compact_view_loads_each_kv_heads_own_positions():
    model = tiny_model_for("llama-gqa")
    pipe, state = prefilled(model, list(range(20)))
    store = pipe.runner.store
    layers, heads = store.num_layers, store.kv_heads
    generator = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.stack([torch.randperm(19, generator=generator)[:5].sort().values for _ in range(heads)])
                           for _ in range(layers)])  # [layers, kv_heads, 5]: each head its own positions
    view = CompactView(store, 8)
    view.load(store, indices)
    view.append(store, 15, 18)
    for layer in range(layers):
        keys, values = view.contents(layer)
        for head in range(heads):
            positions = torch.cat([indices[layer, head], torch.tensor([15, 16, 17])])
            assert torch.equal(keys[0, head], store.keys[layer][0, head, positions])
            assert torch.equal(values[0, head], store.values[layer][0, head, positions])


@pytest.mark.parametrize("cache", ["full", "dynamic", "streaming"])
def test_drafting_never_writes_into_the_committed_kv(cache):
    spec = {
        "preset": "tokenswift",
        "cache": {"name": cache} if cache == "full" else {"name": cache, "budget": 12, "sink": 2, "recent": 4},
        "sampling": {"greedy": True},
        "speculation": {"plain_guard": False},  # the guard measures plain steps first: the first step would not draft
    }
    pipe = Pipeline.from_spec(spec, looping_model())
    tokens = list(range(1, 30))
    run = pipe.start(tokens, 8)
    run.prefill()
    store = pipe.runner.store
    committed = store.length
    before = [t[:, :, :committed].clone() for t in store.keys + store.values]
    tree, _drafted, _drafting_pass = run.propose()
    assert len(tree) > 1 and store.staged == 0 and store.length == committed == len(tokens) - 1
    for old, new in zip(before, store.keys + store.values):
        assert torch.equal(old, new[:, :, :committed])


def test_dynamic_is_the_default_of_the_tokenswift_preset():
    pipe = build("tokenswift")
    assert isinstance(pipe.cache_policy, DynamicPolicy) and pipe.cache_policy.options.budget == 4096
    assert pipe.max_tree_nodes() == 1 + 40 + 2 * 20 * 4  # the n-grams of the table and of the window


@pytest.mark.parametrize("penalize", [True, False])
def test_tokenswift_ranks_depth_one_with_the_penalty_verification_applies(penalize):
    """The looping model's raw next token is one it just produced; a strong penalty
    demotes it, so the root's likely draw is another token. With ``penalize`` the
    depth-1 candidate is that draw (the penalised argmax), without it the raw argmax."""
    model = looping_model()
    prompt = reference_generate(model, [5, 6, 7], 24)[-16:]  # the greedy cycle
    ids = torch.tensor([prompt])
    raw = model(ids).logits[0, -1:]
    penalised = RepetitionPenaltyLogitsProcessor(50.0)(ids[:, -8:], raw.clone())
    assert raw.argmax() != penalised.argmax(), "precondition: the penalty changes the argmax"
    spec = {
        "preset": "tokenswift",
        "drafter": {"heads": "random", "penalize": penalize},
        "retriever": {"name": "none"},
        "cache": {"name": "full"},
        "penalty": {"name": "contextual", "value": 50.0, "window": 8},
        "sampling": {"greedy": True},
        "speculation": {"tree": "fixed"},  # the drafting pass runs every step
    }
    pipe = Pipeline.from_spec(spec, model)
    run = pipe.start(prompt, 8)
    run.prefill()
    tree, _drafted, _drafting_pass = run.propose()
    expected = (penalised if penalize else raw).argmax().item()
    assert list(tree.children(0)) == [expected]


def _rescanned_lookup(tokens, max_ngram, min_ngram, num_tokens):
    """Prompt lookup by rescanning the whole context (what the index must agree with)."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[len(tokens) - n :]]
        if starts:
            return [tokens[starts[-1] + n : starts[-1] + n + num_tokens]]
    return []


@settings(max_examples=60, deadline=None)
@given(
    text=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=12),
    max_ngram=st.integers(1, 4),
)
def test_prompt_lookup_index_agrees_with_a_rescan_as_the_text_grows(text, steps, max_ngram):
    pipe = build({"preset": "prompt-lookup", "retriever": {"num_tokens": 4, "max_ngram": max_ngram}})
    retriever = pipe.retriever
    cut = max(1, len(text) // 3)
    state = DecodeState(tokens=text[:cut], prompt_length=cut)
    retriever.start(state)
    for step in steps:
        assert retriever.retrieve(state, []) == _rescanned_lookup(state.tokens, max_ngram, 1, 4)
        state.tokens.extend(text[len(state.tokens) : len(state.tokens) + step] or [0] * step)
    fresh = DecodeState(tokens=list(state.tokens), prompt_length=cut)  # another list: indexed anew
    assert retriever.retrieve(fresh, []) == _rescanned_lookup(fresh.tokens, max_ngram, 1, 4)
