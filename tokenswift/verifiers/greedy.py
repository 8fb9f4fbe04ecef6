"""``greedy``: the argmax walk. Only valid with ``sampling.greedy = true``."""

from __future__ import annotations

from tokenswift.errors import SpecError
from tokenswift.interfaces import Verdict, Verifier
from tokenswift.sampling import Sampler
from tokenswift.tree import DraftTree


class GreedyVerifier(Verifier):
    """Follow the child equal to each node's argmax; the first mismatch is the bonus."""

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        if not context.spec.sampling.greedy:
            raise SpecError(
                "verifier 'greedy' needs sampling.greedy = true; "
                "for sampling use verifier 'tree-sampling' (lossless under sampling)"
            )

    def verify(self, tree: DraftTree, scores, sampler: Sampler) -> Verdict:
        accepted: list[int] = []
        node = 0
        while True:
            best = int(scores[node].argmax())
            child = tree.children(node).get(best)
            if child is None:
                return Verdict(accepted=accepted, bonus=best)
            accepted.append(child)
            node = child
