"""The runner: tree forwards over the full store and over views, commit, continue."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tokenswift.model import attention
from tokenswift.model.kv import FullView, IndexView
from tokenswift.model.runner import Runner
from tokenswift.testing import tiny_model_for
from tokenswift.tree import DraftTree

MODELS = ["llama-mha", "llama-gqa", "qwen2", "mistral"]


@st.composite
def trees(draw, vocab=64):
    """A prompt and a random trie of draft tokens below its last token."""
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=2, max_size=24))
    tree = DraftTree.root_only(prompt[-1])
    for _ in range(draw(st.integers(0, 8))):
        parent = draw(st.integers(0, len(tree) - 1))
        branch = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
        tree.add_branch(branch, parent=parent)
    return prompt, tree


def reference_logits(model, prompt, tree, node, visible=None):
    """Logits after the root-to-node path, from one plain forward of the model.

    visible: committed positions the path may see (None: all). The prefix itself
    always attends causally, as it did when its KV was committed.
    """
    ids = prompt + tree.path_tokens(node)
    n, committed = len(ids), len(prompt) - 1
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    if visible is not None:
        allowed = torch.zeros(committed, dtype=torch.bool)
        allowed[visible] = True
        mask[committed:, :committed] = allowed
    return model(torch.tensor([ids]), attention_mask=mask[None, None]).logits[0, -1]


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=trees())
def test_tree_forward_matches_separate_path_forwards(name, case):
    prompt, tree = case
    model = tiny_model_for(name)
    runner = Runner(model)
    runner.allocate(len(prompt) + len(tree))
    runner.prefill(torch.tensor(prompt[:-1]), chunk_size=5)
    out = runner.forward(tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor())
    viewed = runner.forward(
        tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor(), view=FullView(runner.store)
    )
    with torch.inference_mode():
        for node in range(len(tree)):
            ref = reference_logits(model, prompt, tree, node)
            torch.testing.assert_close(out.logits[node], ref, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(viewed.logits[node], ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
@settings(max_examples=12, deadline=None)
@given(case=trees(), data=st.data())
def test_tree_forward_over_a_subset_view(name, case, data):
    prompt, tree = case
    committed = len(prompt) - 1
    visible = sorted(data.draw(st.sets(st.integers(0, committed - 1), min_size=1, max_size=committed)))
    model = tiny_model_for(name)
    runner = Runner(model)
    runner.allocate(len(prompt) + len(tree))
    runner.prefill(torch.tensor(prompt[:-1]))
    before = [k[:, :, :committed].clone() for k in runner.store.keys]
    out = runner.forward(
        tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor(), view=IndexView(torch.tensor(visible))
    )
    assert runner.store.staged == 0 and runner.store.length == committed
    for old, new in zip(before, runner.store.keys):
        assert torch.equal(old, new[:, :, :committed]), "a view forward must not write into committed positions"
    with torch.inference_mode():
        for node in range(len(tree)):
            ref = reference_logits(model, prompt, tree, node, visible=visible)
            torch.testing.assert_close(out.logits[node], ref, rtol=1e-9, atol=1e-9)


def test_per_head_view_gathers_each_heads_positions():
    model = tiny_model_for("llama-gqa")
    runner = Runner(model)
    runner.allocate(32)
    runner.prefill(torch.arange(10))
    indices = torch.tensor([[[0, 3, 5], [1, 2, 9]], [[4, 6, 8], [0, 1, 7]]])  # [layers, kv_heads, S]
    view = IndexView(indices)
    for layer in range(2):
        keys, values = view.gather(runner.store, layer)
        for head in range(2):
            expected = runner.store.keys[layer][0, head, indices[layer, head]]
            assert torch.equal(keys[0, head], expected)
            assert torch.equal(values[0, head], runner.store.values[layer][0, head, indices[layer, head]])


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=10, deadline=None)
@given(case=trees(), data=st.data())
def test_commit_then_continue_equals_recomputing(name, case, data):
    prompt, tree = case
    model = tiny_model_for(name)
    runner = Runner(model)
    runner.allocate(len(prompt) + len(tree) + 4)
    runner.prefill(torch.tensor(prompt[:-1]))
    runner.forward(tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor())
    node = data.draw(st.integers(0, len(tree) - 1))
    path = tree.path(node)
    runner.commit([0, *path])
    follow = data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=3))
    out = runner.forward(torch.tensor(follow))
    ids = prompt + tree.path_tokens(node) + follow
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, -len(follow) :]
    torch.testing.assert_close(out.logits, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kept", [[0, 2, 5], [1], [3, 4, 6, 7], [0, 1, 2]])
def test_commit_compacts_the_kept_positions_of_every_layer(native, kept, monkeypatch):
    """Kept staged positions move to the committed end in every layer's keys and values,
    in order, through the native kernel or the Python path alike; committed positions
    before them and the store's other rows are untouched (planted: the kernel moving a
    row one position late fails)."""
    from tokenswift import kernels
    from tokenswift.model import kv

    if native and not kernels.available():
        pytest.skip("the kernels cannot be built here")
    monkeypatch.setattr(kv, "NATIVE_COMMIT", native)
    store = kv.KVStore(num_layers=2, kv_heads=3, head_dim=8, capacity=32, dtype=torch.float32, device="cpu")
    store.occupy(10)
    for buf in (*store.keys, *store.values):
        buf.normal_(generator=torch.Generator().manual_seed(buf.numel() + len(kept)))
    before = [buf.clone() for buf in (*store.keys, *store.values)]
    store.staged = 8
    store.commit(kept)
    assert store.length == 10 + len(kept) and store.staged == 0
    for was, now in zip(before, (*store.keys, *store.values)):
        expected = was.clone()
        expected[:, :, 10 : 10 + len(kept)] = was[:, :, [10 + i for i in kept]]
        assert torch.equal(now, expected)


def test_commit_rejects_positions_outside_staging():
    runner = Runner(tiny_model_for("llama-mha"))
    runner.allocate(16)
    runner.forward(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\)"):
        runner.commit([0, 5])
    with pytest.raises(ValueError, match="ascending"):
        runner.commit([2, 1])


def test_store_refuses_overflow_and_returns_hidden_states():
    model = tiny_model_for("llama-mha")
    runner = Runner(model)
    runner.allocate(4)
    out = runner.forward(torch.tensor([1, 2, 3]), logits_rows=slice(-1, None))
    assert out.logits.shape == (1, 64) and out.hidden.shape == (1, 32)
    runner.commit([0, 1, 2])
    with pytest.raises(RuntimeError, match="overflow"):
        runner.forward(torch.tensor([4, 5]))


def test_timed_steps_run_over_written_kv_as_a_run_does():
    """Calibrations time forwards over occupied positions (``KVStore.occupy``). A fresh
    store's memory is the zero page until written, and a forward over it reads no KV
    from memory: occupied positions are filled with noise, once, so a timed step reads
    what a run's step reads. A later occupy fills only positions no earlier one reached."""
    from tokenswift.timing import one_token_step, tree_step

    runner = Runner(tiny_model_for("llama-gqa"))
    runner.allocate(32)
    one_token_step(runner, 8)()
    store = runner.store
    for tensor in (*store.keys, *store.values):
        assert bool((tensor[:, :, :8] != 0).all()) and not tensor[:, :, 9:].any()  # 8: the step's own token
    before = [tensor[:, :, :6].clone() for tensor in store.keys]
    tree_step(runner, 6, 3)()  # its tokens' own keys at 6-8
    one_token_step(runner, 8)()
    assert all(torch.equal(tensor[:, :, :6], kept) for tensor, kept in zip(store.keys, before))
    tree_step(runner, 20, 3)()
    assert all(bool((tensor[:, :, 8:20] != 0).all()) for tensor in (*store.keys, *store.values))
    assert all(torch.equal(tensor[:, :, :6], kept) for tensor, kept in zip(store.keys, before))


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=trees())
def test_split_attention_forwards_match_separate_path_forwards(name, case, monkeypatch):
    """Prefill chunks and trees through the split (prefix + tree block, merged by
    log-sum-exp), forced on for every multi-token forward: same logits as plain forwards."""
    monkeypatch.setattr(attention, "splits_better", lambda new_tokens, prefix: True)
    prompt, tree = case
    model = tiny_model_for(name)
    runner = Runner(model)
    runner.allocate(len(prompt) + len(tree))
    runner.prefill(torch.tensor(prompt[:-1]), chunk_size=3)  # the first chunk has no prefix
    out = runner.forward(tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor())
    with torch.inference_mode():
        for node in range(len(tree)):
            torch.testing.assert_close(out.logits[node], reference_logits(model, prompt, tree, node), rtol=1e-9, atol=1e-9)


def test_split_attention_equals_masked_attention():
    generator = torch.Generator().manual_seed(0)
    q_heads, kv_heads, n, prefix, dim = 6, 2, 5, 7, 4
    query = torch.randn(1, q_heads, n, dim, dtype=torch.float64, generator=generator)
    key = torch.randn(1, kv_heads, prefix + n, dim, dtype=torch.float64, generator=generator)
    value = torch.randn(1, kv_heads, prefix + n, dim, dtype=torch.float64, generator=generator)
    tree = DraftTree.root_only(0)
    tree.add_branch([1, 2])
    tree.add_branch([3, 4])
    mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tree.mask()], dim=1)  # [n, prefix + n]
    group = q_heads // kv_heads
    bias = torch.zeros(group * n, n, dtype=torch.float64).masked_fill_(~tree.mask().repeat(group, 1), float("-inf"))
    got = attention.split_attention(query, key, value, prefix, bias, 0.5)  # [1, n, q_heads, dim]
    expanded_keys = key.repeat_interleave(group, dim=1)
    expanded_values = value.repeat_interleave(group, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(query, expanded_keys, expanded_values, attn_mask=mask, scale=0.5)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-12, atol=1e-12)
