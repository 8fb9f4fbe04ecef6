"""The CPU decode-attention kernel: equal to masked SDPA, in the runner's path, and a
clean fallback where it cannot be built."""

import logging
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenswift import kernels
from tokenswift.model.kv import CompactView, FullView
from tokenswift.model.runner import Runner
from tokenswift.testing import TINY_CONFIGS, tiny_model, tiny_model_for, word_tokenizer
from tokenswift.tree import DraftTree

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="the kernel cannot be built on this machine")
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}


def reference(query, key, value, prefix, tree_mask, scale):
    """Masked SDPA in float64, the KV heads repeated for their query heads."""
    _, q_heads, n, _ = query.shape
    group = q_heads // key.shape[1]
    mask = None
    if tree_mask is not None:
        mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tree_mask], dim=1)
    out = F.scaled_dot_product_attention(
        query.double(), key.double().repeat_interleave(group, 1), value.double().repeat_interleave(group, 1),
        attn_mask=mask, scale=scale,
    )
    return out.transpose(1, 2)


def random_tree_mask(n, generator):
    mask = (torch.rand(n, n, generator=generator) < 0.5).tril() | torch.eye(n, dtype=torch.bool)
    return mask


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 32, 128, 8, 48])  # the AVX512 blocked path for 32/64/128, generic otherwise
@pytest.mark.parametrize(
    "q_heads,kv_heads,n,prefix",
    [(9, 3, 1, 1000), (9, 3, 1, 3), (9, 3, 1, 16), (9, 3, 2, 517), (9, 3, 7, 300), (4, 4, 5, 0), (4, 2, 16, 33), (6, 2, 1, 0)],
)
def test_kernel_equals_masked_sdpa(dtype, dim, q_heads, kv_heads, n, prefix):
    generator = torch.Generator().manual_seed(prefix * 31 + n)
    capacity = prefix + n + 9  # key/value are views of a bigger store, as in the runner
    store_k = torch.randn(1, kv_heads, capacity, dim, generator=generator).to(dtype)
    store_v = torch.randn(1, kv_heads, capacity, dim, generator=generator).to(dtype)
    key, value = store_k[:, :, : prefix + n], store_v[:, :, : prefix + n]
    query = torch.randn(1, q_heads, n, dim, generator=generator).to(dtype)
    tree_mask = random_tree_mask(n, generator) if n > 1 else None
    if n == 1 and prefix == 0:
        return  # no keys but the token's own: covered by (6, 2, 1, 0) through "prefix + n" keys below
    got = kernels.decode_attention(query, key, value, prefix, tree_mask, dim**-0.5)
    want = reference(query, key, value, prefix, tree_mask, dim**-0.5)
    assert got.shape == (1, n, q_heads, dim) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@needs_kernel
def test_kernel_merges_many_chunks_and_a_planted_slip_is_caught():
    """Keys split into many chunks across threads (chunk size 16, a ragged tail) give
    SDPA's result; the same comparison fails if one key is dropped."""
    generator = torch.Generator().manual_seed(1)
    key = torch.randn(1, 3, 1000, 64, generator=generator)
    value = torch.randn(1, 3, 1000, 64, generator=generator)
    query = torch.randn(3, 3, 64, generator=generator)  # folded: [kv_heads, rows, dim]
    want = reference(query.reshape(1, 9, 1, 64), key, value, 999, None, 0.125).reshape(3, 3, 64)
    for chunk in (16, 64, 1000):
        got = torch.ops.tokenswift_cpu.decode_attention(query, key, value, 999, None, chunk, 0.125)
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
    slipped = torch.ops.tokenswift_cpu.decode_attention(query, key[:, :, :999], value[:, :, :999], 998, None, 16, 0.125)
    assert not torch.allclose(slipped.double(), want, rtol=2e-6, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5])
