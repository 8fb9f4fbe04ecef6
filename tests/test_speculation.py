"""Choosing each step's tree: the cost model, corrected confidences, the choice, and
that none of it changes what is emitted."""

import json
import random
import weakref
from pathlib import Path

import attrs

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenswift import Pipeline, SpecError, timing
from tokenswift.calibration import Calibration, calibrate, calibration_for, load_calibration
from tokenswift.costs import CostModel
from tokenswift.drafters.eagle import LevelEconomy
from tokenswift.interfaces import Verdict
from tokenswift.scoring import FEW_PRODUCT_ROWS, ONE_PRODUCT_ROWS
from tokenswift.speculation import (
    GUARD_PRIOR, GUARD_WARM_UP, AcceptanceTracker, AutoSpeculator, DraftGate, RateChooser, StepFacts, choose,
)
from tokenswift.testing import assert_lossless, looping_model, tiny_model_for
from tokenswift.tree import DRAFTER, RETRIEVER, Branch, DraftTree


def calibration(per_node_ms: float, *, base_ms: float = 10.0, score_ms: float = 0.5) -> Calibration:
    """A made-up machine where each extra node costs ``per_node_ms``."""
    nodes = (1, 2, 4, 8, 16, 32, 64)
    row = tuple(base_ms + per_node_ms * (n - 1) for n in nodes)
    return Calibration(
        key="test", machine="test", torch="test", device="cpu", dtype="float32", threads=1,
        packed_from_rows=None, packed_lm_head=False, contexts=(64, 1024), nodes=nodes,
        forward_ms=(row, tuple(t + 5 for t in row)), score_ms=score_ms,
    )


def tree_with(chances):
    """A root with one child per given confidence (drafter nodes at depth 1)."""
    tree = DraftTree.root_only(0)
    tree.add_branches([Branch([i + 1], [c]) for i, c in enumerate(chances)])
    return tree


# -- the cost model -----------------------------------------------------------------------


def test_cost_model_interpolates_extrapolates_and_follows_what_it_observes():
    costs = CostModel(calibration(2.0))
    assert costs.forward_seconds(1, 64) == pytest.approx(0.010)
    assert costs.forward_seconds(3, 64) == pytest.approx(0.014)  # between 2 and 4 nodes
    assert costs.forward_seconds(1, 1024) == pytest.approx(0.015)
    assert costs.forward_seconds(1, 2048) == pytest.approx(0.015 + 5e-3 * 1024 / 960)  # linear in context
    assert costs.forward_seconds(128, 64) > costs.forward_seconds(64, 64)  # past the last measured count
    for _ in range(200):  # the machine turns out twice as slow as calibrated
        costs.observe_forward(1, 64, 0.020)
    assert costs.forward_seconds(1, 64) == pytest.approx(0.020, rel=0.01)
    assert costs.forward_seconds(4, 64) == pytest.approx(0.032, rel=0.01)  # the curve's shape is kept


def test_cost_model_corrects_the_curve_per_size_from_what_the_run_measures():
    """Where a size's forwards take longer than the curve says relative to the others (an
    8-token tree at 1.5x its price, one token as calibrated), that size is priced as
    measured, apart from the machine's drift; sizes between are interpolated, and a size
    seen fewer than SIZE_SEEN times is not corrected yet."""
    from tokenswift.costs import SIZE_SEEN

    costs = CostModel(calibration(2.0))  # 1 token 10 ms, 4 tokens 16, 8 tokens 24 (at 64 positions)
    for _ in range(SIZE_SEEN - 1):
        costs.observe_forward(8, 64, 0.036)
    assert costs.size_factor(8) == 1.0  # not seen often enough
    for _ in range(60):
        costs.observe_forward(1, 64, 0.010)
        costs.observe_forward(8, 64, 0.036)
    assert costs.forward_seconds(1, 64) == pytest.approx(0.010, rel=0.03)
    assert costs.forward_seconds(8, 64) == pytest.approx(0.036, rel=0.03)
    assert costs.forward_seconds(4, 64) == pytest.approx(0.016 * (1 + 0.5 * 3 / 7), rel=0.03)  # between
    assert costs.forward_seconds(16, 64) / costs.forward_seconds(8, 64) == pytest.approx(40 / 24, rel=0.01)  # beyond: as 8
    for _ in range(200):  # the machine slows down by half: every size follows, the shape stays
        costs.observe_forward(1, 64, 0.015)
        costs.observe_forward(8, 64, 0.054)
    assert costs.forward_seconds(4, 64) == pytest.approx(0.024 * (1 + 0.5 * 3 / 7), rel=0.03)


def test_a_size_measured_dear_moves_the_choice_to_smaller_trees():
    tracker = AcceptanceTracker()
    tree = tree_with([0.9, 0.6, 0.5, 0.4, 0.3, 0.3, 0.3, 0.3])
    costs = CostModel(calibration(0.5))
    assert len(choose(tree, tracker, costs, 64, max_nodes=64).keep) == 9  # trees priced cheap: all of it
    for _ in range(40):  # but 8 drafted nodes (9 tokens) measure twice their price, 1-4 tokens as priced
        for nodes in (1, 4):
            costs.observe_forward(nodes, 64, costs.calibration.forward_seconds(nodes, 64))
        costs.observe_forward(9, 64, 2 * costs.calibration.forward_seconds(9, 64))
    assert len(choose(tree, tracker, costs, 64, max_nodes=64).keep) < 9


