"""The benchmark runs every method on one model and writes JSON, markdown and a plot."""

import json

from tokenswift.tools.bench import BenchConfig, PenaltyProcessor, distinct_n, run_bench, write_reports
from tokenswift.testing import word_tokenizer, looping_model


def test_bench_on_a_tiny_model(tmp_path):
    config = BenchConfig(prompt_tokens=16, new_tokens=40, greedy=True, heads="random", window=8)
    partial, counted = [], {}

    def progress(method, count):
        counted[method] = counted.get(method, 0) + count

    results, info = run_bench(
        config, progress, model=looping_model(dtype="float32"), tokenizer=word_tokenizer(),
        on_method=lambda so_far, _: partial.append([r.method for r in so_far]),
    )
    assert [len(p) for p in partial] == [1, 2, 3, 4, 5, 6, 7] and partial[-1] == [r.method for r in results]
    assert all(counted[r.method] == 40 for r in results), counted  # live progress, transformers' methods too
    by_method = {r.method: r for r in results}
    assert list(by_method) == ["hf-generate", "hf-prompt-lookup", "ar", "tokenswift", "medusa", "eagle", "prompt-lookup"]
    for r in results:
        assert r.error is None and r.new_tokens == 40 and r.tokens_per_second > 0 and r.speedup is not None
    # Greedy: every method emits exactly what ar emits (transformers' included, same windowed penalty).
    assert all(by_method[m].identical_to_ar == 1.0 for m in by_method)
    assert by_method["hf-generate"].speedup == 1.0
    paths = write_reports(results, info, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["config"]["new_tokens"] == 40 and len(data["results"]) == 7
    assert "| tokenswift |" in paths["markdown"].read_text()
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"


def test_distinct_n_and_the_baselines_windowed_penalty():
    assert distinct_n([1, 2, 1, 2, 3], 1) == 3 / 5 and distinct_n([1, 2, 1, 2], 2) == 2 / 3
    import torch

    from tokenswift import Pipeline
    from tokenswift.testing import tiny_model_for

    pipe = Pipeline.from_spec({"preset": "ar", "penalty": {"name": "contextual", "value": 2.0, "window": 2}}, tiny_model_for("llama-mha"))
    scores = torch.ones(1, 5)
    out = PenaltyProcessor(pipe.scorer)(torch.tensor([[0, 1, 2]]), scores.clone())
    assert out.tolist() == [[1.0, 0.5, 0.5, 1.0, 1.0]]  # only the last 2 tokens are penalised
