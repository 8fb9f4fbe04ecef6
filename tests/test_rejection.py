"""The ``rejection`` verifier: lossless in distribution, checked exactly.

Every random choice a step makes (the drafter's draws from q, each child's test, the
residual draw) goes through the sampler, so an enumerating sampler can follow every
branch of them with its probability, through the real drafter -> tree -> verifier ->
commit path. One step's emitted tokens, continued by autoregressive decoding, must give
every sequence of the step's longest output exactly the probability autoregressive
decoding gives it (float64, to 1e-12). Each planted bug below breaks that."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tokenswift import Pipeline, SpecError, get_plugin_manager, hookimpl
from tokenswift.interfaces import Drafter
from tokenswift.model.loading import tiny_model
from tokenswift.sampling import Sampler
from tokenswift.testing import TINY_CONFIGS
from tokenswift.tree import SampledChildren
from tokenswift.verifiers import rejection

VOCAB = 5
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive: the n-gram retriever adds point-mass children
LONGEST = 3  # a step emits at most depth 2 + the bonus
SPEC = {
    "preset": "ar",
    "drafter": {"name": "q-drafter"},
    "retriever": {"name": "ngram", "n": 2, "top_k": 2},
    "cache": {"name": "full"},
    "verifier": {"name": "rejection"},
    "penalty": {"name": "contextual", "value": 1.5, "window": 3},
    "sampling": {"temperature": 1.5, "top_k": 4, "min_p": 0.0},  # min_p off: the presets filter to near one-hot here
    "speculation": {"tree": "fixed"},
}


class QDrafter(Drafter):
    """Draws two children of the root from its q, and one child of the first of them:
    q a fixed table by the last token, through the pipeline's penalty and warpers (the
    same processing as the target's scores), so it differs from the target's p."""

    record_raw_q = False  # planted bug: record q before the warpers (draw after them)

    def __init__(self, options, context):
        super().__init__(options, context)
        generator = torch.Generator().manual_seed(11)
        self.table = torch.randn(VOCAB, VOCAB, generator=generator, dtype=torch.float64) * 1.5

    @property
    def max_tree_nodes(self):
        return 3

    def q(self, tokens):
        scorer = self.context.scorer
        raw = self.table[tokens[-1]][None]
        processed = scorer(scorer.context(tokens), raw)[0].softmax(-1)
        return processed, raw[0].softmax(-1)

    def propose(self, state, inputs):
        q, raw = self.q(state.tokens)
        first = inputs.draw_drafts(q, 2, 1)
        if first is None:
            return []
        out = [SampledChildren([], raw if self.record_raw_q else q, first)]
        q2, raw2 = self.q(state.tokens + first[:1])
        second = inputs.draw_drafts(q2, 1, 2)
        out.append(SampledChildren(first[:1], raw2 if self.record_raw_q else q2, second))
        return out


class Plugin:
    @hookimpl
    def tokenswift_register_components(self, registrar):
        registrar.add("drafter", "q-drafter", QDrafter)


def plugin_manager():
    pm = get_plugin_manager()
    if "q-drafter-plugin" not in {name for name, _ in pm.list_name_plugin()}:
        pm.register(Plugin(), name="q-drafter-plugin")
    return pm


class Enumerating(Sampler):
    """Takes the choices in ``forced``, then the first option of every new choice;
    records each choice's options and probabilities."""

    def __init__(self, forced):
        self.forced, self.choices = list(forced), []  # choices: [(options as (value, prob)), taken]

    def _pick(self, options):
        options = [(value, prob) for value, prob in options if prob > 0]
        taken = self.forced[len(self.choices)] if len(self.choices) < len(self.forced) else 0
        self.choices.append((options, taken))
        return options[taken][0]

    def draw(self, scores, position):
        raise AssertionError("the rejection verifier draws no coupled token")

    def accept(self, probability, position, stream):
        return self._pick([(True, min(probability, 1.0)), (False, 1.0 - min(probability, 1.0))])

    def without_replacement(self, probs, k, position, stream):
        probs, drawn = probs.to(torch.float64).clone(), []
        for _ in range(min(k, int((probs > 0).sum()))):
            token = self._pick([(t, float(probs[t])) for t in range(len(probs))])
            drawn.append(token)
            probs[token] = 0
            probs = probs / probs.sum() if probs.sum() > 0 else probs
        return drawn

    @property
    def weight(self):
        return math.prod(options[taken][1] for options, taken in self.choices)


def step_distribution(pipe):
    """{emitted tokens: probability} of one step after PROMPT, over every choice."""
    result, stack = {}, [[]]
    while stack:
        forced = stack.pop()
        run = pipe.start(PROMPT, LONGEST, seed=0, ignore_eos=True)
        sampler = run.sampler = Enumerating(forced)
        emitted = tuple(next(run.steps()).emitted)
        result[emitted] = result.get(emitted, 0.0) + sampler.weight
        for depth in range(len(forced), len(sampler.choices)):
            taken = [t for _, t in sampler.choices[:depth]]
            stack.extend(taken + [alt] for alt in range(1, len(sampler.choices[depth][0])))
    return result


