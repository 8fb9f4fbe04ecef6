"""``rejection``: speculative (rejection) sampling over the tree, lossless in distribution.

At each visited node, with the target's distribution p there (the node's processed
scores), the children are tested in turn (SpecInfer, arXiv 2305.09781; recursive
rejection sampling without replacement, Jeon et al., arXiv 2402.14160):

* children drawn from the drafter's q (:class:`~tokenswift.tree.SampledChildren`), in the
  order drawn: child x is accepted with probability min(1, p(x) / q(x)); if not, p
  becomes the residual max(p - q, 0) renormalised and x leaves q (q renormalised), so
  the next child is tested against what its own draw (without replacement) came from;
* every other child (a retrieved branch, a drafter's deterministic pick) is a draft
  from a point mass: accepted with probability p(x), else x leaves p (renormalised);
* when none is accepted, the bonus token is drawn from what p has become.

Each emitted token is then distributed exactly as autoregressive sampling would draw it,
whatever q was, as long as the children were really drawn from the q recorded for them
and which of them are tested never depends on their values. Trees chosen by the
candidates' confidences would break that (a draw kept only when it is likely is no
longer a draw from q), so this verifier needs ``speculation.tree = "fixed"``; a cut at
``max_nodes`` keeps a prefix of each node's draws, which is allowed.

The random numbers come from the sampler's keyed streams (one per test, one for the
residual draw; :mod:`tokenswift.sampling`), not from the coupled draw: runs are lossless
in distribution, not token-identical to ``ar``.
"""

from __future__ import annotations

import torch

from tokenswift.errors import SpecError
from tokenswift.interfaces import Verdict, Verifier
from tokenswift.sampling import STREAM_ACCEPT, STREAM_RESIDUAL, Sampler
from tokenswift.tree import DraftTree


class RejectionVerifier(Verifier):
    """Recursive rejection sampling without replacement down the tree."""

    wants_sampled_drafts = True

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        if context is not None:
            spec = context.spec
            if spec.sampling.greedy:
                raise SpecError("verifier 'rejection' needs sampling (greedy = false); for greedy decoding use 'greedy'")
            if spec.speculation.tree != "fixed":
                raise SpecError(
                    "verifier 'rejection' needs speculation.tree = \"fixed\": a tree chosen by its candidates' "
                    "confidences would bias rejection sampling"
                )

    def verify(self, tree: DraftTree, scores, sampler: Sampler) -> Verdict:
        accepted: list[int] = []
        node = 0
        while True:
            position = scores.position(node)
            p = torch.softmax(scores[node].to(torch.float64), dim=-1)
            child, p = self._test_children(tree, node, p, position, sampler)
            if child is None:
                return Verdict(accepted=accepted, bonus=sampler.choose(p, position, STREAM_RESIDUAL))
            accepted.append(child)
            node = child

    @staticmethod
    def _test_children(tree: DraftTree, node: int, p: torch.Tensor, position: int, sampler: Sampler):
        """The accepted child of ``node`` (None: none), and p as the tests left it."""
        drawn = tree.sampled.get(node, [])
        q = tree.proposals[node].to(device=p.device, dtype=torch.float64) if drawn else None
        test = STREAM_ACCEPT
        for child in drawn:
            token = tree.tokens[child]
            ratio = float(p[token] / q[token]) if q[token] > 0 else 0.0
            if sampler.accept(min(1.0, ratio), position, test):
                return child, p
            test += 1
            p = _normalised((p - q).clamp_min(0), fallback=p)  # the residual
            q = _drawn_removed(q, token)
        for child in tree.children(node).values():
            if child in drawn:
                continue
            token = tree.tokens[child]
            if sampler.accept(float(p[token]), position, test):
                return child, p
            test += 1
            rest = p.clone()
            rest[token] = 0
            p = _normalised(rest, fallback=p)
        return None, p


def _drawn_removed(q: torch.Tensor, token: int) -> torch.Tensor:
    """q without ``token`` (renormalised): what the next draw without replacement came from."""
    rest = q.clone()
    rest[token] = 0
    return _normalised(rest, fallback=q)


def _normalised(weights: torch.Tensor, *, fallback: torch.Tensor) -> torch.Tensor:
    """``weights`` summing to 1, or ``fallback`` where nothing is left (a test that was
    certain to pass, failed by a rounding error)."""
    total = weights.sum()
    return weights / total if total > 0 else fallback
