"""The ``tokenswift`` drafter: one extra forward of the root over the drafting view.

The root (the last committed token, which has no KV yet) is forwarded over the cache
policy's view (a partial KV cache for ``dynamic``); the LM head on its hidden state
gives depth 1, the heads give depths 2..k+1. Nothing is written into the full KV.

With ``penalize`` (the default) the depth-1 candidates are ranked after the
pipeline's penalty on the committed context, i.e. by the scores verification draws
the root's token from. The penalty lowers frequent tokens that appeared recently, so
the raw top-1 is often not the likely draw: replaying 3 x 2,000 sampled tokens of the
demo model, the raw top-1 matched the draw 24% of the time, the penalised one 36%
(``benchmarks/acceptance_ceiling.py``). Heads keep their raw ranking (the penalty did
not help there).
"""

from __future__ import annotations

import attrs
import torch

from tokenswift.drafters import template
from tokenswift.drafters.head_drafter import HeadDrafter
from tokenswift.model.kv import FullView
from tokenswift.options import boolean


class TokenSwiftDrafter(HeadDrafter):
    """Heads over an extra forward of the last token on the drafting KV view."""

    name = "tokenswift"
    default_tree = [1, 3, 3, 3]

    @attrs.frozen(kw_only=True)
    class Options(HeadDrafter.Options):
        penalize: bool = attrs.field(default=True, converter=boolean("drafter.penalize"))

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        penalty = context.penalty
        self.penalty = penalty if options.penalize and penalty is not None and penalty.window else None

    @property
    def max_depth(self) -> int:
        return self.heads.num_heads + 1

    def propose(self, state, view):
        root = torch.tensor([state.tokens[-1]])
        out = self.runner.forward(root, view=view if view is not None else FullView(self.runner.store))
        first = out.logits  # [1, vocab]: the LM head on the root, depth 1
        if self.penalty is not None:
            context = torch.tensor([state.tokens[-self.penalty.window :]], device=first.device)
            first = self.penalty.apply(context, first)
        logits = torch.cat([first, self._head_logits(out.hidden[0]).to(first.dtype)])
        return template.branches(self.paths, self._ranked(logits))