def test_calibration_of_a_tiny_model_is_measured_cached_and_reloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-gqa", "float32"))
    assert load_calibration(pipe.runner) is None
    measured = calibration_for(pipe.runner, pipe.scorer)
    assert measured.dtype == "float32" and measured.nodes[0] == 1 and len(measured.contexts) >= 1
    for row in measured.forward_ms:  # more nodes never cost less
        assert all(a <= b for a, b in zip(row, row[1:])) and row[0] > 0
    files = list((tmp_path / "calibration").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["format"] == "tokenswift-calibration/2"
    assert load_calibration(pipe.runner) == measured
    other = Pipeline.from_spec("ar", tiny_model_for("llama-gqa", "float64"))
    assert load_calibration(other.runner) is None  # another dtype, another calibration
    assert pipe.runner.store is None or pipe.runner.store.length == 0
    assert measured.head_few_rows_ms is not None and measured.head_few_rows_ms > 0


@pytest.mark.parametrize("before", [{"head_few_rows_ms": None}, {"head_cold": False}], ids=["no-few-rows", "timed-warm"])
def test_a_cached_calibration_from_before_gets_its_scoring_timed_cold_not_the_forwards(tmp_path, monkeypatch, before):
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-gqa", "float32"))
    measured = calibration_for(pipe.runner, pipe.scorer)
    assert measured.head_cold  # a CPU's calibration times scoring cold
    forwards = tuple(tuple(10 * ms for ms in row) for row in measured.forward_ms)
    old = attrs.evolve(measured, forward_ms=forwards, score_ms=123.0, head_ms=123.0, **before)
    old.save()  # as a calibration from before the field was written, or timed with the caches warm
    monkeypatch.setattr("tokenswift.calibration.calibrate", lambda *a, **k: pytest.fail("measured anew"))
    evictions, evictors = [], []

    class Counting(timing.CacheEvictor):
        def __init__(self):
            super().__init__()
            evictors.append(weakref.ref(self))

        def __call__(self):
            evictions.append(1)
            super().__call__()

    monkeypatch.setattr("tokenswift.calibration.CacheEvictor", Counting)
    filled = calibration_for(pipe.runner, pipe.scorer)
    assert len(evictors) == 1 and evictors[0]() is None  # its buffer is not kept for the run
    assert filled.forward_ms == forwards  # kept
    assert filled.head_cold and filled.score_ms != 123.0 and filled.head_ms != 123.0
    assert filled.head_few_rows_ms is not None and filled.head_few_rows_ms > 0
    assert len(evictions) >= 4 * 5  # every timing of the four (score, 1 / few / many rows) after an eviction
    assert load_calibration(pipe.runner) == filled  # saved


def test_evicting_the_caches_writes_twice_the_last_level_cache(monkeypatch):
    evict = timing.CacheEvictor()
    assert evict.buffer.numel() * 4 == 2 * timing.last_level_cache_bytes()
    evict()
    assert bool((evict.buffer == 1).all())
    monkeypatch.setattr(timing, "Path", lambda *_: Path("/nonexistent"))  # no sysfs: the fallback
    assert timing.last_level_cache_bytes() == timing.LLC_FALLBACK_BYTES


def test_calibration_stops_at_node_counts_too_expensive_to_verify():
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha", "float32"))
    measured = calibrate(pipe.runner, pipe.scorer, max_nodes=8)
    assert measured.nodes[-1] <= 8


# -- confidences and the choice --------------------------------------------------------------


def test_tracker_corrects_a_miscalibrated_proposer():
    tracker = AcceptanceTracker()
    assert tracker.corrected(DRAFTER, 1, 0.6) == pytest.approx(0.6)  # no evidence yet: the proposer's word
    tree = tree_with([0.6])
    for _ in range(40):  # proposed at 0.6, never accepted
        tracker.observe(tree, [])
    assert tracker.corrected(DRAFTER, 1, 0.6) < 0.1
    assert tracker.corrected(DRAFTER, 1, 0.05) == pytest.approx(0.05)  # another confidence bin: its own evidence
    for _ in range(40):  # a retriever without estimates whose branches are always accepted
        retrieved = DraftTree.root_only(0)
        retrieved.add_branch([7], source=RETRIEVER)
        tracker.observe(retrieved, [1])
    assert tracker.corrected(RETRIEVER, 1, None) > 0.9


def test_choice_maximises_expected_tokens_per_second():
    tracker = AcceptanceTracker()
    tree = tree_with([0.9, 0.5, 0.2, 0.01])
    free = choose(tree, tracker, CostModel(calibration(0.0)), 64, max_nodes=64)
    assert free.keep == [0, 1, 2, 3, 4]  # nodes cost nothing: verify every candidate
    assert free.expected_tokens == pytest.approx(1 + 0.9 + 0.5 + 0.2 + 0.01)
    dear = choose(tree, tracker, CostModel(calibration(100.0)), 64, max_nodes=64)
    assert dear.keep == [0] and dear.expected_tokens == 1.0  # a plain step
    middle = choose(tree, tracker, CostModel(calibration(3.0)), 64, max_nodes=64)
    assert middle.keep == [0, 1, 2]  # 0.9 and 0.5 pay for 3 ms each, 0.2 does not
    assert choose(tree, tracker, CostModel(calibration(0.0)), 64, max_nodes=2).keep == [0, 1, 2]


def exhaustive_best(tree, tracker, costs, context, max_nodes):
    """The likeliest-k prefix with the best expected tokens per second, every k priced."""
    from tokenswift.speculation import chances

    chance = chances(tree, tracker)
    order = sorted(range(1, len(tree)), key=lambda node: (-chance[node], node))[:max_nodes]
    seconds = best_seconds = costs.forward_seconds(1, context) + costs.scoring_seconds(1.0)
    best_k, best_rate, expected = 0, 1.0 / best_seconds, 1.0
    for k, node in enumerate(order, start=1):
        expected += chance[node]
        seconds = max(seconds, costs.forward_seconds(k + 1, context) + costs.scoring_seconds(expected))
        if expected / seconds > best_rate:
            best_k, best_rate = k, expected / seconds
    return [0, *sorted(order[:best_k])]


@settings(max_examples=300, deadline=None)
@given(
    confidences=st.lists(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4), min_size=1, max_size=16),
    steps_ms=st.lists(st.sampled_from([0.0, 0.1, 1.0, 4.0, 12.0]), min_size=6, max_size=6),
    score_ms=st.sampled_from([0.1, 1.0, 4.0]),
    max_nodes=st.integers(1, 64),
)
def test_the_choice_stops_pricing_only_where_no_later_node_could_win(confidences, steps_ms, score_ms, max_nodes):
    """``choose`` stops walking the candidates once none of the rest could raise the
    rate; it keeps what pricing every one of them keeps, on machines whose forwards
    grow in steps (padded sizes: flat stretches, then a jump)."""
    tree = DraftTree.root_only(0)
    tree.add_branches([Branch([100 * i + j for j in range(len(c))], c) for i, c in enumerate(confidences)])
    row = [10.0]
    for step in steps_ms:  # the forward of 2, 4, 8, ... 64 nodes: never cheaper than fewer
        row.append(row[-1] + step)
    stepped = attrs.evolve(calibration(0.0, score_ms=score_ms), forward_ms=(tuple(row), tuple(t + 5 for t in row)))
    tracker, costs = AcceptanceTracker(), CostModel(stepped)
    assert choose(tree, tracker, costs, 64, max_nodes=max_nodes).keep == exhaustive_best(tree, tracker, costs, 64, max_nodes)


