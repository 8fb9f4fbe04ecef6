"""Scores of tree nodes, computed on demand.

A verifier walks from the root and visits only the accepted path plus one node, so the
LM head, the penalty and the warpers run for those few nodes instead of the whole
tree (for a 100-node tree and a 49K vocabulary, the LM head alone is a large matmul).
Each node's penalty sees that node's own context: the committed tokens, then its
ancestors below the root, then itself.
"""

from __future__ import annotations

import torch

from tokenswift.errors import NonFiniteScoresError
from tokenswift.interfaces import Penalty
from tokenswift.sampling import Sampler
from tokenswift.tree import DraftTree


class NodeScores:
    """``scores[node]``: the processed logits ([vocab]) of one tree node, cached."""

    def __init__(
        self,
        tree: DraftTree,
        hidden: torch.Tensor,
        lm_head: torch.nn.Module,
        penalty: Penalty,
        sampler: Sampler,
        committed: list[int],
        logits_dtype: torch.dtype,
    ) -> None:
        # hidden: [n, hidden_size], the verify forward's final-norm hidden states.
        self.tree = tree
        self.hidden = hidden
        self.lm_head = lm_head
        self.penalty = penalty
        self.sampler = sampler
        self.logits_dtype = logits_dtype
        window = penalty.window
        self._tail = committed[-window:] if window else []
        self._cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.tree)

    def context(self, node: int) -> torch.Tensor:
        """[1, W]: the last W tokens this node's penalty sees."""
        window = self.penalty.window
        if window == 0:
            return torch.empty(1, 0, dtype=torch.long, device=self.hidden.device)
        tokens = (self._tail + self.tree.path_tokens(node))[-window:]
        return torch.tensor([tokens], dtype=torch.long, device=self.hidden.device)

    def __getitem__(self, node: int) -> torch.Tensor:
        scores = self._cache.get(node)
        if scores is None:
            with torch.inference_mode():
                logits = self.lm_head(self.hidden[node : node + 1]).to(self.logits_dtype)  # [1, vocab]
                context = self.context(node)
                scores = self.sampler.warp(context, self.penalty.apply(context, logits))[0]
                broken = torch.isnan(scores).any() or torch.isposinf(scores).any() or torch.isneginf(scores).all()
            if broken:
                raise NonFiniteScoresError(
                    f"the scores of tree node {node} are NaN/inf or all filtered out "
                    f"(model dtype too narrow, or a penalty/warper produced them)"
                )
            self._cache[node] = scores
        return scores