def test_staged_attention_writes_the_new_kv_and_attends_as_the_kernel_does(dtype, n):
    """One call writes the new tokens' keys/values into the store at [start, start + n)
    (and nowhere else) and returns what the decode kernel gives over the store's first
    start + n positions, bit for bit, for a query as the compiled graph hands it (not
    contiguous); positions past the store's capacity are refused by name."""
    generator = torch.Generator().manual_seed(n)
    start, capacity = 300, 320
    store_k = torch.randn(1, 3, capacity, 64, generator=generator).to(dtype)
    store_v = torch.randn(1, 3, capacity, 64, generator=generator).to(dtype)
    before_k, before_v = store_k.clone(), store_v.clone()
    key = torch.randn(1, 3, n, 64, generator=generator).to(dtype)
    value = torch.randn(1, 3, n, 64, generator=generator).to(dtype)
    query = torch.randn(1, n, 9, 64, generator=generator).to(dtype).transpose(1, 2)  # [1, 9, n, 64], strided
    tree_mask = random_tree_mask(n, generator) if n > 1 else None
    got = kernels.staged_attention(query, key, value, store_k, store_v, start, tree_mask, 0.125, 64)
    expected_k, expected_v = before_k.clone(), before_v.clone()
    expected_k[:, :, start : start + n], expected_v[:, :, start : start + n] = key, value
    assert torch.equal(store_k, expected_k) and torch.equal(store_v, expected_v)
    want = kernels.decode_attention(query, expected_k[:, :, : start + n], expected_v[:, :, : start + n], start, tree_mask,
                                    0.125, chunk=64)
    assert got.shape == (1, n, 9, 64) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="past the store's capacity 320"):
        kernels.staged_attention(query, key, value, store_k, store_v, capacity - n + 1, tree_mask, 0.125, 64)


@needs_kernel
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_runner_forwards_take_the_kernel_and_match_the_torch_path(name, monkeypatch):
    """One- and two-token forwards over the store, a full view and a compact view: the
    kernel serves them and gives the same logits as PyTorch's attention (float64)."""
    calls = []
    original = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a: calls.append(a[0].shape[2]) or original(*a))
    model = tiny_model_for(name)
    prompt = torch.arange(3, 40) % 60

    def forwards():
        runner = Runner(model)
        runner.allocate(64)
        runner.prefill(prompt)
        one = runner.forward(torch.tensor([7])).logits
        tree = DraftTree.root_only(7)
        tree.add_branch([9])
        two = runner.forward(tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor()).logits
        full = runner.forward(torch.tensor([7]), view=FullView(runner.store)).logits
        view = CompactView(runner.store, 16)
        view.load(runner.store, torch.arange(0, 32, 2))
        compact = runner.forward(torch.tensor([7]), view=view).logits
        return one, two, full, compact

    with_kernel = forwards()
    assert sorted(set(calls)) == [1, 2]
    monkeypatch.setattr(kernels, "available", lambda: False)
    calls.clear()
    without = forwards()
    assert not calls
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)



@needs_kernel
def test_bfloat16_forwards_with_head_dim_64_match_the_torch_path(monkeypatch):
    """The blocked paths (AVX512-BF16 pairs; AMX tiles for 3+ rows where the CPU has
    them) serve a bfloat16 model with head dim 64 and three query heads per KV head, as
    SmolLM2's: one token and a 4-token tree over 200 committed positions give the logits
    of PyTorch's attention to bfloat16 rounding. The tree is served on every CPU path
    (forced: where the kernel takes trees is measured per machine)."""
    calls = []
    original = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a: calls.append(a[0].shape[2]) or original(*a))
    monkeypatch.setattr(kernels, "max_tokens", lambda dtype=torch.bfloat16: 16)
    config = dict(TINY_CONFIGS["llama-gqa"], hidden_size=384, num_attention_heads=6, num_key_value_heads=2, initializer_range=0.05)
    model = tiny_model(config, dtype="bfloat16")
    prompt = torch.arange(3, 203) % 60

    def forwards():
        runner = Runner(model)
        runner.allocate(256)
        runner.prefill(prompt)
        one = runner.forward(torch.tensor([7])).logits
        tree = DraftTree.root_only(7)
        tree.add_branch([9, 11])
        tree.add_branch([12])
        four = runner.forward(tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor()).logits
        return one, four

    with_kernel = forwards()
    assert sorted(set(calls)) == [1, 4]
    monkeypatch.setattr(kernels, "available", lambda: False)
    without = forwards()
    for a, b in zip(with_kernel, without):
        scale = float(b.float().abs().max())
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0.03 * scale)