def test_the_choice_keeps_parents_before_children():
    tracker = AcceptanceTracker()
    tree = DraftTree.root_only(0)
    tree.add_branches([Branch([1, 2, 3], [0.9, 1.0, 1.0]), Branch([4, 5], [0.3, 0.1])])
    choice = choose(tree, tracker, CostModel(calibration(0.0)), 64, max_nodes=4)
    kept = tree.subtree(choice.keep)
    assert kept.tokens == [0, 1, 2, 3, 4] and kept.parents == [-1, 0, 1, 2, 0]
    assert [tree.tokens[node] for node in choice.likely_path(tree)] == [1, 2, 3]  # candidate ids


def test_where_many_head_rows_cost_one_the_choice_prices_one_product_and_verifies_more():
    """A calibration whose head product of ONE_PRODUCT_ROWS rows costs little more than
    one row: the nodes a step visits are priced one product plus each node's penalty
    and draw, so a tree of likelier-than-not nodes pays where, priced a whole scoring
    each, it did not (a step's scoring is then partly a fixed cost, which more tokens
    share); the likeliest kept nodes are the ones scored with the root."""
    tracker = AcceptanceTracker()
    tree = DraftTree.root_only(0)
    tree.add_branches([Branch([1, 2, 3], [0.6, 0.6, 0.6]), Branch([4], [0.3])])
    base = calibration(3.0, score_ms=4.0)
    dear = CostModel(attrs.evolve(base, head_ms=3.5, head_rows_ms=14.0))  # 12 rows cost 4x one: not together
    wide = CostModel(attrs.evolve(base, head_ms=3.5, head_rows_ms=3.9))
    assert dear.one_product_rows == 0 and wide.one_product_rows == 12
    assert CostModel(base).one_product_rows == 0  # a calibration from before they were measured
    assert wide.scoring_seconds(3.0) == pytest.approx((3.9 + 0.5 * 3.0) / 1000)
    assert dear.scoring_seconds(3.0) == pytest.approx(4.0 * 3.0 / 1000)
    priced_each = choose(tree, tracker, dear, 64, max_nodes=64)
    priced_once = choose(tree, tracker, wide, 64, max_nodes=64)
    assert len(priced_once.keep) > len(priced_each.keep)
    assert priced_each.keep == [0, 1] and priced_once.keep == [0, 1, 2, 4]
    assert priced_once.likeliest(2) == [1, 2] and priced_once.likeliest(11) == [1, 2, 4]  # by chance: 0.6, 0.36, 0.3


def test_where_only_a_few_head_rows_cost_one_a_step_takes_that_few_in_one_product():
    """12 rows dear but FEW_PRODUCT_ROWS rows at the cost of one (the few-rows kernel on
    a Zen 4): the product takes that many rows and is priced at what they cost."""
    base = calibration(3.0, score_ms=4.0)
    few = CostModel(attrs.evolve(base, head_ms=2.0, head_rows_ms=4.9, head_few_rows_ms=2.1))
    assert few.one_product_rows == FEW_PRODUCT_ROWS == 4
    assert few.scoring_seconds(3.0) == pytest.approx((2.1 + 2.0 * 3.0) / 1000)
    dear = CostModel(attrs.evolve(base, head_ms=2.0, head_rows_ms=4.9, head_few_rows_ms=3.5))
    assert dear.one_product_rows == 0
    both = CostModel(attrs.evolve(base, head_ms=2.0, head_rows_ms=2.2, head_few_rows_ms=2.1))
    assert both.one_product_rows == ONE_PRODUCT_ROWS  # the wider product where it is cheap too


