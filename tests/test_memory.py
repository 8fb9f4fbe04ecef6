"""Memory is predicted before a run and a run that cannot fit is refused."""

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

from tokenswift import Pipeline, get_plugin_manager, hookimpl
from tokenswift import pipeline as pipeline_module
from tokenswift.interfaces import Penalty
from tokenswift.testing import tiny_model_for


def test_estimate_matches_the_actual_allocation():
    model = tiny_model_for("llama-gqa")
    spec = {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 24, "sink": 2, "recent": 4},
            # passes run (and keep the view) whatever the tiny model's timings
            "speculation": {"plain_guard": False, "pass_gain": 1000}}
    # the machine's costs first: measuring them allocates a store of its own (alone, this
    # test measured them inside the run and found that store, not the run's)
    Pipeline.from_spec(spec, model).costs()
    pipe = Pipeline.from_spec(spec, model)
    estimate = pipe.estimate_memory(20, 30)
    pipe.generate(list(range(1, 21)), 30, seed=0, ignore_eos=True)
    assert estimate.positions == pipe.runner.store.capacity == 20 + 30 + pipe.max_tree_nodes()
    assert estimate.kv_bytes == pipe.runner.store.nbytes()
    view = pipe.cache_policy.view
    assert view is not None  # the context outgrew the budget, so a partial view was made
    assert estimate.view_bytes == sum(t.numel() * t.element_size() for t in view.keys + view.values)
    assert pipe.estimate_memory(20, 30).kv_bytes == 0  # the store is reused


def test_a_run_that_cannot_fit_is_refused_before_allocating(monkeypatch):
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha"))
    monkeypatch.setattr(pipeline_module, "available_bytes", lambda device: 10 * 2**20)
    with pytest.raises(ValueError, match=r"this run needs about 0.\d\d GiB .* but only 0.01 GiB is available; lower max_new_tokens \(100000\)"):
        pipe.generate([1, 2, 3], 100_000)
    assert pipe.runner.store is None


def test_a_refusal_counting_packed_weights_says_how_to_go_without_them(monkeypatch):
    """Where the few-rows kernel would pack the weights, the refusal counts the copies and
    names the setting that multiplies by the weights as stored; without them it does not."""
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha", "float32"))
    monkeypatch.setattr(pipeline_module, "available_bytes", lambda device: 10 * 2**20)
    monkeypatch.setattr(pipe.runner, "packed_bytes", lambda: 3 * 2**20)
    with pytest.raises(ValueError, match=r"packed weights 0.00 GiB, the prefill's copy of the model 0.00 GiB\).* or set TOKENSWIFT_LINEARS=torch to multiply"):
        pipe.generate([1, 2, 3], 100_000)
    monkeypatch.setattr(pipe.runner, "packed_bytes", lambda: 0)
    with pytest.raises(ValueError) as refused:
        pipe.generate([1, 2, 3], 100_000)
    assert "TOKENSWIFT_LINEARS" not in str(refused.value)


def test_the_estimate_counts_the_prefills_copy_of_the_model_for_long_prompts_only():
    """A prefill in another dtype runs on a copy of the model held while the KV store is:
    counted for prompts the copy is made for (prefill_min_tokens), not for shorter ones."""
    from tokenswift.memory import parameter_bytes

    model = tiny_model_for("llama-gqa", "float32")
    pipe = Pipeline.from_spec({"preset": "ar", "model": {"prefill_dtype": "float64"}}, model)
    pipe.runner.use_prefill_dtype(torch.float64, min_tokens=11)
    short = pipe.estimate_memory(10, 4)
    assert short.prefill_copy_bytes == 0
    pipe.runner.use_prefill_dtype(torch.float64, min_tokens=10)
    long = pipe.estimate_memory(10, 4)
    assert long.prefill_copy_bytes == 2 * parameter_bytes(model)  # float64: twice float32's bytes
    assert long.total_bytes == short.total_bytes + long.prefill_copy_bytes
    assert Pipeline.from_spec("ar", model).estimate_memory(10, 4).prefill_copy_bytes == 0  # float32 prefills itself


class NaNAfter(Penalty):
    """Turns the scores to NaN once the context reaches 12 tokens."""

    @property
    def window(self):
        return 64

    def apply(self, contexts, scores):
        return scores * float("nan") if contexts.shape[1] >= 12 else scores


