"""The warpers :func:`tokenswift.sampling.build_warpers` builds give transformers'
scores bit for bit: our min-p warper leaves out a search that cannot change them."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import MinPLogitsWarper

from tokenswift.sampling import MinPWarper, build_warpers
from tokenswift.spec import SamplingSpec


@st.composite
def score_rows(draw) -> torch.Tensor:
    """[n, vocab] float32 scores with ties (few distinct values), filtered entries
    (-inf) and, now and then, a row filtered out entirely."""
    rows, vocab = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    levels = draw(st.lists(st.sampled_from([-float("inf"), -30.0, -2.5, -1.0, 0.0, 0.5, 3.0, 7.25]), min_size=1, max_size=4))
    values = draw(st.lists(st.sampled_from(levels), min_size=rows * vocab, max_size=rows * vocab))
    noise = draw(st.booleans())
    scores = torch.tensor(values, dtype=torch.float32).view(rows, vocab)
    if noise:  # distinct values as well as ties
        scores = scores + torch.randn(rows, vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    return scores


@settings(max_examples=300, deadline=None)
@given(scores=score_rows(), min_p=st.one_of(st.sampled_from([0.0, 0.1, 0.5, 1.0]), st.floats(0.0, 1.0)))
def test_min_p_equals_transformers_bit_for_bit(scores, min_p):
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    ours = MinPWarper(min_p=min_p)(ids, scores.clone())
    theirs = MinPLogitsWarper(min_p=min_p)(ids, scores.clone())
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))


@settings(max_examples=200, deadline=None)
@given(scores=score_rows(), pick=st.integers(0, 10**6), nudge=st.sampled_from([1 - 1e-4, 1.0, 1 + 1e-4]))
def test_min_p_at_a_tokens_own_ratio_equals_transformers(scores, pick, nudge):
    """min_p set to one token's probability over the row's top (nudged just below or
    above): that token sits on the threshold, where a rounding or comparison that
    differs from transformers' shows."""
    probs = torch.softmax(scores[:1], dim=-1)[0]
    finite = probs[probs > 0]
    if not len(finite):
        return
    min_p = float(finite[pick % len(finite)] / probs.max()) * nudge
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    ours = MinPWarper(min_p=min(min_p, 1.0))(ids, scores.clone())
    theirs = MinPLogitsWarper(min_p=min(min_p, 1.0))(ids, scores.clone())
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))


def test_min_p_keeping_more_than_one_token_is_transformers_own():
    scores = torch.tensor([[5.0, 4.0, 1.0, 0.0, -3.0]])
    ids = torch.zeros(1, 1, dtype=torch.long)
    kept = MinPWarper(min_p=0.9, min_tokens_to_keep=3)(ids, scores)
    assert torch.equal(kept, MinPLogitsWarper(min_p=0.9, min_tokens_to_keep=3)(ids, scores))
    assert torch.isfinite(kept).sum() == 3


def test_the_papers_sampling_uses_the_min_p_warper():
    warpers = build_warpers(SamplingSpec(temperature=1.0, min_p=0.1))
    assert [type(w) for w in warpers] == [MinPWarper]