def test_a_step_scores_its_likeliest_nodes_in_one_head_product(monkeypatch):
    """With a calibration that says so, every step computes the LM-head rows of the
    nodes it visits in one product (a node outside the first would take a second),
    and emits the same tokens as steps scored a row at a time."""
    model = looping_model("llama-gqa", "float32")
    # the eagle drafter ranks with its own head: every product of the runner's is scoring
    # (at most 11 kept nodes: all of them fit the one product)
    spec = {"preset": "eagle", "drafter": {"weights": "random"}, "retriever": {"name": "ngram"}, "sampling": {"greedy": True},
            "speculation": {"max_nodes": 11, "plain_guard": False}}  # the made-up costs alone decide
    prompt = [5, 9, 17, 3] * 3  # the looping model repeats it: n-grams hit
    # Nothing measured on this machine steers the run: how deep the drafter goes follows
    # the time its levels take (LevelEconomy), and the tree choice the forwards' measured
    # times (CostModel.observe_forward); on a busy machine they drafted and verified too
    # little to accept 10 tokens.
    monkeypatch.setattr(LevelEconomy, "deepest", lambda self, limit: limit)
    monkeypatch.setattr(CostModel, "observe_forward", lambda self, nodes, context, seconds: None)
    results = {}
    timings = {"narrow": (10.0, 10.0), "few": (10.0, 1.1), "wide": (1.1, 10.0)}  # ms of 12 rows, of 4 rows
    for name, (rows_ms, few_ms) in timings.items():
        pipe = Pipeline.from_spec(spec, model)
        pipe._costs = CostModel(attrs.evolve(calibration(0.0, score_ms=2.0), head_ms=1.0,
                                             head_rows_ms=rows_ms, head_few_rows_ms=few_ms))
        products, logits = [], pipe.runner.logits
        monkeypatch.setattr(pipe.runner, "logits", lambda hidden, products=products, logits=logits:
                            products.append(len(hidden)) or logits(hidden))
        results[name] = pipe.generate(prompt, 60, seed=3, ignore_eos=True), products
    (narrow, narrow_products), (few, few_products), (wide, wide_products) = results.values()
    assert wide.tokens == narrow.tokens == few.tokens and wide.stats.accepted_tokens > 10
    assert len(wide_products) == wide.stats.steps < len(narrow_products)  # one product a step
    assert max(wide_products) > 4  # more than the likely path's rows
    assert max(few_products) == FEW_PRODUCT_ROWS  # the root's and its 3 likeliest nodes'


def test_gate_backs_off_while_proposing_does_not_pay_and_resumes_when_it_does():
    gate = DraftGate(longest=4, trial=2)
    pattern = []
    for _ in range(14):
        drafted = gate.draft()
        pattern.append(drafted)
        if drafted:
            gate.observe(-0.001)  # proposing took a millisecond, nothing was accepted
    # each trial is two steps; the waits between them double up to the longest
    assert pattern == [True, True, False, True, True, False, False, True, True, False, False, False, False, True]
    assert gate.exploring and gate.wait == 0  # a trial has begun: its likeliest candidate is verified
    gate.observe(0.05)  # the trial's second step: an accepted token saved a 50 ms forward, so it paid
    assert gate.backoff == 1 and not gate.exploring and gate.draft()
    gate.observe(-0.001)
    assert gate.draft()  # over the last two steps it still pays
    gate.observe(-0.001)
    assert not gate.draft()  # no longer


def run_arms(chooser: RateChooser, steps: int, arm_step) -> list[bool]:
    """``steps`` picks of ``chooser``, each observed as ``arm_step(arm, step)`` says
    (tokens, seconds)."""
    picks = []
    for step in range(steps):
        arm = chooser.pick()
        picks.append(arm)
        tokens, seconds = arm_step(arm, step)
        chooser.observe(arm, tokens, seconds)
    return picks


def test_rate_chooser_measures_both_arms_then_tries_a_far_slower_one_when_its_estimate_has_aged():
    """Steps of the speculating arm take 31 ms for a token where plain ones take 18 ms
    (an AVX2 machine whose trees do not pay): measured for two steps (it is many standard
    errors behind then), then tried for two steps once its estimate has aged into doubt,
    about once a half-life: 0.2% of the run's steps."""
    chooser = RateChooser(first=False, burst=4, half_life=20.0)
    picks = run_arms(chooser, 8000, lambda arm, step: (1, 0.031 if arm else 0.018))
    assert picks[:7] == [False] * 4 + [True, True, False]
    starts = [step for step in range(1, len(picks)) if picks[step] and not picks[step - 1]]
    assert [picks[step:step + 3] for step in starts] == [[True, True, False]] * len(starts)
    seconds = 8000 * 0.018
    assert 3 <= len(starts) <= 1 + seconds / 10.0 and all((b - a) * 0.018 > 10.0 for a, b in zip(starts, starts[1:]))
    assert chooser.rate(True) == pytest.approx(1 / 0.031) and chooser.rate(False) == pytest.approx(1 / 0.018)
    assert RateChooser().rate(True) is None


def test_rate_chooser_switches_when_the_other_arm_becomes_the_faster():
    """The pass arm pays 3 tokens a step, then (a change of regime) only 1 where the
    other pays 3: its estimate falls within a half-life, the other's (old and in doubt)
    is drawn, and the chooser stays with it."""
    chooser = RateChooser(first=True, half_life=5.0)
    picks = run_arms(chooser, 600, lambda arm, step: ((3 if arm else 1) if step < 200 else (1 if arm else 3), 0.1))
    assert picks[:6] == [True] * 4 + [False] * 2  # each arm measured first (the slower for 2 steps)
    assert picks[6:200].count(False) <= 8  # then the faster, but for a try now and then
    switched = next(step for step in range(200, 600) if not picks[step] and not any(picks[step:step + 50]))
    assert switched < 200 + 50  # within a half-life (50 steps)
    assert picks[switched:].count(True) <= 0.1 * (600 - switched)


def test_rate_chooser_tells_arms_six_percent_apart_from_one_steps_spread_of_35_percent():
    """One step's tokens spread by 35% about their mean (acceptance is a draw) and the
    arms differ by 6% (``eagle``'s speculative steps against plain ones on a 2-core Zen
    4): the faster arm runs most steps, found within the first few hundred; a chooser
    that could not tell them apart would run each half the time."""
    draws = random.Random(7)

    def step(arm, _step):
        return max(0.0, draws.gauss(1.06 if arm else 1.0, 0.35)), 0.02

    for first in (True, False):
        chooser = RateChooser(first=first)
        picks = run_arms(chooser, 2000, step)
        assert picks[:300].count(True) > 150 and picks[300:].count(True) > 0.8 * 1700
        assert picks[300:].count(False) > 0  # the slower is still tried now and then


