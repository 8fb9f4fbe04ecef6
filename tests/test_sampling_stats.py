"""Sampling is unbiased: a chi-square test against exact enumeration, and the
per-path rule of the original research code shown biased where ours is not.

Sizes come from a power calculation, not habit. The chi-square test pools bins
expected below 5 counts, leaving about 6 degrees of freedom here; at the test's level
(p < 1e-4) the critical value is about 28.0. A biased verifier shifts probability mass
between tokens; the per-path rule below moves 0.10 of it (0.30 instead of 0.20), which
gives a noncentrality of about n x (0.1^2/0.2 + 0.1^2/0.8) = 0.0625 n. With n = 1,000
runs that is 62: a noncentral chi-square with 6 degrees of freedom and noncentrality 62
exceeds 28.0 with probability 0.998 (simulated), so a bias of that size is caught
(one of 0.07: probability 0.76); a fair sampler fails at most 3 positions x 1e-4 of
the time. ``-m slow`` runs 10,000, which catches a shift of 0.03 with probability 0.996.
"""

import math

import pytest
import torch

from tokenswift import Pipeline
from tokenswift.interfaces import Verdict
from tokenswift.model.loading import tiny_model
from tokenswift.sampling import CoupledSampler, InverseCdfSampler, KeyedSampler
from tokenswift.testing import TINY_CONFIGS
from tokenswift.tree import DraftTree
from tokenswift.verifiers.tree_sampling import TreeSamplingVerifier

VOCAB = 8
PROMPT = [1, 5, 2, 5, 3]
SPEC = {
    "preset": "tokenswift",
    "drafter": {"tree": [2, 2, 2, 1]},
    "retriever": {"top_k": 3},
    "cache": {"budget": 6, "sink": 1, "recent": 2},
    "penalty": {"value": 1.5, "window": 2},
    "sampling": {"temperature": 1.0},
    # 4 new tokens a run: the plain guard would spend them measuring plain steps first
    "speculation": {"plain_guard": False},
}


@torch.inference_mode()
def exact_marginals(pipe, prompt, positions):
    """P(token at position t = v) for t in 0..positions-1, by enumerating every prefix
    and applying the pipeline's own penalty and warpers to each one."""
    window = pipe.scorer.window
    marginals = []
    prefixes = {(): 1.0}
    for _ in range(positions):
        keys = list(prefixes)
        ids = torch.tensor([prompt + list(k) for k in keys])
        scores = pipe.model(ids).logits[:, -1].double()
        contexts = ids[:, -window:] if window else ids[:, :0]
        probs = torch.softmax(pipe.scorer(contexts, scores), dim=-1)
        marginal = torch.zeros(VOCAB, dtype=torch.float64)
        nxt = {}
        for key, row in zip(keys, probs):
            weight = prefixes[key]
            marginal += weight * row
            for token in range(VOCAB):
                nxt[key + (token,)] = weight * float(row[token])
        marginals.append(marginal)
        prefixes = nxt
    return marginals


def chi_square_p_value(observed, expected_probs, n):
    """Pearson chi-square p-value; bins expected below 5 counts are pooled."""
    expected = expected_probs * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


def check_sampled_distribution(runs, overrides=None):
    model = tiny_model(dict(TINY_CONFIGS["llama-gqa"], vocab_size=VOCAB, initializer_range=0.2), dtype="float64")
    pipe = Pipeline.from_spec({**SPEC, **(overrides or {})}, model)
    positions = 4
    counts = torch.zeros(positions, VOCAB, dtype=torch.float64)
    accepted = 0
    for seed in range(runs):
        result = pipe.generate(PROMPT, positions, seed=seed, ignore_eos=True)
        accepted += result.stats.accepted_tokens
        for t, token in enumerate(result.tokens):
            counts[t, token] += 1
    assert accepted > runs, "drafts must really be accepted for this test to mean anything"
    for t, marginal in enumerate(exact_marginals(pipe, PROMPT, positions)):
        if t == 0:
            continue  # token 1 is never drafted; tokens 2..4 are the ones verification decides
        p = chi_square_p_value(counts[t], marginal, runs)
        assert p > 1e-4, f"token {t + 1}: chi-square p = {p:.2e}; counts {counts[t].tolist()} vs {(marginal * runs).tolist()}"