class NaNPlugin:
    @hookimpl
    def tokenswift_register_components(self, registrar):
        registrar.add("penalty", "nan-after", NaNAfter)


def test_non_finite_scores_stop_the_run_and_keep_the_text():
    pm = get_plugin_manager()
    pm.register(NaNPlugin())
    pipe = Pipeline.from_spec({"preset": "ar", "penalty": {"name": "nan-after"}}, tiny_model_for("llama-mha"), plugin_manager=pm)
    result = pipe.generate([1, 2, 3, 4, 5], 20, seed=0, ignore_eos=True)
    assert result.stats.finish_reason == "non-finite scores"
    assert len(result.tokens) == 7  # contexts of 5..11 tokens were fine


def test_cli_reports_non_finite_scores_and_keeps_the_file(monkeypatch, tmp_path, capsys):
    import sys
    import types

    from tests.test_plugin_loading import FakeDistribution, install
    from tokenswift.cli import main
    from tokenswift.testing import word_tokenizer

    module = types.ModuleType("fake_nan")
    module.tokenswift_register_components = hookimpl(lambda registrar: registrar.add("penalty", "nan-after", NaNAfter))
    monkeypatch.setitem(sys.modules, "fake_nan", module)
    install(monkeypatch, FakeDistribution("nan-dist", "0.1", [("nan", "fake_nan")]))
    model_dir = tmp_path / "model"
    tiny_model_for("llama-mha", "float32").save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    spec = tmp_path / "spec.toml"
    spec.write_text(f'preset = "ar"\n[model]\npath = "{model_dir}"\ndtype = "float32"\n[penalty]\nname = "nan-after"\n')
    out = tmp_path / "out.txt"
    code = main(["generate", "--spec", str(spec), "--prompt", "the cat sat on the", "--max-new-tokens", "20",
                 "--ignore-eos", "--out", str(out), "--quiet"])
    assert code == 1
    assert "NaN/inf scores after 7 tokens; the text so far was kept in" in capsys.readouterr().err
    assert out.is_file()


def _tensor_bytes() -> int:
    """Bytes of the distinct CPU tensor storages reachable from Python objects."""
    import torch

    storages = {}
    for obj in gc.get_objects():
        # real tensors only: earlier tests' compiles leave fake ones alive, which have no data
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (NotImplementedError, RuntimeError):  # a tensor without storage (an opaque one)
                continue
    return sum(storages.values())