class Autoregressive:
    """Exact autoregressive probabilities with the pipeline's model and scorer."""

    def __init__(self, pipe):
        self.pipe, self.cache = pipe, {}

    def next(self, tokens):
        key = tuple(tokens)
        if key not in self.cache:
            scorer = self.pipe.scorer
            with torch.inference_mode():
                logits = self.pipe.model(torch.tensor([list(tokens)])).logits[:, -1].double()
            self.cache[key] = torch.softmax(scorer(scorer.context(list(tokens)), logits)[0], -1)
        return self.cache[key]

    def prob(self, prefix, continuation):
        p, tokens = 1.0, list(prefix)
        for token in continuation:
            p *= float(self.next(tokens)[token])
            tokens.append(token)
        return p


def assert_exact(pipe):
    step = step_distribution(pipe)
    ar = Autoregressive(pipe)
    worst = abs(sum(step.values()) - 1.0)  # the step's outcomes are all there is
    for sequence in itertools.product(range(VOCAB), repeat=LONGEST):
        expected = ar.prob(PROMPT, sequence)
        got = sum(w * ar.prob(PROMPT + list(e), sequence[len(e):]) for e, w in step.items() if tuple(sequence[: len(e)]) == e)
        worst = max(worst, abs(got - expected))
    assert worst < 1e-12, f"emitted sequences off autoregressive decoding by up to {worst:.3g}"
    return step


@pytest.fixture(scope="module")
def model():
    return tiny_model(dict(TINY_CONFIGS["llama-mha"], vocab_size=VOCAB), dtype="float64", seed=3)


def test_rejection_sampling_is_exactly_autoregressive(model):
    pipe = Pipeline.from_spec(SPEC, model, plugin_manager=plugin_manager())
    step = assert_exact(pipe)
    assert max(len(e) for e in step) == LONGEST  # depth 2 is reached and accepted in some branch
    # ... and retrieved children (point masses) were tested beside the drawn ones
    point_masses = 0
    for seed in range(10):
        run = pipe.start(PROMPT, LONGEST, seed=seed, ignore_eos=True)
        run.prefill()
        tree, _, _ = run.propose()
        assert len(tree.sampled[0]) == 2
        drawn = {child for children in tree.sampled.values() for child in children}
        point_masses += sum(node not in drawn for node in range(1, len(tree)))
    assert point_masses > 0


@pytest.mark.parametrize(
    "eagle",
    [
        {"depth": 1, "children": 2},
        {"depth": 2, "width": 1, "children": 1, "threshold": 0.0},
        {"depth": 2, "width": 1, "children": 2, "threshold": 0.0, "root_pass": True},
    ],
    ids=["two children drawn", "a chain drawn", "depth 1 drawn from a pass"],
)
def test_the_eagle_drafter_draws_from_its_q_and_stays_exact(model, eagle):
    spec = {**SPEC, "drafter": {"name": "eagle", "weights": "random", **eagle}, "retriever": {"name": "none"}}
    pipe = Pipeline.from_spec(spec, model, plugin_manager=plugin_manager())
    run = pipe.start(PROMPT, LONGEST, seed=0, ignore_eos=True)
    run.prefill()
    tree, _, _ = run.propose()
    assert tree.sampled[0] and 0 in tree.proposals  # drawn, and recorded with its q
    assert_exact(pipe)


@pytest.mark.parametrize("bug", ["no residual renormalisation", "sibling left in q", "q before the warpers"])
def test_each_planted_bug_is_caught(model, monkeypatch, bug):
    if bug == "no residual renormalisation":
        monkeypatch.setattr(rejection, "_normalised", lambda weights, fallback: weights if weights.sum() > 0 else fallback)
    elif bug == "sibling left in q":
        monkeypatch.setattr(rejection, "_drawn_removed", lambda q, token: q)
    else:
        monkeypatch.setattr(QDrafter, "record_raw_q", True)
    pipe = Pipeline.from_spec(SPEC, model, plugin_manager=plugin_manager())
    with pytest.raises(AssertionError, match="off autoregressive decoding"):
        assert_exact(pipe)


def test_the_verifier_refuses_greedy_decoding_and_chosen_trees(model):
    pm = plugin_manager()
    with pytest.raises(SpecError, match="verifier 'rejection' needs sampling"):
        Pipeline.from_spec({**SPEC, "sampling": {"greedy": True}}, model, plugin_manager=pm)
    with pytest.raises(SpecError, match='needs speculation.tree = "fixed"'):
        Pipeline.from_spec({**SPEC, "speculation": {"tree": "auto"}}, model, plugin_manager=pm)
