"""``tree-sampling``: lossless verification under sampling (and greedy).

One target token is drawn per visited node from that node's own distribution, and
the walk follows the child equal to it. Because the tree is a trie, at most one child
matches; where none does, the draw is the bonus token. Each emitted token is thus
drawn from exactly the autoregressive distribution given its prefix, and the draws
are made in the same order as autoregressive decoding would make them.

(The original research code drew a token per *leaf path* and kept the longest match,
which favours drafted tokens; see the tests for a demonstration of that bias.)
"""

from __future__ import annotations

from tokenswift.interfaces import Verdict, Verifier
from tokenswift.sampling import Sampler
from tokenswift.tree import DraftTree


class TreeSamplingVerifier(Verifier):
    """Walk from the root, one draw per node, following the matching child."""

    def verify(self, tree: DraftTree, scores, sampler: Sampler) -> Verdict:
        accepted: list[int] = []
        node = 0
        while True:
            token = sampler.draw(scores[node], scores.position(node))
            child = tree.children(node).get(token)
            if child is None:
                return Verdict(accepted=accepted, bonus=token)
            accepted.append(child)
            node = child