def test_sampled_tokens_follow_the_autoregressive_distribution():
    check_sampled_distribution(1_000)


def test_the_rejection_verifier_follows_the_autoregressive_distribution_through_its_real_streams():
    """tests/test_rejection.py enumerates its choices exactly; this runs it with the
    coupled sampler's keyed random streams, as a generation does."""
    check_sampled_distribution(1_000, {"verifier": {"name": "rejection"}, "speculation": {"tree": "fixed"}})


@pytest.mark.slow
def test_sampled_tokens_follow_the_autoregressive_distribution_exhaustively():
    check_sampled_distribution(10_000)


def per_path_verify(tree, scores, generator):
    """The original code's rule: one target sample per leaf path, independently, then
    the longest matching path wins (first on ties). Kept here only to show its bias."""
    best_path, best_len, fallback = [], -1, None
    for path in tree.paths():
        node, matched, sample = 0, [], None
        for child in path + [None]:
            probs = torch.softmax(scores[node].double(), -1)
            sample = int(torch.multinomial(probs, 1, generator=generator))
            if child is None or tree.tokens[child] != sample:
                break
            matched.append(child)
            node = child
        if fallback is None:
            fallback = sample
        if len(matched) > best_len:
            best_path, best_len, bonus = matched, len(matched), sample
    return Verdict(accepted=best_path, bonus=bonus)


def test_per_path_sampling_is_biased_and_tree_sampling_is_not():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    tree = DraftTree.from_branches(0, [[1], [2]])  # two one-token paths below the root
    scores = p.log().expand(len(tree), -1)
    runs = 4000  # the two hypotheses (0.30 biased, 0.20 fair) are 16 sigma apart

    def first_token_frequency(verify):
        hits = 0
        for _ in range(runs):
            verdict = verify()
            first = tree.tokens[verdict.accepted[0]] if verdict.accepted else verdict.bonus
            hits += first == 2
        return hits / runs

    generator = torch.Generator().manual_seed(0)
    biased = first_token_frequency(lambda: per_path_verify(tree, scores, generator))
    verifier = TreeSamplingVerifier(None, None)
    node_scores = FixedScores(tree, scores[0])
    seeds = iter(range(2 * runs))
    coupled = first_token_frequency(lambda: verifier.verify(tree, node_scores, CoupledSampler(next(seeds))))
    keyed = first_token_frequency(lambda: verifier.verify(tree, node_scores, KeyedSampler(next(seeds))))
    inverse_cdf = InverseCdfSampler(torch.Generator().manual_seed(0))
    legacy = first_token_frequency(lambda: verifier.verify(tree, node_scores, inverse_cdf))

    sigma = math.sqrt(0.2 * 0.8 / runs)
    # Exactly: 0.7 * 0.2 + 0.7 * 0.8 * (0.2 / 0.7) = 0.30 instead of 0.20.
    assert abs(biased - 0.30) < 5 * sigma and abs(biased - 0.2) > 10 * sigma
    assert abs(coupled - 0.2) < 5 * sigma and abs(keyed - 0.2) < 5 * sigma and abs(legacy - 0.2) < 5 * sigma


class FixedScores:
    """Every node of ``tree`` scored ``row``; a node's draw at its depth's position."""

    def __init__(self, tree, row):
        self.tree, self.row = tree, row

    def __getitem__(self, node):
        return self.row

    def position(self, node):
        return self.tree.depths[node]


def test_enumeration_helper_is_exact_on_a_known_case():
    """The reference marginals sum to one and match a direct product for position 2."""
    model = tiny_model(dict(TINY_CONFIGS["llama-mha"], vocab_size=VOCAB), dtype="float64")
    spec = {"preset": "ar", "penalty": {"name": "none"}, "sampling": {"temperature": 1.0, "min_p": 0.0}}
    pipe = Pipeline.from_spec(spec, model)
    m1, m2 = exact_marginals(pipe, PROMPT, 2)
    assert torch.allclose(m1.sum(), torch.tensor(1.0, dtype=torch.float64))
    with torch.inference_mode():
        direct = sum(
            m1[a] * torch.softmax(model(torch.tensor([PROMPT + [a]])).logits[0, -1].double(), -1) for a in range(VOCAB)
        )
    torch.testing.assert_close(m2, direct)