def test_rate_chooser_is_not_fooled_by_one_unlucky_step():
    """Steps without the pass earn 1-3 tokens in 75 ms (26.7 tokens/s on average), steps
    with it 2 tokens in 100 ms (20): the chooser settles on no pass within its first
    bursts, although the first step it ran without one earned a single token."""
    without = iter([1, 3, 2, 3, 1, 2] * 100)
    picks = run_arms(RateChooser(), 200, lambda arm, step: (2, 0.1) if arm else (next(without), 0.075))
    assert picks[:4] == [True] * 4 and picks[4:8] == [False] * 4  # each arm tried for a burst first
    # then no pass but for a try now and then (a run of ~80 steps is a 32K run's 150
    # tokens; judged a step at a time, an earlier chooser passed until step ~48)
    assert picks[8:80].count(False) >= 60 and picks[100:].count(False) > 85


def test_a_burst_ends_after_two_steps_that_could_not_earn():
    """Steps of the tried arm whose tree choice kept no proposed node (``futile``) end
    its burst after two of them; steps that earned, however few, run the whole burst.
    After a burst that ended so, the next ends at its first futile step."""

    def burst_length(chooser, futile):
        steps = 0
        while chooser.pick():
            steps += 1
            chooser.observe(True, tokens=1, seconds=0.1, futile=futile(steps))
        return steps

    assert burst_length(RateChooser(burst=4), lambda step: False) == 4
    assert burst_length(RateChooser(burst=4), lambda step: step != 2) == 3  # the 1st and 3rd were futile
    chooser = RateChooser(burst=4, half_life=1e-9, z=1e9)  # estimates forgotten: the slower arm drawn often
    assert burst_length(chooser, lambda step: True) == 2
    chooser.observe(False, tokens=3, seconds=0.1)  # the pick that ended the loop began the other arm's burst
    for _ in range(3):
        assert chooser.pick() is False
        chooser.observe(False, tokens=3, seconds=0.1)
    assert burst_length(chooser, lambda step: True) == 1


# -- in the pipeline ---------------------------------------------------------------------------


def with_costs(pipe, per_node_ms):
    pipe._costs = CostModel(calibration(per_node_ms))
    return pipe


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"temperature": 1.0, "min_p": 0.05}])
def test_timings_change_the_trees_never_the_tokens(sampling):
    model = looping_model("llama-gqa", "float32")
    spec = {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 12, "sink": 2, "recent": 3},
            "retriever": {"top_k": 5}, "sampling": sampling,
            "speculation": {"pass_gain": 1000}}  # passes tried whatever they cost (the made-up costs are flat in context)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    cheap = with_costs(Pipeline.from_spec(spec, model), 0.0).generate(prompt, 40, seed=3, ignore_eos=True)
    dear = with_costs(Pipeline.from_spec(spec, model), 1000.0).generate(prompt, 40, seed=3, ignore_eos=True)
    assert cheap.tokens == dear.tokens
    # nodes free: many verified, fewer steps; nodes ruinous: plain steps but for a few
    # explorations (a gated proposer's likeliest candidate, now and then)
    assert cheap.stats.verified_tokens > 40 and cheap.stats.steps < 40
    assert dear.stats.verified_tokens / dear.stats.steps < 0.5 and dear.stats.steps > cheap.stats.steps


def test_speculation_stops_where_its_steps_realise_fewer_tokens_per_second(monkeypatch):
    """A cost the gates and the cost model do not see (here 30 ms of verification for
    every tree of more than the root; on a real machine the scoring of more nodes and
    the drafter's bookkeeping): the plain guard settles on plain steps, but for a burst
    of trials now and then, and the tokens do not change. Nodes are free to the cost
    model, so without the guard the gates alone decide and many more steps verify a tree."""
    import time as clock

    prompt = [5, 6, 7, 8] * 4
    trees = {}
    for guard in (True, False):
        spec = {"preset": "eagle", "drafter": {"weights": "random"}, "retriever": {"name": "ngram"},
                "sampling": {"greedy": True}, "speculation": {"plain_guard": guard}}
        pipe = with_costs(Pipeline.from_spec(spec, looping_model()), 0.0)
        verify = pipe.verifier.verify

        def slow_for_trees(tree, scores, sampler, verify=verify):
            if len(tree) > 1:
                clock.sleep(0.03)
            return verify(tree, scores, sampler)

        monkeypatch.setattr(pipe.verifier, "verify", slow_for_trees)
        records = list(pipe.steps(prompt, 48, seed=0, ignore_eos=True))
        plain = with_costs(Pipeline.from_spec(spec, looping_model()), 0.0).generate(prompt, 48, seed=0, ignore_eos=True)
        assert [token for r in records for token in r.emitted] == plain.tokens
        trees[guard] = [r.verified > 0 for r in records]
    assert trees[True][:4] == [False] * 4 and sum(trees[True][4:8]) >= 2  # plain steps measured first, then trees
    assert sum(trees[True][8:]) <= 0.25 * len(trees[True][8:])  # then plain steps but for trials
    assert sum(trees[False]) >= 2 * sum(trees[True]) and sum(trees[False][8:]) > 0.25 * len(trees[False][8:])


def plain_step(seconds: float = 0.01) -> StepFacts:
    return StepFacts(tree=DraftTree.root_only(1), verdict=Verdict(accepted=[], bonus=2), context=64,
                     forward_seconds=seconds, step_seconds=seconds, proposing_seconds={}, drafting_pass=None,
                     view_seconds=0.0, emitted=1)


