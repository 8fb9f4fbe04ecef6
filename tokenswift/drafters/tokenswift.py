"""The ``tokenswift`` drafter: heads over a pass of the root on the drafting view.

The drafter asks for a pass of the root (the last committed token, which has no KV
yet) over the cache policy's drafting view (a partial KV cache for ``dynamic``); the LM
head on the root's hidden state gives depth 1, the heads give depths 2..k+1. Nothing is
written into the committed KV. Where that pass would not pay (over the whole context it
computes what verification computes for the root), the speculation policy declines it,
and the drafter drafts as ``medusa`` does: the heads on the hidden state that gave the
root token, head k for depth k (tree :data:`PARENT_TREE`).

With ``penalize`` (the default) the depth-1 candidates are ranked after the
pipeline's penalty on the committed context, i.e. by the scores verification draws
the root's token from. The penalty lowers frequent tokens that appeared recently, so
the raw top-1 is often not the likely draw: replaying 3 x 2,000 sampled tokens of the
demo model, the raw top-1 matched the draw 24% of the time, the penalised one 36%
(``benchmarks/acceptance_ceiling.py``). Heads keep their raw ranking (the penalty did
not help there). A depth-1 candidate's confidence is its probability under the
processed scores: exactly its chance of being drawn when the view was the whole
context.
"""

from __future__ import annotations

import attrs
import torch

from tokenswift.drafters import template
from tokenswift.drafters.head_based import PARENT_TREE, HeadDrafter
from tokenswift.validation import boolean


class TokenSwiftDrafter(HeadDrafter):
    """Heads over an extra forward of the last token on the drafting KV view."""

    name = "tokenswift"
    default_tree = [1, 3, 3, 3]

    @attrs.frozen(kw_only=True)
    class Options(HeadDrafter.Options):
        penalize: bool = attrs.field(default=True, converter=boolean("drafter.penalize"))

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        self.parent_paths = template.index_paths(PARENT_TREE[: self.heads.num_heads])
        self.parent_widths = template.depth_widths(self.parent_paths)

    @property
    def max_depth(self) -> int:
        return self.heads.num_heads + 1

    @property
    def max_tree_nodes(self) -> int:
        return max(len(self.paths), len(self.parent_paths))

    @torch.inference_mode()
    def propose(self, state, inputs):
        root = inputs.root_pass()
        if root is None:  # no drafting pass this step
            return self.from_parent(inputs.parent_hidden, self.parent_paths, self.parent_widths, inputs.noise)
        first = root.output.logits  # [1, vocab]: the LM head on the root, depth 1
        scorer = self.context.scorer
        context = scorer.context(state.tokens, device=first.device)
        processed = scorer(context, first)  # what verification will draw the root's token from
        if scorer.sampling.greedy:
            # Greedy verification takes the argmax: over the whole context that is the
            # pass's own argmax; over a partial view it nearly always is (the tracker
            # corrects the estimate by what is accepted).
            chance = torch.zeros_like(processed).scatter_(1, processed.argmax(-1, keepdim=True), 1.0)
        else:
            chance = processed.float().softmax(-1)
        ranking = scorer.penalize(context, first) if self.options.penalize and scorer.window else first
        heads = self._head_logits(root.output.hidden[0]).to(first.dtype)
        ranking = torch.cat([ranking, heads])
        probs = torch.cat([chance, heads.float().softmax(-1).to(chance.dtype)])
        return self.candidates(self.paths, self.widths, ranking[: len(self.widths)], probs[: len(self.widths)], inputs.noise)
