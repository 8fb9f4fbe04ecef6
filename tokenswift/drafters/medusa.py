"""The ``medusa`` drafter: heads on the hidden state the previous forward produced.

The previous forward (a verify pass, or the prompt's prefill) computed the hidden
state of the position whose logits gave the root token; the heads applied to it
predict the tokens after the root (head 1 -> depth 1, ...). No extra forward.
"""

from __future__ import annotations

from tokenswift.drafters.head_based import HeadDrafter


class MedusaDrafter(HeadDrafter):
    """Heads on the previous forward's hidden state (no extra forward)."""

    name = "medusa"
    default_tree = [3, 3, 3]

    @property
    def max_depth(self) -> int:
        return self.heads.num_heads

    def propose(self, state, inputs):
        return self.from_parent(inputs.parent_hidden, self.paths, self.widths, inputs.noise_of)
