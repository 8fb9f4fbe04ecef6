"""The prompt's prefill computed in another dtype than the model's (``[model]
prefill_dtype``): the KV it stores is the other dtype's, rounded to the model's; every
preset and ``ar`` start from that same prefill, so runs stay identical to ``ar``."""

import pytest
import torch

from tokenswift import Pipeline
from tokenswift.errors import SpecError
from tokenswift.model.dtypes import prefill_dtype
from tokenswift.model.runner import Runner
from tokenswift.testing import FIXED_TREE, tiny_model_for

PROMPT = [3, 9, 27, 14, 5, 60, 2, 33, 41, 7, 19, 52, 8, 1, 44, 30, 12]


def stored_keys(model, dtype) -> list[torch.Tensor]:
    runner = Runner(model)
    runner.use_prefill_dtype(dtype)
    runner.allocate(len(PROMPT) + 1)
    hidden = runner.prefill(torch.tensor(PROMPT), chunk_size=5, keep_hidden=3)
    assert hidden.dtype == model.dtype
    return [k[:, :, : len(PROMPT)].clone() for k in runner.store.keys]


def reference_keys(model, dtype) -> list[torch.Tensor]:
    """One plain transformers forward of a copy of the model in ``dtype``, its keys
    cast to the model's dtype. Its chunks' own keys are not rounded first, so this
    equals the runner's only where the rounding does not matter (float64 -> float32
    differs in the last bits): compared to a tolerance, not exactly."""
    import copy

    twin = copy.deepcopy(model).to(dtype)
    with torch.inference_mode():
        out = twin(torch.tensor([PROMPT]), use_cache=True)
    return [layer.keys.to(model.dtype) for layer in out.past_key_values.layers]


def test_prefill_in_float64_stores_its_keys_in_the_models_dtype():
    model = tiny_model_for("llama-gqa", dtype="float32")
    wide = stored_keys(model, torch.float64)
    same = stored_keys(model, torch.float32)
    reference = reference_keys(model, torch.float64)
    for layer, (k, k32, ref) in enumerate(zip(wide, same, reference)):
        assert k.dtype == torch.float32
        torch.testing.assert_close(k, ref, rtol=1e-6, atol=1e-6)
        if layer > 0:  # layer 0's keys depend on the embeddings only: the same either way
            assert not torch.equal(k, k32), "the float64 prefill ran in float32"


def test_spec_prefill_dtype_reaches_the_runner():
    model = tiny_model_for("llama-gqa", dtype="float32")
    pipe = Pipeline.from_spec({"preset": "ar", "model": {"prefill_dtype": "float64"}}, model)
    assert pipe.runner.prefill_dtype == torch.float64
    default = Pipeline.from_spec({"preset": "ar"}, model)
    assert default.runner.prefill_dtype == torch.float32  # auto: a float32 model prefills in float32


def test_bad_prefill_dtype_is_named():
    model = tiny_model_for("llama-gqa", dtype="float32")
    with pytest.raises(SpecError, match="prefill_dtype.*'int8'"):
        Pipeline.from_spec({"preset": "ar", "model": {"prefill_dtype": "int8"}}, model)


def test_auto_prefill_dtype_is_float32_only_for_half_models_without_native_bfloat16(monkeypatch):
    import tokenswift.model.dtypes as dtypes

    monkeypatch.setattr(dtypes, "native_bfloat16", lambda device: False)
    assert prefill_dtype("auto", torch.bfloat16, "cpu") == torch.float32
    assert prefill_dtype("auto", torch.float32, "cpu") == torch.float32
    assert prefill_dtype("auto", torch.float64, "cpu") == torch.float64
    assert prefill_dtype("model", torch.bfloat16, "cpu") == torch.bfloat16
    monkeypatch.setattr(dtypes, "native_bfloat16", lambda device: True)
    monkeypatch.setattr(dtypes, "machine_name", lambda device: "a CPU [amx_bf16 avx512_bf16 avx512f avx2]")
    assert prefill_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert prefill_dtype("float32", torch.bfloat16, "cpu") == torch.float32


def probed(monkeypatch, tmp_path, name: str, float32_ms: float, bfloat16_ms: float) -> list:
    """Pin the machine to ``name`` and the many-row probe to these timings (in a cache
    of this test's own); returns the list of dtypes the probe was run for."""
    import tokenswift.model.dtypes as dtypes

    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    monkeypatch.setattr(dtypes, "machine_name", lambda device: name)
    monkeypatch.setattr(dtypes, "native_bfloat16", lambda device: "bf16" in name)
    calls = []

    def probe(dtype):
        calls.append(dtype)
        return float32_ms if dtype == torch.float32 else bfloat16_ms

    monkeypatch.setattr(dtypes, "many_rows_milliseconds", probe)
    return calls


WITHOUT_TILES = "a CPU [avx512_bf16 avx512f avx2]"


