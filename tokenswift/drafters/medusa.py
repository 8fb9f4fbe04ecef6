"""The ``medusa`` drafter: heads on the hidden state the verify pass already produced.

The last verify forward computed the hidden state of the node whose logits gave the
bonus token (the new root); the heads applied to it predict the tokens after the
root (head 1 -> depth 1, ...). No extra forward; the first step drafts nothing.
"""

from __future__ import annotations

from tokenswift.drafters import template
from tokenswift.drafters.head_drafter import HeadDrafter


class MedusaDrafter(HeadDrafter):
    """Heads on the previous verify pass's hidden state (no extra forward)."""

    name = "medusa"
    default_tree = [3, 3, 3]

    @property
    def max_depth(self) -> int:
        return self.heads.num_heads

    def propose(self, state, view):
        if state.last_output is None:
            return []
        hidden = state.last_output.hidden[state.last_accepted]
        return template.branches(self.paths, self._ranked(self._head_logits(hidden)))
