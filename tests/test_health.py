"""Text health: distinct-n over the last tokens and the model's own NLL of what it
emitted, in every generation's statistics, the summary line, the progress bar and
--stats-json; a loop is warned about."""

import json
import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenswift import Pipeline
from tokenswift.cli import main
from tokenswift.health import TextHealthMonitor
from tokenswift.testing import FIXED_TREE, looping_model, tiny_model_for

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def brute_distinct(tokens, n):
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else math.nan


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=0, max_size=120),
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=40),
    window=st.integers(4, 40),
    primed=st.lists(st.integers(0, 5), max_size=30),
)
def test_the_monitor_equals_a_recount_over_the_window(tokens, chunks, window, primed):
    """Kept incrementally (n-grams in as a token comes, out as the oldest leaves), the
    figures equal a recount over the last ``window`` tokens after every push."""
    monitor = TextHealthMonitor(window=window, loop_threshold=0)
    monitor.prime(primed)
    nlls = [0.25 * (t + 1) for t in tokens]
    seen, i, k = list(primed), 0, 0
    while i < len(tokens):
        size = chunks[k % len(chunks)]
        monitor.push(tokens[i : i + size], nlls[i : i + size])
        seen += tokens[i : i + size]
        i, k = min(i + size, len(tokens)), k + 1
        health = monitor.health()
        last = seen[-window:]
        assert health.window_tokens == len(last)
        for n in range(1, 5):
            expected = brute_distinct(last, n)
            assert (math.isnan(expected) and math.isnan(health.distinct[n - 1])) or health.distinct[n - 1] == pytest.approx(expected)
        assert health.self_nll == pytest.approx(sum(nlls[:i]) / i)
        recent = nlls[:i][-window:]
        assert health.recent_self_nll == pytest.approx(sum(recent) / len(recent))


def test_a_bad_loop_threshold_is_refused_before_anything_runs():
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-gqa", "float32"))
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="loop_threshold"):
            pipe.generate(PROMPT, 4, loop_threshold=bad)


@pytest.mark.parametrize("preset", ["ar", "prompt-lookup"])
def test_the_self_nll_is_the_models_own_from_the_raw_logits(preset):
    """Each emitted token's NLL is -log softmax of the model's raw logits at its position
    (not the penalized, warped scores it was drawn from), for drafted tokens accepted
    below the root as for the bonus token: a full recompute of the text agrees."""
    model = looping_model("llama-gqa", "float64")
    overrides = {"sampling": {"greedy": True}, "penalty": {"name": "contextual", "value": 1.5, "window": 16}, **FIXED_TREE}
    pipe = Pipeline.from_spec(preset, model, overrides=overrides)
    records = list(pipe.steps(PROMPT, 60, seed=0, ignore_eos=True))
    tokens = [t for r in records for t in r.emitted]
    nll = [v for r in records for v in r.nll]
    assert len(nll) == len(tokens) == 60
    if preset == "prompt-lookup":
        assert sum(r.accepted for r in records) > 10  # drafted tokens were accepted: their parents are tree nodes
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]  # [60, vocab]
    expected = -torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(nll, dtype=torch.float64), expected, rtol=1e-5, atol=1e-5)
    health = records[-1].health
    assert health.self_nll == pytest.approx(expected.mean().item())


def test_a_forced_loop_drops_distinct_4_and_is_warned_about(caplog):
    """The looping model falls into a short cycle under greedy decoding without the
    penalty: distinct-4 falls far below healthy text's, and a warning says so once."""
    overrides = {"sampling": {"greedy": True}, "penalty": {"name": "none"}}
    pipe = Pipeline.from_spec("tokenswift", looping_model("llama-gqa", "float32"), overrides=overrides)
    with caplog.at_level(logging.WARNING, logger="tokenswift.health"):
        looped = pipe.generate(PROMPT, 400, seed=0, ignore_eos=True).stats.summary()
    warnings = [r.getMessage() for r in caplog.records if r.name == "tokenswift.health"]
    assert looped["distinct_4"] < 0.1
    assert len(warnings) == 1 and "loop" in warnings[0] and "distinct-4" in warnings[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenswift.health"):
        pipe.generate(PROMPT, 400, seed=0, ignore_eos=True, loop_threshold=0)  # 0: never warn
    assert not [r for r in caplog.records if r.name == "tokenswift.health"]


def test_forced_noise_raises_the_self_nll_and_keeps_distinct_n_high(caplog):
    """Sampling a tiny model far above its temperature writes noise: the model's own
    NLL of it is far above that of its greedy text, and its n-grams are all distinct."""
    model = tiny_model_for("llama-gqa", "float32")
    greedy = Pipeline.from_spec("ar", model, overrides={"sampling": {"greedy": True}, "penalty": {"name": "none"}})
    noisy = Pipeline.from_spec(
        "ar", model, overrides={"sampling": {"temperature": 50.0, "min_p": 0.0}, "penalty": {"name": "none"}}
    )
    with caplog.at_level(logging.WARNING, logger="tokenswift.health"):
        calm = greedy.generate(PROMPT, 300, seed=0, ignore_eos=True).stats.summary()
        noise = noisy.generate(PROMPT, 300, seed=0, ignore_eos=True).stats.summary()
    assert noise["self_nll"] > calm["self_nll"] + 1.0
    assert noise["self_nll"] > 0.6 * math.log(64)  # near the uniform draw's log(vocab)
    assert noise["distinct_4"] > 0.95 and noise["distinct_1"] < noise["distinct_4"]


def test_the_summary_line_stats_json_and_progress_bar_carry_the_health(model_dir, tmp_path, capsys, caplog):
    stats_file = tmp_path / "stats.json"
    caplog.set_level(logging.WARNING, logger="tokenswift.health")
    code = main([
        "generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", "a dog", "--max-new-tokens", "300",
        "--greedy", "--ignore-eos", "--out", str(tmp_path / "o.txt"), "--stats-json", str(stats_file),
        "--loop-threshold", "1",
    ])
    err = capsys.readouterr().err
    assert code == 0, err
    stats = json.loads(stats_file.read_text())
    for key in ("distinct_1", "distinct_2", "distinct_3", "distinct_4", "self_nll", "recent_self_nll"):
        assert isinstance(stats[key], float) and f"{key}={stats[key]}" in err
    bar = [line for line in err.replace("\r", "\n").splitlines() if "300/300" in line][-1]
    assert "distinct-4" in bar and "NLL" in bar, bar
    # at threshold 1 any repeated 4-gram is "a loop": warned about exactly when one occurred
    warned = [r for r in caplog.records if r.name == "tokenswift.health" and "looks like a loop" in r.getMessage()]
    assert len(warned) == (stats["distinct_4"] < 1.0)


@pytest.mark.parametrize("value", ["-1", "1.5", "nan"])
def test_a_bad_loop_threshold_is_one_line_exit_2(value, model_dir, tmp_path, capsys):
    out = tmp_path / "o.txt"
    code = main(["generate", "--model", str(model_dir), "--prompt", "a dog", "--loop-threshold", value, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--loop-threshold" in err and value in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
