"""The same contracts on a CUDA device: lossless decoding, the caches' selections,
training and the benchmark. Skipped where no GPU is present (CI has none); run on a
GPU machine with ``python -m pytest tests/test_cuda.py``."""

import copy

import pytest
import torch

from tokenswift import Pipeline
from tokenswift.tools.bench import BenchConfig, run_bench
from tokenswift.tools.training import TrainConfig, train_heads
from tokenswift.testing import FIXED_TREE, TINY_CONFIGS, assert_lossless, looping_model, tiny_model, word_tokenizer

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

CACHES = {
    "full": {"name": "full"},
    "dynamic": {"name": "dynamic", "budget": 14, "sink": 2, "recent": 4},
    "streaming": {"name": "streaming", "budget": 12, "sink": 2, "recent": 3},
}
SAMPLINGS = {
    "greedy": {"greedy": True},
    "min-p": {"temperature": 1.0, "min_p": 0.1},
    "top-k/top-p": {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    "eta": {"eta": 0.01},
}


def cuda_model(name: str = "llama-gqa", dtype: str = "float64"):
    return tiny_model(TINY_CONFIGS[name], seed=0, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("preset", ["ar", "tokenswift", "medusa", "eagle", "prompt-lookup"])
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_presets_are_lossless_on_cuda(preset, cache, sampling):
    overrides = {"cache": CACHES[cache], "sampling": SAMPLINGS[sampling]}
    if preset in ("tokenswift", "medusa"):
        overrides["drafter"] = {"heads": "random"}
    if preset == "eagle":
        overrides["drafter"] = {"weights": "random"}
    pipe = Pipeline.from_spec(preset, cuda_model(), overrides=overrides)
    assert pipe.runner.device.type == DEVICE
    result = assert_lossless(pipe, [5, 6, 7, 8] * 6, 32, seed=3)
    assert len(result.tokens) == 32


@pytest.mark.parametrize("arch", ["llama-mha", "qwen2"])
def test_other_architectures_on_cuda(arch):
    spec = {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": CACHES["dynamic"]}
    assert_lossless(Pipeline.from_spec(spec, cuda_model(arch)), [1, 2, 3, 4] * 5, 24, seed=0)


def test_float32_greedy_presets_match_ar_on_cuda():
    model = cuda_model(dtype="float32")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    runs = {}
    for preset in ("ar", "tokenswift", "medusa", "eagle", "prompt-lookup"):
        overrides = {"sampling": {"greedy": True}}
        if preset in ("tokenswift", "medusa"):
            overrides["drafter"] = {"heads": "random"}
        if preset == "eagle":
            overrides["drafter"] = {"weights": "random"}
        runs[preset] = Pipeline.from_spec(preset, model, overrides=overrides).generate(prompt, 48, ignore_eos=True).tokens
    assert all(tokens == runs["ar"] for tokens in runs.values()), runs


def test_training_on_cuda(tmp_path):
    from tests.test_training import CONFIG, cyclic_corpus

    model = copy.deepcopy(looping_model()).to(DEVICE)
    record = train_heads(model, cyclic_corpus(), tmp_path, TrainConfig(steps=40, **CONFIG))
    assert min(record["held_out_accuracy"]["top1"]) > 0.9  # a deterministic cycle is learnable
    spec = {"preset": "tokenswift", "drafter": {"heads": str(tmp_path)}, "sampling": {"greedy": True}, "penalty": {"name": "none"}, **FIXED_TREE}
    result = assert_lossless(Pipeline.from_spec(spec, model), [3, 1, 4], 40)
    assert result.stats.tokens_per_step > 3  # the trained heads are accepted


def test_bench_on_cuda(tmp_path):
    config = BenchConfig(prompt_tokens=16, new_tokens=40, greedy=True, heads="random", window=8)
    model = copy.deepcopy(looping_model(dtype="float32")).to(DEVICE)  # the cached one stays on the CPU
    results, info = run_bench(config, model=model, tokenizer=word_tokenizer())
    assert info.get("gpu") == (torch.cuda.get_device_name() if DEVICE == "cuda" else None)
    for r in results:
        assert r.error is None and r.new_tokens == 40, r
        assert (r.peak_gpu_mib > 0) if DEVICE == "cuda" else (r.peak_gpu_mib is None), r
        assert r.identical_to_ar == 1.0, r
