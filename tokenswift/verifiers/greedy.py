"""``greedy``: the argmax walk. Only valid with ``sampling.greedy = true``."""

from __future__ import annotations

import torch

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

    def verify(self, tree: DraftTree, scores: torch.Tensor, sampler: Sampler) -> Verdict:
        best = scores.argmax(dim=-1).tolist()  # [n]: one host sync for the whole tree
        accepted: list[int] = []
        node = 0
        while (child := tree.children(node).get(best[node])) is not None:
            accepted.append(child)
            node = child
        return Verdict(accepted=accepted, bonus=best[node])