def test_no_compiler_means_one_warning_and_pytorchs_path(monkeypatch, tmp_path, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    kernels._load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenswift.kernels"):
            assert not kernels.available() and not kernels.available()
        assert [r.getMessage() for r in caplog.records].count(
            "tokenswift's CPU kernels could not be built (Ninja is required to load C++ extensions); "
            "using PyTorch's attention and products") == 1
        query = torch.randn(1, 4, 1, 8, dtype=torch.float64)
        key = torch.randn(1, 2, 5, 8, dtype=torch.float64)
        assert not kernels.serves(query, key, key)
        model = tiny_model_for("llama-gqa")
        runner = Runner(model)
        runner.allocate(16)
        runner.prefill(torch.tensor([1, 2, 3, 4]))
        got = runner.forward(torch.tensor([5])).logits[0]
        with torch.inference_mode():
            want = model(torch.tensor([[1, 2, 3, 4, 5]])).logits[0, -1]
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    finally:
        kernels._load.cache_clear()


@needs_kernel
@pytest.mark.skipif(
    not kernels.available() or kernels.linear_path() in ("avx2", "scalar"),
    reason="this machine's own build is the AVX2 path (or narrower): the tests above cover it",
)
def test_the_avx2_path_where_this_machine_builds_a_wider_one():
    """The project's machines are of two kinds, AVX512 (with AMX) and AVX2 only, and
    each builds only its own paths. Where the native build takes the AVX512 paths, the
    AVX2 path is built for it (``-march=haswell``) and, in a subprocess, passes this
    module's equality tests with masked SDPA, its lossless runs through the kernel and
    the few-rows products' tests (row independence among them)."""
    env = dict(os.environ, **{kernels.MARCH_ENV: "haswell"})
    tests = (
        "equals_masked_sdpa or merges_many_chunks or lossless_through or lossless_with_trees or head_dim_64 or forced_build"
        " or few_rows_linear"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", result.stdout.splitlines()[-1])
    assert passed and int(passed.group(1)) > 100, result.stdout[-2000:]  # the equality tests, not the path check alone


@pytest.mark.skipif(os.environ.get(kernels.MARCH_ENV) != "haswell", reason="runs in the AVX2 build's subprocess")
def test_forced_build_takes_the_avx2_path():
    assert kernels.available() and kernels.linear_path() == "avx2"


def test_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TOKENSWIFT_KERNELS", "off")
    kernels._load.cache_clear()
    try:
        assert not kernels.available()
    finally:
        monkeypatch.delenv("TOKENSWIFT_KERNELS")
        kernels._load.cache_clear()


@needs_kernel
@pytest.mark.parametrize("preset", ["ar", "tokenswift", "eagle"])
@pytest.mark.parametrize("greedy", [True, False])
def test_lossless_through_the_blocked_kernel_path(preset, greedy):
    """A tiny Llama whose heads are 64 wide, in float32: its one-token forwards take the
    kernel's vectorised path (head dims 32/64/128), and every preset still emits exactly
    what plain decoding of the model emits, greedy and sampled. (``ar``'s steps and the
    ``tokenswift`` drafter's pass are one-token forwards; ``eagle``'s fixed trees are
    verified on PyTorch's path, its trees of one node on the kernel.)"""
    from tokenswift import Pipeline
    from tokenswift.model.loading import tiny_model
    from tokenswift.testing import FIXED_TREE, TINY_CONFIGS, assert_lossless

    config = dict(TINY_CONFIGS["llama-gqa"], head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    model = tiny_model(config, seed=3, dtype="float32")
    calls = []
    original = kernels.decode_attention
    spec = {"preset": preset, **FIXED_TREE, "sampling": {"greedy": True} if greedy else {"temperature": 1.0}}
    if preset == "eagle":
        spec["drafter"] = {"weights": "random"}
    pipe = Pipeline.from_spec(spec, model)
    try:
        kernels.decode_attention = lambda *a: calls.append(a[0].shape[-1]) or original(*a)
        for seed in (0, 1):
            assert_lossless(pipe, [1, 5, 9, 2, 7, 3], 24, seed=seed)
    finally:
        kernels.decode_attention = original
    assert set(calls) <= {64}
    if preset != "eagle":
        assert calls


@needs_kernel
@pytest.mark.parametrize("preset", ["eagle", "medusa", "prompt-lookup"])
@pytest.mark.parametrize("greedy", [True, False])
def test_lossless_with_trees_through_the_kernel(preset, greedy, monkeypatch):
    """Every tree verify forward through the decode kernel (as on CPUs where it serves
    up to 32 new tokens; forced here, whichever CPU runs the test): fixed trees, a tiny
    Llama with 64-wide heads in float32, and each preset still emits what plain decoding
    emits, greedy and sampled."""
    from tokenswift import Pipeline
    from tokenswift.model.loading import tiny_model
    from tokenswift.testing import FIXED_TREE, TINY_CONFIGS, assert_lossless

    monkeypatch.setattr(kernels, "max_tokens", lambda dtype=None: 64)
    config = dict(TINY_CONFIGS["llama-gqa"], head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    model = tiny_model(config, seed=5, dtype="float32")
    widths = []
    original = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a: widths.append(a[0].shape[2]) or original(*a))
    spec = {"preset": preset, **FIXED_TREE, "sampling": {"greedy": True} if greedy else {"temperature": 1.0}}
    if preset in ("eagle", "medusa"):
        spec["drafter"] = {"weights": "random"} if preset == "eagle" else {"heads": "random"}
    pipe = Pipeline.from_spec(spec, model)
    for seed in (0, 1):
        assert_lossless(pipe, [1, 5, 9, 2, 7, 3, 1, 5, 9, 2], 24, seed=seed)
    assert max(widths) > 2, "the trees must really go through the kernel"


def test_measurements_are_keyed_by_the_attention_path(monkeypatch):
    """A calibration measured before the kernel served decode steps (their cost grows
    twice as fast with the context without it) must not predict steps that use it."""
    from tokenswift.records import machine_key

    runner = Runner(tiny_model_for("llama-gqa", dtype="float32"))
    monkeypatch.setattr(kernels, "available", lambda: True)
    with_kernel = machine_key(runner)
    monkeypatch.setattr(kernels, "available", lambda: False)
    without = machine_key(runner)
    assert with_kernel != without
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert machine_key(runner) == with_kernel  # stable otherwise


# -- the few-rows linear kernel ---------------------------------------------------------

LINEAR_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (192, 576), (96, 1536), (100, 576), (7, 13), (48, 64)])
@pytest.mark.parametrize("rows", [1, 3, 9, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_rows_linear_equals_linear(dtype, out_features, in_features, rows, with_bias):
    """Against float64 F.linear: the AMX / AVX512-BF16 / AVX2 path this CPU builds, its
    tails (out_features not a multiple of the block, in_features of the vector) and bias."""
    generator = torch.Generator().manual_seed(out_features * 7 + in_features + rows)
    weight = (torch.randn(out_features, in_features, generator=generator) * in_features**-0.5).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    got = kernels.few_rows_linear(x, weight, bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == (rows, out_features) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=LINEAR_TOLERANCE[dtype], atol=LINEAR_TOLERANCE[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_linear_rows_do_not_depend_on_each_other(dtype):
    """A tree's rows equal one-token steps bit for bit: each row alone gives what it
    gives among 1 to 6, 16 or 32 others (every tile shape of every path)."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(576, 576, generator=generator).to(dtype)
    x = torch.randn(32, 576, generator=generator).to(dtype)
    alone = torch.cat([kernels.few_rows_linear(x[i : i + 1], weight) for i in range(32)])
    for rows in (2, 3, 4, 5, 6, 16, 32):
        assert torch.equal(kernels.few_rows_linear(x[:rows], weight), alone[:rows])


def linear_reference(x, weight, bias=None):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@needs_kernel
def test_a_weight_changed_in_place_is_multiplied_as_it_is_now():
    """Where the kernel keeps a packed copy of a weight, an in-place change (which
    PyTorch's version counter records) is packed again; a change through ``.data``
    needs ``forget_packed_weights``. 100 outputs: packed on the AMX path too."""
    generator = torch.Generator().manual_seed(11)
    weight = (torch.randn(100, 576, generator=generator) * 576**-0.5).to(torch.bfloat16)
    x = torch.randn(3, 576, generator=generator).to(torch.bfloat16)
    tolerance = LINEAR_TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(kernels.few_rows_linear(x, weight).double(), linear_reference(x, weight), rtol=tolerance, atol=tolerance)
    with torch.no_grad():
        weight[:50].neg_()
    torch.testing.assert_close(kernels.few_rows_linear(x, weight).double(), linear_reference(x, weight), rtol=tolerance, atol=tolerance)
    weight.data[50:].zero_()
    kernels.forget_packed_weights()
    got = kernels.few_rows_linear(x, weight)
    assert torch.equal(got[:, 50:], torch.zeros(3, 50, dtype=torch.bfloat16))
    torch.testing.assert_close(got.double(), linear_reference(x, weight), rtol=tolerance, atol=tolerance)


@needs_kernel
def test_a_new_weight_where_a_freed_one_lived_is_not_mistaken_for_it():
    """A packed copy is keyed by the weight's address: a weight allocated where a freed
    one lived is multiplied as itself. The address is reused on purpose (each weight a
    new tensor over one buffer), not left to the allocator's luck."""
    tolerance = LINEAR_TOLERANCE[torch.bfloat16]
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    block = bytearray(100 * 576 * 2)  # one block of memory, every weight's home in turn
    addresses = set()
    for seed in range(4):
        weight = torch.frombuffer(block, dtype=torch.bfloat16).view(100, 576)
        weight.copy_(torch.randn(100, 576, generator=torch.Generator().manual_seed(seed)) * 576**-0.5)
        addresses.add(weight.data_ptr())
        got = kernels.few_rows_linear(x, weight)
        torch.testing.assert_close(got.double(), linear_reference(x, weight), rtol=tolerance, atol=tolerance)
        del weight, got
    assert len(addresses) == 1  # the same address, so a stale copy would have been found
    # and while the first weight still lives, a second tensor over the same bytes
    first = torch.frombuffer(block, dtype=torch.bfloat16).view(100, 576)
    first.copy_(torch.randn(100, 576, generator=torch.Generator().manual_seed(8)) * 576**-0.5)
    kernels.few_rows_linear(x, first)  # packed at the version the second will have too
    second = torch.frombuffer(block, dtype=torch.bfloat16).view(100, 576)
    second.copy_(torch.randn(100, 576, generator=torch.Generator().manual_seed(9)) * 576**-0.5)
    torch.testing.assert_close(
        kernels.few_rows_linear(x, second).double(), linear_reference(x, second), rtol=tolerance, atol=tolerance
    )


@pytest.mark.skipif(not kernels.packs_weights(), reason="this machine's kernels multiply the weights as they are")
def test_packed_copies_are_counted_and_go_with_their_weight():
    weight = torch.randn(100, 576).to(torch.bfloat16)
    before = kernels.packed_weight_bytes()
    assert kernels.packed_size(weight) == 112 * 576 * 2  # 100 outputs padded to 7 blocks of 16
    kernels.few_rows_linear(torch.randn(1, 576).to(torch.bfloat16), weight)
    assert kernels.packed_weight_bytes() == before + kernels.packed_size(weight)
    del weight
    assert kernels.packed_weight_bytes() == before
    assert kernels.packed_size(torch.randn(100, 576)) == 0  # float32: multiplied as it is


@pytest.mark.skipif(not kernels.packs_weights(), reason="this machine's kernels multiply the weights as they are")
def test_the_memory_estimate_counts_the_packed_copies_a_run_will_make():
    from tokenswift import Pipeline

    # 100 outputs in the LM head: packed on the AMX path too, whose tiles take the tiny
    # models' other shapes as they are
    model = tiny_model(dict(TINY_CONFIGS["llama-gqa"], vocab_size=100), dtype="bfloat16")
    pipe = Pipeline.from_spec("ar", model, word_tokenizer())
    pipe.runner.use_kernel_linears(True)
    # the estimate takes off the copies the kernel holds (of any model): earlier tests'
    # bfloat16 models, still alive, may hold some
    kernels.forget_packed_weights()
    linears = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    linears[id(model.get_output_embeddings().weight)] = model.get_output_embeddings().weight
    expected = sum(kernels.packed_size(w) for w in linears.values())
    estimate = pipe.estimate_memory(8, 4)
    assert expected > 0 and estimate.packed_bytes == expected
    assert estimate.prefill_copy_bytes == 0  # an 8-token prompt prefills on the model itself
    assert estimate.total_bytes == estimate.kv_bytes + estimate.view_bytes + estimate.working_bytes + expected
    pipe.generate(list(range(1, 9)), 4, seed=0)
    assert pipe.estimate_memory(8, 4).packed_bytes == 0  # made by the first run, shared by the next
    pipe.runner.use_kernel_linears(False)
    assert pipe.estimate_memory(8, 4).packed_bytes == 0


@needs_kernel
def test_runner_forwards_through_kernel_linears(monkeypatch):
    """With the kernel on, a runner's one-token steps, trees and LM-head rows go through
    it and give what PyTorch's products give (float32 rounding)."""
    model = tiny_model_for("llama-gqa", "float32")
    calls = []
    original = kernels.few_rows_linear
    monkeypatch.setattr(kernels, "few_rows_linear", lambda x, w, b=None: calls.append(x.shape[0]) or original(x, w, b))

    def run(on):
        runner = Runner(model)
        runner.use_kernel_linears(on)
        runner.allocate(64)
        runner.prefill(torch.arange(1, 20))
        tree = DraftTree.from_branches(7, [[9, 4], [5], [9, 2]])
        out = runner.forward(tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor())
        step = runner.forward(torch.tensor([3]), view=FullView(runner.store))
        return out.logits, step.logits

    reference = run(False)
    assert not calls
    got = run(True)
    assert calls  # the tree's and the step's products, and their LM-head rows
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # float32 rounding, as compiled forwards


def test_linears_choice_is_checked(monkeypatch):
    monkeypatch.setenv(kernels.LINEARS_ENV, "fast")
    with pytest.raises(ValueError, match="TOKENSWIFT_LINEARS='fast': expected auto, kernel or torch"):
        kernels.linears_by_default(torch.bfloat16, torch.device("cpu"))
    monkeypatch.setenv(kernels.LINEARS_ENV, "torch")
    assert not kernels.linears_by_default(torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize(
    ("path", "dtype", "expected"),
    [("amx", torch.bfloat16, True), ("avx512-bf16", torch.bfloat16, True), ("avx2", torch.bfloat16, True),
     ("avx512", torch.bfloat16, False), ("scalar", torch.bfloat16, False), ("amx", torch.float32, False),
     (None, torch.bfloat16, False)],
)
def test_auto_linears_follow_the_measured_paths(monkeypatch, path, dtype, expected):
    # Pinned: the kernel's path is what this machine's build would report, whichever CPU runs the test.
    monkeypatch.delenv(kernels.LINEARS_ENV, raising=False)
    monkeypatch.setattr(kernels, "linear_path", lambda: path)
    assert kernels.linears_by_default(dtype, torch.device("cpu")) is expected
    assert not kernels.linears_by_default(dtype, torch.device("meta"))


@pytest.mark.parametrize(
    ("path", "dtype", "expected"),
    [("amx", torch.bfloat16, kernels.MAX_TOKENS_AMX_BF16), ("avx512-bf16", torch.bfloat16, kernels.MAX_TOKENS_AVX512_BF16),
     ("avx2", torch.bfloat16, kernels.MAX_TOKENS_AVX2_BF16), ("avx2", torch.float32, kernels.MAX_TOKENS),
     ("amx", torch.float32, kernels.MAX_TOKENS),
     ("avx512-bf16", torch.float32, kernels.MAX_TOKENS), (None, torch.bfloat16, kernels.MAX_TOKENS)],
)
def test_tree_tokens_the_kernel_serves_follow_the_measured_paths(monkeypatch, path, dtype, expected):
    # Pinned like the linears' choice: whichever CPU runs the test.
    monkeypatch.setattr(kernels, "linear_path", lambda: path)
    assert kernels.max_tokens(dtype) == expected
    assert kernels.MAX_TOKENS_AMX_BF16 > kernels.MAX_TOKENS  # trees of a few tokens go through the kernel with AMX