def speculator_past_its_plain_burst(seconds: float = 0.01, warm_up: int = 0) -> AutoSpeculator:
    """An AutoSpeculator whose plain guard has measured its plain steps (its first burst),
    judging every speculative step from the first (``warm_up`` 0: no warm-up)."""
    speculator = AutoSpeculator(CostModel(calibration(0.0)), 8, warm_up=warm_up)
    for _ in range(speculator.speculating.burst):
        assert speculator.proposers() == ()
        speculator.learn(plain_step(seconds))
    return speculator


def test_the_guard_ends_a_trial_after_two_steps_whose_tree_kept_no_proposed_node():
    """A step that may speculate, whose proposers ran but whose tree choice kept only the
    root, could not have earned: after two of them the guard's burst ends. A step that
    kept a node counts as a trial step like any other."""

    def facts(tree):
        return StepFacts(tree=tree, verdict=Verdict(accepted=[], bonus=2), context=64, forward_seconds=0.005,
                         step_seconds=0.01, proposing_seconds={DRAFTER: 0.003}, drafting_pass=None,
                         view_seconds=0.0, emitted=1)

    kept = DraftTree.root_only(1)
    kept.add_branch([7], parent=0)
    for tree, steps, left in ((DraftTree.root_only(1), 2, 0), (kept, 3, 1)):
        speculator = speculator_past_its_plain_burst()
        for _ in range(steps):
            assert speculator.proposers() == (DRAFTER, RETRIEVER)
            speculator.learn(facts(tree))
        assert speculator.speculating.left == left  # ended early / the burst's fourth step to come


def test_the_guard_judges_speculative_steps_without_the_catch_up_or_the_view_and_the_gate_without_the_catch_up():
    """What the drafter's proposal spent catching up on the plain steps' text is a cost
    of switching to speculation, and keeping the drafting view one of the pass's that
    the pass chooser leaves out: the guard's rate of speculative steps leaves both out,
    the drafter's gate the catch-up (the step's tokens and the rest of its time count)."""
    tree = DraftTree.root_only(1)
    tree.add_branch([7], parent=0)
    facts = StepFacts(tree=tree, verdict=Verdict(accepted=[1], bonus=2), context=64, forward_seconds=0.01,
                      step_seconds=0.05, proposing_seconds={DRAFTER: 0.03}, drafting_pass=None, view_seconds=0.0,
                      emitted=2)
    rates, earned = [], []
    for catch_up, view in ((0.0, 0.0), (0.02, 0.0), (0.02, 0.4)):
        speculator = speculator_past_its_plain_burst()
        assert speculator.proposers() == (DRAFTER, RETRIEVER)
        speculator.learn(attrs.evolve(facts, step_seconds=0.05 + catch_up + view, view_seconds=view,
                                      proposing_seconds={DRAFTER: 0.03 + catch_up}, catch_up_seconds=catch_up))
        rates.append(speculator.speculating.rate(True))
        earned.append(speculator.gates[DRAFTER].recent[-1])
    expected = 1 + AcceptanceTracker().corrected(DRAFTER, 1, None)  # the step's expected tokens (no evidence yet)
    counted = expected * (2 + GUARD_PRIOR) / (expected + GUARD_PRIOR)  # scaled by drawn / expected (2 tokens drawn)
    assert rates[0] == pytest.approx(counted / 0.05) and rates[1] == pytest.approx(rates[0]) and rates[2] == pytest.approx(rates[0])
    assert earned[1] == pytest.approx(earned[0])


def test_the_guard_takes_a_gain_smaller_than_one_steps_spread_by_what_trees_were_expected_to_emit():
    """Speculative steps emit 1 or 2 tokens (a node accepted 60% of the time) in ~14 ms,
    plain ones 1 token in 10 ms: 14% more tokens a second, while one speculative step's
    rate spreads by ~30%. Judged by the tokens each verified tree was expected to emit
    (the tracker's rates; scaled by what the last speculative steps drew against what
    they were expected to, ~1 here), the guard speculates in nearly every step after
    the first hundred, whatever the draws; judged by the drawn tokens, an unlucky start
    (three steps of one token) kept one of these six runs plain to its end."""

    def share(seed: int) -> float:
        draws = random.Random(seed)
        speculator = AutoSpeculator(CostModel(calibration(0.0)), 8)
        picks = []
        for _ in range(800):
            proposers = speculator.proposers()
            picks.append(bool(proposers))
            if not proposers:
                speculator.learn(plain_step(0.010))
                continue
            tree = DraftTree.root_only(1)
            tree.add_branch(Branch([7], [0.6]))
            accepted = [1] if draws.random() < 0.6 else []
            speculator.learn(StepFacts(
                tree=tree, verdict=Verdict(accepted=accepted, bonus=2), context=64, forward_seconds=0.012,
                step_seconds=0.014 * draws.uniform(0.9, 1.1), proposing_seconds={DRAFTER: 0.001}, drafting_pass=None,
                view_seconds=0.0, emitted=1 + len(accepted)))
        return picks[100:].count(True) / 700

    assert min(share(seed) for seed in range(6)) > 0.95