def test_auto_prefill_without_amx_takes_the_dtype_the_probe_measures_faster(monkeypatch, tmp_path):
    from tokenswift.model.dtypes import TWIN_MIN_TOKENS, prefill_min_tokens

    calls = probed(monkeypatch, tmp_path / "fast-float32", WITHOUT_TILES, float32_ms=29.0, bfloat16_ms=45.0)
    assert prefill_dtype("auto", torch.bfloat16, "cpu") == torch.float32
    assert prefill_min_tokens("auto", torch.bfloat16, "cpu") == TWIN_MIN_TOKENS
    assert prefill_dtype("auto", torch.bfloat16, "cpu") == torch.float32
    assert len(calls) == 2, "measured again instead of read from the cache"
    assert prefill_min_tokens("float32", torch.bfloat16, "cpu") == 0  # asked for: every prompt
    assert prefill_dtype("auto", torch.float32, "cpu") == torch.float32

    calls = probed(monkeypatch, tmp_path / "close", WITHOUT_TILES, float32_ms=40.0, bfloat16_ms=45.0)
    assert prefill_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16  # within the margin: no copy
    assert prefill_min_tokens("auto", torch.bfloat16, "cpu") == 0

    calls = probed(monkeypatch, tmp_path / "tiles", "a CPU [amx_bf16 avx512_bf16 avx512f avx2]", 29.0, 45.0)
    assert prefill_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert calls == [], "probed on a machine with AMX tiles"

    calls = probed(monkeypatch, tmp_path / "avx2", "a CPU [avx2]", 29.0, 45.0)
    assert prefill_dtype("auto", torch.bfloat16, "cpu") == torch.float32
    assert prefill_min_tokens("auto", torch.bfloat16, "cpu") == 0  # bfloat16 crawls at any length there
    assert calls == []


def test_a_prompt_shorter_than_min_tokens_prefills_in_the_models_dtype():
    model = tiny_model_for("llama-gqa", dtype="bfloat16")

    def keys(prompt, dtype, min_tokens):
        runner = Runner(model)
        runner.use_prefill_dtype(dtype, min_tokens)
        runner.allocate(len(prompt) + 1)
        runner.prefill(torch.tensor(prompt), chunk_size=5)
        return [k[:, :, : len(prompt)].clone() for k in runner.store.keys]

    short, long = PROMPT[:9], PROMPT
    for a, b in zip(keys(short, torch.float32, 10), keys(short, torch.bfloat16, 0)):
        assert torch.equal(a, b)
    wide, narrow = keys(long, torch.float32, 10), keys(long, torch.bfloat16, 0)
    for a, b in zip(wide, keys(long, torch.float32, 0)):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(wide, narrow)), "the long prompt did not prefill in float32"
    with pytest.raises(ValueError, match="min_tokens"):
        Runner(model).use_prefill_dtype(torch.float32, -1)


@pytest.mark.parametrize("preset", ["tokenswift", "eagle"])
def test_presets_equal_ar_when_auto_prefills_long_prompts_in_another_dtype(monkeypatch, preset):
    import tokenswift.pipeline as pipeline

    # what auto gives a machine whose probe chose float32, at this model's scale: the
    # 17-token prompt prefills in float64, the prompts of nothing shorter than 10
    monkeypatch.setattr(pipeline, "prefill_dtype", lambda choice, dtype, device: torch.float64)
    monkeypatch.setattr(pipeline, "prefill_min_tokens", lambda choice, dtype, device: 10)
    model = tiny_model_for("llama-gqa", dtype="float32")
    ar_pipe = Pipeline.from_spec("ar", model, overrides=FIXED_TREE)
    assert (ar_pipe.runner.prefill_dtype, ar_pipe.runner.prefill_min_tokens) == (torch.float64, 10)
    ar = ar_pipe.generate(PROMPT, 40, seed=3, ignore_eos=True)
    fast = Pipeline.from_spec(preset, model, overrides=FIXED_TREE).generate(PROMPT, 40, seed=3, ignore_eos=True)
    assert fast.tokens == ar.tokens


@pytest.mark.parametrize("preset", ["tokenswift", "eagle"])
@pytest.mark.parametrize("greedy", [True, False])
def test_presets_equal_ar_with_a_float64_prefill(preset, greedy):
    model = tiny_model_for("llama-gqa", dtype="float32")
    overrides = {"model": {"prefill_dtype": "float64"}, **FIXED_TREE}
    if greedy:
        overrides["sampling"] = {"greedy": True}
    ar = Pipeline.from_spec("ar", model, overrides=overrides).generate(PROMPT, 40, seed=3, ignore_eos=True)
    fast = Pipeline.from_spec(preset, model, overrides=overrides).generate(PROMPT, 40, seed=3, ignore_eos=True)
    assert fast.tokens == ar.tokens


def test_bfloat16_model_prefilled_in_float32_keeps_bfloat16_kv():
    model = tiny_model_for("llama-gqa", dtype="bfloat16")
    keys = stored_keys(model, torch.float32)
    assert all(k.dtype == torch.bfloat16 for k in keys)
    reference = reference_keys(model, torch.float32)
    for k, ref in zip(keys, reference):
        torch.testing.assert_close(k.float(), ref.float(), rtol=2e-2, atol=2e-2)