class _Watch:
    """At ``first`` and ``last`` generated tokens: the live tensors' bytes and, from
    ``first`` on, the Python heap allocated since (tracemalloc)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.seen = first, last, {}

    @hookimpl
    def tokenswift_step_end(self, pipeline, step):
        import tracemalloc

        # Cyclic garbage is collected first at both ends: what a run keeps, not what waits
        # for the collector. How much waits depends on what earlier tests left (a process
        # with many long-lived objects collects its oldest generation rarely): the suite
        # once read 762 bytes a token here where the test alone read ~525.
        if "first" not in self.seen and step.generated >= self.first:
            gc.collect()
            self.seen["first"] = (step.generated, _tensor_bytes())
            tracemalloc.start()
        elif "last" not in self.seen and step.generated >= self.last:
            gc.collect()
            self.seen["last"] = (step.generated, _tensor_bytes(), tracemalloc.get_traced_memory()[0])
            tracemalloc.stop()


def test_a_long_run_holds_no_more_per_token_than_its_text():
    """Past its first tokens, a run of the default preset keeps no more tensors, and its
    Python heap grows by no more than the text's own bookkeeping (the n-gram retriever's
    table, the tokens): what a 100K-token run would add to its resident memory.
    (Resident memory itself is the allocator's choice and counts every test's leftovers.)"""
    # The penalty window shortened to 256 tokens: the n-gram retriever keeps the window's
    # n-grams apart until they join its table, a store bounded by the window that fills
    # over its first 256 tokens here, before the measured span (over the default 1,024 it
    # would fill inside the span and read as ~200 bytes a token of growth)
    spec = {"preset": "tokenswift", "drafter": {"heads": "random"}, "model": {"compile": False},
            "penalty": {"window": 256}}
    pipe = Pipeline.from_spec(spec, tiny_model_for("llama-gqa", "float32"))
    # A first run makes what a process makes once (caches and tables filled at a first
    # use past the span's start: they read as 586-775 bytes a token of growth in a first
    # run, ~530 in the next); the second run is measured.
    pipe.generate(list(range(1, 21)), 1600, seed=0, ignore_eos=True)
    watch = _Watch(first=400, last=1600)
    pipe.plugin_manager.register(watch)
    result = pipe.generate(list(range(1, 21)), 1600, seed=0, ignore_eos=True)
    assert len(result.tokens) == 1600 and set(watch.seen) == {"first", "last"}
    (first, tensors_then), (last, tensors_now, heap) = watch.seen["first"], watch.seen["last"]
    assert tensors_now - tensors_then <= 64 * 1024, (tensors_then, tensors_now)
    # ~520-530 bytes a token here (each new 4-gram's entry); a planted leak of one small
    # dict a step read 762, and of each step's last hidden row kept, +196 KB of tensors
    assert heap / (last - first) < 700, f"{heap / (last - first):.0f} bytes a token"


def test_a_kv_store_the_runner_replaces_is_freed_at_once():
    """A longer request replaces the runner's store; the old one goes with its last
    reference, not at Python's next cyclic collection (the cache's layers referred back
    to their cache: a cycle that held every replaced store, 360 MiB at 16K positions)."""
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-gqa", "float32"))
    pipe.generate([1, 2, 3], 4, seed=0, ignore_eos=True)
    old = weakref.ref(pipe.runner.store)
    collecting = gc.isenabled()
    gc.disable()
    try:
        pipe.generate([1, 2, 3], 200, seed=0, ignore_eos=True)
        assert pipe.runner.store is not old()
        assert old() is None
    finally:
        if collecting:
            gc.enable()


_SHAPES_PROBE = """
import tokenswift, torch
from tokenswift.memory import malloc_mib
torch.set_num_threads(1)
weight = torch.randn(256, 128, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(1, 128, dtype=torch.bfloat16), weight)
before = malloc_mib()[0]
for rows in range(2, 602):
    torch.nn.functional.linear(torch.randn(rows, 128, dtype=torch.bfloat16), weight)
print(malloc_mib()[0] - before)
"""


def _growth_over_shapes(**env) -> float:
    """MiB malloc's heaps hold after bfloat16 products of 600 row counts, in a fresh
    process that imports tokenswift first, with ``env`` set over this one's."""
    from tokenswift.memory import NATIVE_CACHE_VARIABLES

    base = {k: v for k, v in os.environ.items() if k not in NATIVE_CACHE_VARIABLES}
    done = subprocess.run([sys.executable, "-c", _SHAPES_PROBE], env={**base, **env}, capture_output=True, text=True,
                          timeout=300, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def test_importing_tokenswift_caps_what_new_shapes_keep():
    """oneDNN caches a primitive per shape (bfloat16 products on AVX512-BF16/AMX CPUs):
    importing tokenswift caps those caches, and a value the user sets wins. Where this
    CPU's products do not go through oneDNN, neither way grows and the bound holds."""
    from tokenswift.memory import malloc_mib

    if malloc_mib() is None:
        pytest.skip("malloc's heaps cannot be read here (not glibc 2.33+)")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # neither way grows: two fresh processes (~20 s on a 2-core AVX2 CPU) that could not fail
        pytest.skip("this CPU's bfloat16 products do not go through oneDNN: no primitive cache to cap")
    capped = _growth_over_shapes()
    users = _growth_over_shapes(LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert capped <= 0.5 * users + 16, (capped, users)


def test_the_native_cache_caps_leave_a_users_value_but_never_a_crashing_zero(monkeypatch, caplog):
    from tokenswift.memory import cap_native_caches

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "500")
    cap_native_caches(32)
    assert os.environ["LRU_CACHE_CAPACITY"] == "500"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "0")
    with caplog.at_level("WARNING", logger="tokenswift.memory"):
        cap_native_caches(32)
    assert os.environ["LRU_CACHE_CAPACITY"] == "1"
    assert "LRU_CACHE_CAPACITY=0 crashes" in caplog.text
