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

Below depth 1 the drafter drafts with heads (the paper's) or with a draft layer
(``levels``): the ``eagle`` drafter's network, fed the pass's own feature of the root
(:class:`~tokenswift.drafters.eagle.EagleDrafter` with ``root_pass``), so that depth 2
is drafted as well as the layer drafts its first level without a pass. With fixed
trees (at most 64 nodes, held-out 2K prompt, 512 new tokens, float32; a 2-core Sapphire
Rapids) the shipped heads earned 2.81 tokens per step greedy and 2.70 with the paper's
sampling, the shipped layer 3.88 and 3.20 (the ``eagle`` preset, no pass: 2.78 and
2.47). ``levels = "auto"`` takes the layer where one is shipped for the model and no
heads were named (``heads = "auto"``), else the heads. Where no pass runs, the layer
drafts as the ``eagle`` drafter does; the heads as ``medusa`` does.
"""

from __future__ import annotations

import attrs
import torch

from tokenswift.drafters import template
from tokenswift.drafters.eagle import EagleDrafter
from tokenswift.drafters.feature_net import find_shipped_drafter
from tokenswift.drafters.head_based import PARENT_TREE, HeadDrafter
from tokenswift.errors import SpecError
from tokenswift.interfaces import Drafter
from tokenswift.validation import boolean, weights_source

LEVELS = ("auto", "heads", "layer")


def _levels(value):
    if value not in LEVELS:
        raise SpecError(f"drafter.levels must be one of {list(LEVELS)}, got {value!r}")
    return value


class TokenSwiftDrafter(HeadDrafter):
    """Heads (or a draft layer) over an extra forward of the last token on the drafting KV view."""

    name = "tokenswift"
    default_tree = [1, 3, 3, 3]

    @attrs.frozen(kw_only=True)
    class Options(HeadDrafter.Options):
        penalize: bool = attrs.field(default=True, converter=boolean("drafter.penalize"))
        levels: str = attrs.field(default="auto", converter=_levels)
        weights: str = attrs.field(default="auto", converter=weights_source(
            "drafter.weights", "the eagle layer shipped for this model", "a directory from `tokenswift train-drafter`"))

    def __init__(self, options, context) -> None:
        self.layer: EagleDrafter | None = None
        if self._uses_layer(options, context):
            Drafter.__init__(self, options, context)
            layer_options = EagleDrafter.Options(weights=options.weights, root_pass=True, seed=options.seed)
            self.layer = EagleDrafter(layer_options, context)
            return
        super().__init__(options, context)
        self.parent_paths = template.index_paths(PARENT_TREE[: self.heads.num_heads])
        self.parent_widths = template.depth_widths(self.parent_paths)

    @staticmethod
    def _uses_layer(options, context) -> bool:
        if options.levels != "auto":
            return options.levels == "layer"
        return options.heads == "auto" and (
            options.weights != "auto" or find_shipped_drafter(context.runner.model) is not None
        )

    @property
    def max_depth(self) -> int:
        return self.layer.options.depth if self.layer is not None else self.heads.num_heads + 1  # the layer drafts depth 1 from the pass

    @property
    def max_tree_nodes(self) -> int:
        if self.layer is not None:
            return self.layer.max_tree_nodes
        return max(len(self.paths), len(self.parent_paths))

    # With a draft layer, the layer keeps its cache in step with the text.

    @property
    def catch_up_seconds(self) -> float:
        return self.layer.catch_up_seconds if self.layer is not None else 0.0

    @property
    def prompt_features(self) -> int:
        return self.layer.prompt_features if self.layer is not None else 0

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.layer.feature_layers if self.layer is not None else ()

    def start(self, state) -> None:
        if self.layer is not None:
            self.layer.start(state)

    def prime(self, state, hidden) -> None:
        if self.layer is not None:
            self.layer.prime(state, hidden)

    def observe(self, state, outcome) -> None:
        if self.layer is not None:
            self.layer.observe(state, outcome)

    def compile_now(self) -> float:
        return self.layer.compile_now() if self.layer is not None else 0.0

    @torch.inference_mode()
    def propose(self, state, inputs):
        if self.layer is not None:
            return self.layer.propose(state, inputs)
        root = inputs.root_pass()
        if root is None:  # no drafting pass this step
            return self.from_parent(inputs.parent_hidden, self.parent_paths, self.parent_widths, inputs.noise_of)
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
        return self.candidates(self.paths, self.widths, ranking[: len(self.widths)], probs[: len(self.widths)], inputs.noise_of)
