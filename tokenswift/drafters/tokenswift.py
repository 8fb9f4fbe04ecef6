"""The ``tokenswift`` drafter: heads over a pass of the root on the drafting view.

The pipeline forwards the root (the last committed token, which has no KV yet) over
the cache policy's drafting view (a partial KV cache for ``dynamic``) and hands the
result over; the LM head on the root's hidden state gives depth 1, the heads give
depths 2..k+1. Nothing is written into the committed KV.

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
from tokenswift.drafters.head_based import HeadDrafter
from tokenswift.validation import boolean


class TokenSwiftDrafter(HeadDrafter):
    """Heads over an extra forward of the last token on the drafting KV view."""

    name = "tokenswift"
    default_tree = [1, 3, 3, 3]
    needs_root_pass = True

    @attrs.frozen(kw_only=True)
    class Options(HeadDrafter.Options):
        penalize: bool = attrs.field(default=True, converter=boolean("drafter.penalize"))

    @property
    def max_depth(self) -> int:
        return self.heads.num_heads + 1

    def propose(self, state, inputs):
        first = inputs.root.logits  # [1, vocab]: the LM head on the root, depth 1
        scorer = self.context.scorer
        if self.options.penalize and scorer.window:
            first = scorer.penalize(scorer.context(state.tokens, device=first.device), first)
        logits = torch.cat([first, self._head_logits(inputs.root.hidden[0]).to(first.dtype)])
        return template.branches(self.paths, self._ranked(logits))