def test_the_guard_leaves_its_first_proposing_steps_unjudged():
    """The first GUARD_WARM_UP steps whose proposers ran draft deeper than later ones
    and run the trees' graphs for the first time: the tracker, the gates and the cost
    model learn from them, the plain guard does not. Speculative steps that earn 8% more
    tokens a second than plain ones, but whose first 8 took 1.5x their time: the guard
    speculates in nearly every step after the first hundred (judged from the first step,
    it kept plain steps to the end of each of these runs)."""
    speculator = speculator_past_its_plain_burst(warm_up=GUARD_WARM_UP)
    tree = DraftTree.root_only(1)
    tree.add_branch([7], parent=0)
    facts = StepFacts(tree=tree, verdict=Verdict(accepted=[1], bonus=2), context=64, forward_seconds=0.012,
                      step_seconds=0.05, proposing_seconds={DRAFTER: 0.001}, drafting_pass=None, view_seconds=0.0,
                      emitted=2)
    for _ in range(GUARD_WARM_UP):
        assert speculator.proposers() == (DRAFTER, RETRIEVER)  # the burst goes on while nothing is judged
        speculator.learn(facts)
    assert speculator.speculating.samples[True] == 0 and speculator.gates[DRAFTER].recent  # the gate learnt
    assert speculator.tracker.tried_by_depth[(DRAFTER, 1)] == GUARD_WARM_UP
    speculator.proposers()
    speculator.learn(attrs.evolve(facts, step_seconds=0.014))
    assert speculator.speculating.samples[True] == 1

    def share(seed: int) -> float:
        draws = random.Random(seed)
        speculator = AutoSpeculator(CostModel(calibration(0.0)), 8)
        picks, speculative = [], 0
        for _ in range(600):
            proposers = speculator.proposers()
            picks.append(bool(proposers))
            if not proposers:
                speculator.learn(plain_step(0.010 * draws.uniform(0.88, 1.12)))
                continue
            tree = DraftTree.root_only(1)
            tree.add_branch(Branch([7], [0.6]))
            accepted = [1] if draws.random() < 0.6 else []
            seconds = 0.016 / 1.08 * draws.uniform(0.88, 1.12) * (1.5 if speculative < 8 else 1.0)
            speculative += 1
            speculator.learn(StepFacts(
                tree=tree, verdict=Verdict(accepted=accepted, bonus=2), context=64, forward_seconds=0.8 * seconds,
                step_seconds=seconds, proposing_seconds={DRAFTER: 0.001}, drafting_pass=None, view_seconds=0.0,
                emitted=1 + len(accepted)))
        return picks[100:].count(True) / 500

    assert min(share(seed) for seed in range(6)) > 0.8


def test_a_step_that_compiled_a_graph_teaches_the_choosers_and_gates_nothing():
    """A graph met for the first time compiles inside a step (seconds): that step's
    timings say nothing of the steps to come, so neither the plain guard, the pass
    chooser, the gates nor the cost model learn from them (only the acceptance does)."""
    speculator = speculator_past_its_plain_burst()
    assert speculator.proposers() == (DRAFTER, RETRIEVER)  # the guard's second burst speculates
    tree = DraftTree.root_only(1)
    tree.add_branch([7], parent=0)
    facts = StepFacts(tree=tree, verdict=Verdict(accepted=[1], bonus=2), context=64, forward_seconds=5.0,
                      step_seconds=5.0, proposing_seconds={DRAFTER: 0.001}, drafting_pass=True, view_seconds=0.0,
                      emitted=2, compile_seconds=4.9)
    speculator.learn(facts)
    assert speculator.speculating.samples == {True: 0, False: 4} and speculator.passes.samples == {True: 0, False: 0}
    assert not speculator.gates[DRAFTER].recent and speculator.tracker.depth_rate(DRAFTER, 1) > 0.05
    speculator.proposers()
    speculator.learn(attrs.evolve(facts, compile_seconds=0.0))  # the same step without a compile
    assert speculator.speculating.samples[True] == speculator.passes.samples[True] == 1
    assert len(speculator.gates[DRAFTER].recent) == 1


def test_auto_trees_are_lossless_and_report_their_decisions():
    spec = {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 14, "sink": 2, "recent": 4},
            "retriever": {"top_k": 5}, "sampling": {"temperature": 1.0, "min_p": 0.1}}
    pipe = with_costs(Pipeline.from_spec(spec, looping_model()), 0.5)
    result = assert_lossless(pipe, [5, 6, 7, 8] * 4, 40, seed=2)
    decisions = result.stats.decisions()
    assert decisions["verified_per_step"] <= decisions["candidates_per_step"]
    assert decisions["predicted_tokens_per_step"] >= 1.0 and decisions["realised_tokens_per_step"] >= 1.0
    assert decisions["forward_ms_per_step"] > 0 and result.stats.summary()["dtype"] == "float64"


def test_no_drafting_pass_over_the_whole_context_and_passes_over_a_partial_view():
    passes = {}
    for budget in (512, 12):  # the whole context fits / it does not
        spec = {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": budget, "sink": 2, "recent": 3},
                "speculation": {"pass_gain": 1000}}
        pipe = with_costs(Pipeline.from_spec(spec, tiny_model_for("llama-gqa")), 0.0)
        records = list(pipe.steps(list(range(1, 20)), 24, seed=0, ignore_eos=True))
        passes[budget] = sum(r.drafting_pass for r in records)
    assert passes[512] == 0 and passes[12] > 0


def context_calibration(per_position_ms: float) -> Calibration:
    """A made-up machine whose one-token forward costs 1 ms plus ``per_position_ms`` a
    position of context (nodes cost nothing more)."""
    nodes = (1, 2, 4, 8, 16, 32, 64)
    return Calibration(
        key="test", machine="test", torch="test", device="cpu", dtype="float32", threads=1,
        packed_from_rows=None, packed_lm_head=False, contexts=(0, 100), nodes=nodes,
        forward_ms=((1.0,) * len(nodes), (1.0 + 100 * per_position_ms,) * len(nodes)), score_ms=0.5,
    )


