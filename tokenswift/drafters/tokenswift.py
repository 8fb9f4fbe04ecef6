"""The ``tokenswift`` drafter: one extra forward of the root over the drafting view.

The root (the last committed token, which has no KV yet) is forwarded over the cache
policy's view (a partial KV cache for ``dynamic``); the LM head on its hidden state
gives depth 1, the heads give depths 2..k+1. Nothing is written into the full KV.
"""

from __future__ import annotations

import torch

from tokenswift.drafters import template
from tokenswift.drafters.head_drafter import HeadDrafter
from tokenswift.model.kv import FullView


class TokenSwiftDrafter(HeadDrafter):
    """Heads over an extra forward of the last token on the drafting KV view."""

    name = "tokenswift"
    default_tree = [1, 3, 3, 3]

    @property
    def max_depth(self) -> int:
        return self.heads.num_heads + 1

    def propose(self, state, view):
        root = torch.tensor([state.tokens[-1]])
        out = self.runner.forward(root, view=view if view is not None else FullView(self.runner.store))
        logits = torch.cat([out.logits, self._head_logits(out.hidden[0]).to(out.logits.dtype)])
        return template.branches(self.paths, self._ranked(logits))
