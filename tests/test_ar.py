"""The autoregressive pipeline against transformers and a plain reference loop."""

import time

import pytest
import torch

from tokenswift import Pipeline, SamplingSpec
from tokenswift.stats import STAGES
from tokenswift.testing import reference_generate, tiny_model_for

ARCHS = ["llama-mha", "llama-gqa", "qwen2"]
GREEDY_NO_PENALTY = {"sampling": {"greedy": True}, "penalty": {"name": "none"}}


def prompt_ids(seed, n=12, vocab=64):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_greedy_equals_transformers_generate(arch, dtype):
    model = tiny_model_for(arch, dtype)
    prompt = prompt_ids(1)
    pipe = Pipeline.from_spec("ar", model, overrides=GREEDY_NO_PENALTY)
    ours = pipe.generate(prompt, 40, ignore_eos=True).tokens
    ids = torch.tensor([prompt])
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert ours == hf[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_windowed_penalty_equals_reference_loop(arch):
    model = tiny_model_for(arch)
    prompt = prompt_ids(2, n=20)
    spec = {"sampling": {"greedy": True}, "penalty": {"name": "contextual", "value": 1.8, "window": 8}}
    ours = Pipeline.from_spec("ar", model, overrides=spec).generate(prompt, 40, ignore_eos=True).tokens
    assert ours == reference_generate(model, prompt, 40, penalty=(1.8, 8))
    # The window matters: an unwindowed penalty decodes differently on this prompt.
    assert ours != reference_generate(model, prompt, 40, penalty=(1.8, 10_000))


def test_sampling_equals_reference_loop_draw_for_draw():
    model = tiny_model_for("llama-gqa")
    prompt = prompt_ids(3)
    spec = {
        "sampling": {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.02},
        "penalty": {"name": "contextual", "value": 1.3, "window": 6},
    }
    ours = Pipeline.from_spec("ar", model, overrides=spec).generate(prompt, 30, seed=7, ignore_eos=True).tokens
    sampling = SamplingSpec(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02)
    assert ours == reference_generate(model, prompt, 30, sampling=sampling, penalty=(1.3, 6), seed=7)


def test_same_seed_same_output_different_seed_differs():
    model = tiny_model_for("llama-mha")
    pipe = Pipeline.from_spec("ar", model)
    prompt = prompt_ids(4)
    first = pipe.generate(prompt, 30, seed=11, ignore_eos=True)
    again = pipe.generate(prompt, 30, seed=11, ignore_eos=True)
    other = pipe.generate(prompt, 30, seed=12, ignore_eos=True)
    assert first.tokens == again.tokens and first.seed == 11
    assert first.tokens != other.tokens


def test_eta_sampling_runs_and_is_seeded():
    model = tiny_model_for("qwen2")
    pipe = Pipeline.from_spec("ar", model, overrides={"sampling": {"eta": 0.001}})
    a = pipe.generate(prompt_ids(5), 20, seed=3, ignore_eos=True).tokens
    assert a == pipe.generate(prompt_ids(5), 20, seed=3, ignore_eos=True).tokens
    assert len(a) == 20


def test_stops_at_eos_unless_ignored():
    model = tiny_model_for("llama-mha")
    pipe = Pipeline.from_spec("ar", model, overrides=GREEDY_NO_PENALTY)
    prompt = prompt_ids(6)
    free = pipe.generate(prompt, 30, ignore_eos=True).tokens
    eos = free[5]
    model.generation_config.eos_token_id = eos
    try:
        result = pipe.generate(prompt, 30)
    finally:
        model.generation_config.eos_token_id = None
    assert result.tokens == free[: free.index(eos) + 1]
    assert result.stats.finish_reason == "eos"


def test_stats_and_stream():
    model = tiny_model_for("llama-mha")
    pipe = Pipeline.from_spec("ar", model, overrides=GREEDY_NO_PENALTY)
    chunks = []
    result = pipe.generate(prompt_ids(7), 25, ignore_eos=True, stream=chunks.append)
    assert [t for c in chunks for t in c.tokens] == result.tokens
    stats = result.stats
    assert (stats.steps, stats.new_tokens, stats.prompt_tokens) == (25, 25, 12)
    assert stats.tokens_per_step == 1.0 and stats.acceptance_rate == 0.0
    assert stats.tokens_per_second > 0 and stats.seconds >= stats.prefill_seconds
    assert set(stats.stage_seconds) == {"propose", "forward", "verify", "commit"}


@pytest.mark.parametrize("spec", ["ar", "eagle", {"preset": "tokenswift", "drafter": {"heads": "random"}}],
                         ids=["ar", "eagle", "tokenswift-heads"])
def test_each_stage_reports_the_part_that_was_the_models(spec):
    """A step's stages say how much of each was the models' own computation (the target's
    forward and LM-head products, the drafter's network): within the stage's time, all
    of the forward's but the Python around it, some of proposing where a drafter's
    network ran, none of committing (planted: the ``eagle`` layer uncharged fails)."""
    model = tiny_model_for("llama-gqa")
    pipe = Pipeline.from_spec(spec, model, overrides={"speculation": {"plain_guard": False}} if spec != "ar" else None)
    records = list(pipe.steps(prompt_ids(7), 12, seed=0, ignore_eos=True))
    for record in records:
        assert set(record.model_seconds) == set(record.stage_seconds)
        assert all(0 <= record.model_seconds[s] <= record.stage_seconds[s] for s in record.stage_seconds)
        assert record.model_seconds["forward"] > 0 and record.model_seconds["commit"] == 0
    proposing = [r.model_seconds["propose"] for r in records]
    assert all(p == 0 for p in proposing) if spec == "ar" else any(p > 0 for p in proposing)
    stats = pipe.generate(prompt_ids(7), 6, seed=0, ignore_eos=True).stats
    assert set(stats.model_stage_seconds) == set(stats.stage_seconds) and stats.model_stage_seconds["forward"] > 0


@pytest.mark.parametrize("tree", ["auto", "fixed"])
def test_the_stage_profile_splits_the_steps_that_verified_a_tree_from_the_plain_ones(tree):
    """``stats.stage_profile()`` totals the step records by kind: a step that verified
    candidates is ``speculated``, one that verified the root alone ``plain`` (also when a
    drafter proposed and the tree choice kept nothing); per kind its steps, tokens and
    stage milliseconds agree with the records a plugin saw."""
    from tokenswift import hookimpl

    seen = []

    class Records:
        @hookimpl
        def tokenswift_step_end(self, pipeline, step):
            seen.append(step)

    model = tiny_model_for("llama-gqa")
    pipe = Pipeline.from_spec("eagle", model, overrides={"speculation": {"tree": tree}})
    pipe.plugin_manager.register(Records())
    stats = pipe.generate(prompt_ids(7), 24, seed=0, ignore_eos=True).stats
    profile = stats.stage_profile()
    for kind, steps in (("speculated", [r for r in seen if r.verified > 0]), ("plain", [r for r in seen if r.verified == 0])):
        if not steps:
            assert kind not in profile
            continue
        got = profile[kind]
        assert got["steps"] == len(steps)
        assert got["tokens_per_step"] == round(sum(len(r.emitted) for r in steps) / len(steps), 3)
        for stage in STAGES:
            assert got["stage_ms"][stage] == pytest.approx(1000 * sum(r.stage_seconds[stage] for r in steps) / len(steps), abs=0.01)
            assert 0 <= got["model_ms"][stage] <= got["stage_ms"][stage] + 0.01
        assert got["ms_per_step"] >= sum(got["stage_ms"].values()) - 0.05  # the wall time holds the stages
    assert sum(kind["steps"] for kind in profile.values()) == stats.steps
    if tree == "fixed":
        assert profile["speculated"]["steps"] > 0 and profile["speculated"]["tokens_per_step"] > 1


def test_a_step_that_proposed_but_verified_nothing_counts_as_plain():
    """The tree choice can keep no candidate of a proposal: that step ran the root alone
    (its proposal's cost shows in the plain steps' propose stage)."""
    from tokenswift.stats import StatsCollector, StepRecord

    collector = StatsCollector()
    stages = dict.fromkeys(STAGES, 0.001)
    for step, (candidates, verified, emitted) in enumerate([(0, 0, 1), (4, 0, 1), (4, 3, 3)]):
        collector(StepRecord(step=step, verified=verified, depth=verified, accepted=emitted - 1, retrieved=0,
                             emitted=[7] * emitted, generated=0, seconds=0.01 * (step + 1), stage_seconds=dict(stages),
                             model_seconds=dict.fromkeys(STAGES, 0.0), candidates=candidates))
    profile = collector.stats(prompt_tokens=3, new_tokens=5, seconds=0.03, prefill_seconds=0.0, finish_reason="length").stage_profile()
    assert (profile["plain"]["steps"], profile["speculated"]["steps"]) == (2, 1)
    assert (profile["plain"]["tokens_per_step"], profile["speculated"]["tokens_per_step"]) == (1.0, 3.0)
    assert profile["speculated"]["ms_per_step"] == pytest.approx(10.0) and profile["speculated"]["other_ms"] == pytest.approx(6.0)


def test_model_time_counts_nested_measures_once():
    from tokenswift.stats import MODEL_TIME

    before = MODEL_TIME.seconds
    started = time.perf_counter()
    with MODEL_TIME.measure():
        with MODEL_TIME.measure():
            time.sleep(0.01)
    elapsed = time.perf_counter() - started
    assert 0.01 <= MODEL_TIME.seconds - before <= elapsed


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_max_new_tokens(bad):
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha"))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        pipe.generate([1, 2], bad)


def test_bad_prompts():
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha"))
    with pytest.raises(ValueError, match="empty"):
        pipe.generate([], 5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pipe.generate([1, 999], 5)
    with pytest.raises(ValueError, match="no tokenizer"):
        pipe.generate("text", 5)
    with pytest.raises(ValueError, match="the prompt has 600 tokens, more than the model's context of 512 positions"):
        pipe.generate([1] * 600, 5)


def test_running_past_the_trained_context_warns(caplog):
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha"), overrides=GREEDY_NO_PENALTY)
    with caplog.at_level("WARNING", logger="tokenswift.pipeline"):
        pipe.generate([1] * 500, 20, ignore_eos=True)
    assert "exceed the model's trained context (512 positions)" in caplog.text