@pytest.mark.parametrize("per_position_ms", [0.0, 0.01, 5.0])
def test_a_drafting_pass_is_tried_only_where_it_can_pay(per_position_ms):
    """A pass over the 13-position view costs a one-token forward over it: where that
    is more than ``pass_gain`` (here 0.5) tokens' worth at the context (a forward over 18+
    positions) the pass chooser never tries one, and the view is never refreshed;
    where the context's forward costs far more than the view's, passes are tried (and
    pay here: nodes are free). The tokens are the same either way."""
    spec = {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 12, "sink": 2, "recent": 3},
            "sampling": {"greedy": True}, "speculation": {"plain_guard": False, "pass_gain": 0.5}}
    pipe = Pipeline.from_spec(spec, tiny_model_for("llama-gqa"))
    pipe._costs = CostModel(context_calibration(per_position_ms))
    records = list(pipe.steps(list(range(1, 20)), 24, seed=0, ignore_eos=True))
    passes = sum(r.drafting_pass for r in records)
    if per_position_ms < 1.0:  # 13 positions cost more than half of 18-43
        assert passes == 0 and pipe.cache_policy.refreshes == 0
    else:  # 1 + 65 ms against half of 91-216 ms
        assert passes > 0 and pipe.cache_policy.refreshes > 0
    ar = Pipeline.from_spec({"preset": "ar", "sampling": {"greedy": True}}, tiny_model_for("llama-gqa"))
    assert [t for r in records for t in r.emitted] == ar.generate(list(range(1, 20)), 24, seed=0, ignore_eos=True).tokens


def test_the_drafting_view_is_kept_only_at_steps_whose_pass_runs(monkeypatch):
    """A policy that says whether its view is partial without keeping it (the
    refreshing ones) has :meth:`update_view` called only at steps whose pass runs; one
    that cannot say has it called at every step that asks for a pass, as before. The
    runs emit the same tokens either way. The pass chooser is pinned to run every other
    pass it is asked for: left to its measured rates it chose passes by the machine's
    timings. (How many refreshes each run makes is no property: the views differ, so
    do the drafts and the steps' lengths; the lazy run refreshed once more than the
    eager one in about one run in ten on a loaded 2-core machine.)"""

    def every_other(chooser):
        chooser.asked = getattr(chooser, "asked", 0) + 1
        return chooser.asked % 2 == 1

    monkeypatch.setattr(RateChooser, "pick", every_other)
    spec = {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 12, "sink": 2, "recent": 3},
            "sampling": {"greedy": True},
            "speculation": {"plain_guard": False, "pass_gain": 1000}}  # every step may speculate, and pass
    runs = {}
    for policy_can_say in (True, False):
        pipe = with_costs(Pipeline.from_spec(spec, tiny_model_for("llama-gqa")), 0.0)
        policy, kept_at = pipe.cache_policy, []
        if not policy_can_say:
            monkeypatch.setattr(policy, "partial", lambda committed_positions: None)
        update_view = policy.update_view

        def keeping(state, update_view=update_view, kept_at=kept_at):
            kept_at.append(state.step)
            return update_view(state)

        monkeypatch.setattr(policy, "update_view", keeping)
        records = list(pipe.steps(list(range(1, 20)), 40, seed=0, ignore_eos=True))
        passes = [r.step - 1 for r in records if r.drafting_pass]  # a record's step counts the step itself
        runs[policy_can_say] = ([t for r in records for t in r.emitted], kept_at, passes, policy.refreshes)
    (tokens, kept_at, passes, refreshes), (eager_tokens, eager_kept_at, eager_passes, eager_refreshes) = runs[True], runs[False]
    assert tokens == eager_tokens
    assert passes and kept_at == passes  # kept exactly at the steps that ran a pass
    assert len(eager_kept_at) > len(eager_passes)  # kept at every step that asked, pass or not
    assert 0 < refreshes <= len(passes) and eager_refreshes > 0


def test_fixed_trees_verify_every_candidate_with_a_pass_each_step():
    spec = {"preset": "tokenswift", "drafter": {"heads": "random", "tree": [2, 2]}, "retriever": {"name": "none"},
            "cache": {"name": "full"}, "speculation": {"tree": "fixed"}}
    records = list(Pipeline.from_spec(spec, tiny_model_for("llama-gqa")).steps([1, 2, 3], 12, seed=0))
    assert all(r.verified == r.candidates == 6 and r.drafting_pass and r.predicted_tokens is None for r in records)


@pytest.mark.parametrize(
    ("speculation", "message"),
    [({"tree": "dynamic"}, r"speculation.tree must be one of \['auto', 'fixed'\], got 'dynamic'"),
     ({"max_nodes": -1}, r"speculation.max_nodes must be an integer >= 0, got -1"),
     ({"plain_guard": "yes"}, r"speculation.plain_guard must be true or false, got 'yes'"),
     ({"pass_gain": -0.5}, r"speculation.pass_gain must be a number >= 0, got -0.5"),
     ({"pass_gain": "high"}, r"speculation.pass_gain must be a number >= 0, got 'high'"),
     ({"nodes": 3}, r"\[speculation\] has unknown option\(s\) \['nodes'\]")],
)
def test_bad_speculation_settings(speculation, message):
    with pytest.raises(SpecError, match=message):
        Pipeline.from_spec({"preset": "tokenswift", "speculation": speculation}, tiny_model_for("llama-mha"))


def test_a_calibration_with_one_node_count_extrapolates_in_proportion():
    single = attrs.evolve(calibration(2.0), nodes=(1,), forward_ms=((10.0,), (15.0,)))
    costs = CostModel(single)
    assert costs.forward_seconds(3, 64) == pytest.approx(0.030) and costs.forward_seconds(1, 64) == pytest.approx(0.010)


def test_scoring_in_one_product_is_lossless_under_sampling():
    """The likeliest nodes' rows computed in one product, the paper's kind of sampling:
    the distribution test of every run (assert_lossless)."""
    spec = {"preset": "eagle", "drafter": {"weights": "random"}, "retriever": {"name": "ngram"},
            "sampling": {"temperature": 1.0, "min_p": 0.1}}
    pipe = Pipeline.from_spec(spec, looping_model())
    pipe._costs = CostModel(attrs.evolve(calibration(0.0, score_ms=2.0), head_ms=1.0, head_rows_ms=1.1))
    assert pipe._costs.one_product_rows == 12
    result = assert_lossless(pipe, [5, 9, 17, 3] * 3, 40, seed=2)
    assert result.stats.verified_tokens > 0
