"""Scoring a position: the one place where logits become the scores a token is drawn
from (the penalty with the position's own context, then the sampling warpers).

Verification, the drafters that rank candidates the way verification will, tree
fitting, the reference decoding loops and the benchmark's baselines all score through
a :class:`Scorer`, so they cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from tokenswift.errors import NonFiniteScoresError
from tokenswift.sampling import build_warpers
from tokenswift.spec import SamplingSpec
from tokenswift.tree import DraftTree


class PenaltyFunction(Protocol):
    """What scoring needs of the pipeline's penalty component
    (:class:`tokenswift.interfaces.Penalty`, whose interface names this module's
    classes: so this module names none of the components')."""

    @property
    def window(self) -> int: ...

    def apply(self, contexts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor: ...


class Scorer:
    """The pipeline's penalty component followed by the warpers of its sampling spec.

    ``exempt``: token ids the penalty never touches: the ids that end a run (EOS, the
    chat template's end of turn). They occur in every chat prompt's window, and a
    repetition penalty on them would keep an instruct model from ever ending its reply.
    """

    def __init__(self, penalty: PenaltyFunction, sampling: SamplingSpec, exempt: Sequence[int] = ()) -> None:
        self.penalty = penalty
        self.sampling = sampling
        self.exempt = tuple(sorted({int(t) for t in exempt}))
        self._exempt_index: dict[torch.device, torch.Tensor] = {}
        self._warpers: dict[torch.device, object] = {}  # some warpers keep tensors: one set per device

    @property
    def window(self) -> int:
        """How many recent tokens the penalty looks at (0: none)."""
        return self.penalty.window

    def context(self, tokens: Sequence[int], device=None) -> torch.Tensor:
        """[1, W]: the last W (= :attr:`window`) of ``tokens``, the penalty's view of them."""
        window = self.window
        tail = list(tokens[-window:]) if window else []
        return torch.tensor([tail], dtype=torch.long, device=device)

    def penalize(self, contexts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The penalty alone, the :attr:`exempt` ids left as they were. contexts:
        [n, W] long; logits: [n, vocab]."""
        if not self.exempt or contexts.shape[-1] == 0:
            return self.penalty.apply(contexts, logits)
        index = self._exempt_index.get(logits.device)
        if index is None:
            index = self._exempt_index[logits.device] = torch.tensor(self.exempt, dtype=torch.long, device=logits.device)
        kept = logits.index_select(-1, index)  # a copy: the penalty may work in place
        penalized = self.penalty.apply(contexts, logits)
        penalized[..., index] = kept
        return penalized

    def untruncated(self, contexts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The penalty and the temperature, none of the truncating warpers (top-k, top-p,
        min-p, eta): the distribution a draw's noise is added to before truncation. A
        drafter coupled to the draw ranks its guesses by it: truncating its own guess
        would drop tokens the target's distribution still admits. [n, vocab] logits."""
        penalized = self.penalize(contexts, logits)
        temperature = 1.0 if self.sampling.greedy else self.sampling.temperature
        return penalized if temperature == 1.0 else penalized / temperature

    def warp(self, contexts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The sampling warpers alone (filtered entries at -inf). scores: [n, vocab]."""
        warpers = self._warpers.get(scores.device)
        if warpers is None:
            warpers = self._warpers[scores.device] = build_warpers(self.sampling, device=scores.device)
        return warpers(contexts, scores) if len(warpers) else scores

    def __call__(self, contexts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Processed scores: [n, vocab] logits, each row with its context's last W
        tokens ([n, W] long) -> penalty, then warpers."""
        return self.warp(contexts, self.penalize(contexts, logits))


def finite_rows(scores: torch.Tensor) -> list[bool]:
    """Per row of processed scores ([n, vocab]): whether a token can be drawn from it (no
    NaN, no +inf, not all -inf), from one max-reduction a row: max propagates NaN, is
    +inf where any entry is and -inf where every entry is."""
    return [math.isfinite(peak) for peak in scores.amax(-1).tolist()]


# The most LM-head rows a step computes in one product with the root's: the kept nodes
# likeliest to be visited. Where a kernel reads the head once for all rows, 12 rows cost
# little more than one (SmolLM2-135M's 57 MB head, bfloat16, the few-rows kernel on a
# 2-core Sapphire Rapids: 2.56 / 2.70 / 2.88 / 4.14 ms for 1 / 8 / 12 / 16 rows), while a
# second product for a node outside the first costs a whole one. Whether a machine's
# products are such is measured (:attr:`tokenswift.calibration.Calibration.head_rows_ms`).
ONE_PRODUCT_ROWS = 12
# The rows of the smaller product a machine whose 12-row product is dear may still take
# at the cost of one: a root, its likeliest child and grandchild, one more. The few-rows
# kernel on a 2-core AMD EPYC Zen 4 (SmolLM2-135M's head, bfloat16, least of 30):
# 1.32 / 1.27 / 1.32 / 0.95 / 1.55 / 2.18 / 2.28 ms for 1 / 2 / 3 / 4 / 6 / 8 / 12 rows;
# there a greedy ``eagle`` step ran 1.63 products (152 in 93 steps), one row and the
# likely path's at a time.
FEW_PRODUCT_ROWS = 4


# The most nodes whose scores are computed in one call of the scorer: the root and the
# likeliest node whose LM-head row came with its product (the likely path's next node).
# A row scored and never visited costs its share of the vocabulary-wide work (the
# penalty, and under sampling min-p's softmax), a row scored apart one more call. On a
# 2-core AMD EPYC Zen 4 (``eagle``, 2K prompt, compiled, 512 tokens; ms a speculative
# step outside the LM head in verification, 1 / 2 / 4 nodes together): greedy 0.8 / 0.9 /
# 0.9, the paper's sampling 1.6 / 1.6 / 1.8 (1.46-1.69 tokens a step: the root's child is
# visited in about half the steps, its grandchild rarely).
SCORED_TOGETHER = 2


class NodeScores:
    """``scores[node]``: the processed scores ([vocab]) of one tree node, computed on
    first use and cached.

    A verifier walks from the root and visits only the accepted path plus one node, so
    the LM head, the penalty and the warpers run for those few nodes instead of the
    whole tree (for a 100-node tree and a 49K vocabulary, the LM head alone is a large
    matmul). Each node's penalty sees that node's own context: the committed tokens,
    then its ancestors below the root, then itself. The root's scores are computed in
    one batched call with those of the likeliest nodes whose LM-head rows came with its
    product (:data:`SCORED_TOGETHER` in all), each row with its own context.
    """

    def __init__(
        self, tree: DraftTree, hidden: torch.Tensor, runner, scorer: Scorer, committed: Sequence[int], *, with_root: Sequence[int] = ()
    ) -> None:
        # hidden: [len(tree), hidden_size], the verify forward's final-norm hidden states.
        # with_root: nodes likely to be visited, whose LM-head rows are computed in one
        # product with the root's (a few rows cost little more than one).
        self.tree = tree
        self.hidden = hidden
        self.runner = runner
        self.scorer = scorer
        self.with_root = [node for node in with_root if node != 0]
        self.committed_length = len(committed)
        window = scorer.window
        # the committed tokens the penalty sees, as a tensor once per step: [t], t <= W
        self._tail = torch.tensor(list(committed[-window:]) if window else [], dtype=torch.long, device=hidden.device)
        self._logits: dict[int, torch.Tensor] = {}
        self._cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.tree)

    def position(self, node: int) -> int:
        """The absolute position (index in the text) of the token drawn from this
        node's scores: the root's is the first after the committed text."""
        return self.committed_length + self.tree.depths[node]

    def context(self, node: int) -> torch.Tensor:
        """[1, W]: the last W tokens this node's penalty sees."""
        window = self.scorer.window
        if not window:
            return self._tail[None]
        path = torch.tensor(self.tree.path_tokens(node), dtype=torch.long, device=self._tail.device)
        return torch.cat([self._tail, path])[-window:][None]

    def __getitem__(self, node: int) -> torch.Tensor:
        scores = self._cache.get(node)
        if scores is None:
            self._score(node)
            scores = self._cache[node]
        return scores

    def _score(self, node: int) -> None:
        """Score ``node`` (the root: with the likeliest rows of its product) into the cache."""
        with torch.inference_mode():
            if node not in self._logits:
                rows = [node, *self.with_root] if node == 0 else [node]
                for row, logits in zip(rows, self.runner.logits(self.hidden[rows])):  # [len(rows), vocab]
                    self._logits.setdefault(row, logits)
            nodes, contexts = [node], [self.context(node)]
            if node == 0:  # its likeliest companions whose contexts are as long as its own (they stack)
                for companion in self.with_root:
                    if len(nodes) == SCORED_TOGETHER:
                        break
                    if companion in self._cache:
                        continue
                    context = self.context(companion)
                    if context.shape[1] == contexts[0].shape[1]:
                        nodes.append(companion)
                        contexts.append(context)
            scores = self.scorer(torch.cat(contexts), torch.stack([self._logits[n] for n in nodes]))  # [k, vocab]
            drawable = finite_rows(scores)
        for row, n in enumerate(nodes):
            if not drawable[row]:
                if n != node:
                    continue  # a companion is checked again if it is visited
                raise NonFiniteScoresError(
                    f"the scores of tree node {node} are NaN/inf or all filtered out "
                    f"(model dtype too narrow, or a penalty/warper produced them)"
                )
            self._cache[n] = scores[row]

    def nll(self, parents: Sequence[int], tokens: Sequence[int]) -> list[float]:
        """The model's own negative log-likelihood (nats) of ``tokens[i]`` drawn at node
        ``parents[i]``, from the raw logits (before the penalty and the warpers): the
        rows the verifier computed, an LM-head row for any it did not."""
        if not tokens:
            return []
        with torch.inference_mode():
            missing = [node for node in dict.fromkeys(parents) if node not in self._logits]
            if missing:
                for row, logits in zip(missing, self.runner.logits(self.hidden[missing])):
                    self._logits[row] = logits
            rows = torch.stack([self._logits[node] for node in parents]).float()  # [k, vocab]
            picked = rows.gather(1, torch.tensor(list(tokens), device=rows.device)[:, None])[:, 0]
            return (torch.logsumexp(rows, dim=-1) - picked).tolist()
