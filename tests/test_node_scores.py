"""Node scores computed together (the root with its likeliest companions) are each
node's own: the same as scoring the node alone with its own context."""

from __future__ import annotations

import pytest
import torch

from tokenswift.errors import NonFiniteScoresError
from tokenswift.penalties.contextual import ContextualPenalty
from tokenswift.scoring import SCORED_TOGETHER, NodeScores, Scorer, finite_rows
from tokenswift.spec import SamplingSpec
from tokenswift.tree import DraftTree

VOCAB = 40


class RowLogits:
    """A runner whose LM head gives row i of a fixed table for hidden state i."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.calls: list[int] = []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(hidden))
        return self.table[hidden[:, 0].long()]


def _tree() -> DraftTree:
    # root 5; a chain 7 -> 9 -> 11 and a sibling 8, so contexts differ by path
    return DraftTree.from_branches(5, [[7, 9, 11], [8]])


def _scores(scorer: Scorer, table: torch.Tensor, committed: list[int], with_root) -> tuple[NodeScores, RowLogits]:
    tree = _tree()
    runner = RowLogits(table)
    hidden = torch.arange(len(tree), dtype=torch.float32)[:, None].repeat(1, 3)
    return NodeScores(tree, hidden, runner, scorer, committed, with_root=with_root), runner


@pytest.mark.parametrize("sampling", [SamplingSpec(greedy=True), SamplingSpec(temperature=0.7, min_p=0.05, top_k=12)])
@pytest.mark.parametrize("committed", [[3, 7, 9, 9, 11, 8, 2, 8], [3, 7]])
def test_nodes_scored_together_equal_each_scored_alone(sampling, committed):
    penalty = ContextualPenalty(ContextualPenalty.Options(value=1.7, window=6), None)
    scorer = Scorer(penalty, sampling, exempt=[2])
    table = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    together, runner = _scores(scorer, table, committed, with_root=[1, 2, 3, 4])
    together[0]
    assert runner.calls == [5]  # one LM-head product for the root and its companions
    tree = together.tree
    for node in range(len(tree)):
        context = (committed + tree.path_tokens(node))[-6:]
        alone = scorer(torch.tensor([context]), table[node][None])[0]
        assert torch.equal(together[node], alone), node
    assert runner.calls == [5]  # no node needed another product


def test_a_companion_that_is_not_finite_stops_nothing_until_visited():
    class NanAfterSeven(ContextualPenalty):
        def apply(self, contexts, scores):
            scores = super().apply(contexts, scores)
            return torch.where((contexts[:, -1:] == 7), torch.full_like(scores, float("nan")), scores)

    scorer = Scorer(NanAfterSeven(NanAfterSeven.Options(value=1.2, window=4), None), SamplingSpec(greedy=True))
    table = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    # contexts of one length: the root and node 1 (token 7) are scored in one call
    scores, runner = _scores(scorer, table, [1, 2, 3, 4, 6], with_root=[1, 2])
    assert torch.isfinite(scores[0]).all()
    with pytest.raises(NonFiniteScoresError, match="tree node 1"):
        scores[1]  # node 1 holds token 7: its own context ends with it
    assert torch.isfinite(scores[4]).all()  # its sibling (token 8) is fine
    assert runner.calls[0] == 3  # the root's product held its companions' rows


def test_all_filtered_out_is_caught_for_a_node_scored_alone():
    class Everything(ContextualPenalty):
        def apply(self, contexts, scores):
            return torch.full_like(scores, float("-inf"))

    scorer = Scorer(Everything(Everything.Options(value=1.2, window=4), None), SamplingSpec(greedy=True))
    scores, _ = _scores(scorer, torch.zeros(5, VOCAB, dtype=torch.float64), [1, 2, 3], with_root=[])
    with pytest.raises(NonFiniteScoresError, match="tree node 0"):
        scores[0]


def test_no_more_than_the_batch_is_scored_with_the_root():
    calls = []

    class Counting(ContextualPenalty):
        def apply(self, contexts, scores):
            calls.append(len(contexts))
            return super().apply(contexts, scores)

    scorer = Scorer(Counting(Counting.Options(value=1.2, window=4), None), SamplingSpec(greedy=True))
    table = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    scores, _ = _scores(scorer, table, [1, 2, 3, 4, 5], with_root=[1, 2, 3, 4])
    scores[0]
    assert calls == [SCORED_TOGETHER]
    for node in range(1, 5):
        scores[node]
    assert sum(calls) == 5  # the rest one at a time, each once


def test_finite_rows_tells_drawable_rows_from_the_rest():
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([
        [0.5, -inf, 2.0, -inf],  # filtered entries, still drawable
        [0.5, nan, 2.0, 1.0],
        [0.5, inf, 2.0, 1.0],
        [-inf, -inf, -inf, -inf],
        [-inf, -inf, 3.0, -inf],
    ])
    assert finite_rows(rows) == [True, False, False, False, True]
