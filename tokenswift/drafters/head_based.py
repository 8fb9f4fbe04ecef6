"""The base of the drafters built on draft heads (``tokenswift``, ``medusa``): the
heads, the options, and cutting the ranked candidates into the template's tree, each
candidate with its probability as the confidence that it is accepted."""

from __future__ import annotations

import logging

import attrs
import torch

from tokenswift.drafters import template
from tokenswift.drafters.draft_heads import DraftHeads, find_shipped_heads
from tokenswift.errors import SpecError
from tokenswift.interfaces import Drafter
from tokenswift.stats import model_time
from tokenswift.tree import Branch
from tokenswift.validation import int_at_least, integer, weights_source

logger = logging.getLogger(__name__)


PARENT_TREE = [3, 3, 3]  # candidates of the heads on the parent's hidden state (no drafting pass)
# The likeliest tokens of a head's depth that are ranked coupled to the draw: where the
# draft agrees with the target, a token outside them wins the target's draw about as
# often as it holds the draft's 257th place; the noise and the rating of 49,152 tokens
# took ~0.5 ms a depth (SmolLM2-135M's vocabulary).
SHORTLIST = 256


class HeadDrafter(Drafter):
    """Base of the head drafters. Subclasses give the per-depth ranked candidates."""

    default_tree: list[int] = [1, 3, 3, 3]

    @attrs.frozen(kw_only=True)
    class Options:
        heads: str = attrs.field(default="auto", converter=weights_source(
            "drafter.heads", "the shipped heads for this model", "a directory of saved heads"))
        tree: list = attrs.field(default=None)
        num_heads: int = attrs.field(default=3, converter=int_at_least("drafter.num_heads", 1))
        seed: int = attrs.field(default=0, converter=integer("drafter.seed"))

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        runner = context.runner
        self.runner = runner
        source = options.heads
        if source == "auto":
            shipped = find_shipped_heads(runner.model)
            if shipped is None:
                logger.warning(
                    "no shipped draft heads match this model; using random heads (still lossless, but slow). "
                    "Train some with `tokenswift train-heads` and pass drafter.heads = DIR."
                )
                source = "random"
            else:
                source = str(shipped)
        tree = options.tree
        if source == "random":
            self.heads = DraftHeads.random(runner.model, num_heads=options.num_heads, seed=options.seed)
        else:
            self.heads = DraftHeads.from_pretrained(source, runner.model)
            if tree is None:
                tree = template.load_tree(source, self.name)  # fitted for these heads (tokenswift fit-tree)
                if tree is not None:
                    logger.info("%s drafter: the tree fitted for these heads (%s)", self.name, source)
        self.heads.eval()
        if tree is None:
            tree = self.default_tree
        self.paths = template.index_paths(tree)
        self.widths = template.depth_widths(self.paths)
        if len(self.widths) > self.max_depth:
            raise SpecError(
                f"drafter.tree {tree!r} is {len(self.widths)} deep, but {self.name!r} with "
                f"{self.heads.num_heads} heads drafts at most {self.max_depth} tokens ahead"
            )
        logger.info("%s drafter: %d heads, tree of %d nodes", self.name, self.heads.num_heads, len(self.paths))

    name = "heads"

    @property
    def max_depth(self) -> int:
        raise NotImplementedError

    @property
    def max_tree_nodes(self) -> int:
        return len(self.paths)

    @staticmethod
    def candidates(paths, widths, ranking: torch.Tensor, probs: torch.Tensor, noise=None) -> list[Branch]:
        """The template's branches from per-depth candidates: ``ranking`` [depth, vocab]
        orders each depth's tokens, ``probs`` [depth, vocab] gives their confidences.
        ``noise(depth, ids)``: the sampler's noise for that depth at token ``ids`` (None:
        none, :meth:`~tokenswift.interfaces.DraftInputs.noise_of`); where there is some,
        a depth's :data:`SHORTLIST` likeliest tokens are ranked by their log-probability
        plus it (the draw the target makes with the same noise) and rated by
        :func:`coupled_rating`."""
        tokens, confidences = [], []
        coupled = noise is not None and noise(1, torch.empty(0, dtype=torch.long, device=probs.device)) is not None
        for depth, (row, prob_row, width) in enumerate(zip(ranking, probs, widths), start=1):
            if coupled:
                short = prob_row.topk(min(SHORTLIST, prob_row.numel())).indices
                rating, prob_short = coupled_rating(prob_row[short], noise(depth, short))
                top = rating.topk(min(width, rating.numel())).indices
                tokens.append(short[top].tolist())
                confidences.append(prob_short[top].tolist())
                continue
            top = row.topk(width).indices
            tokens.append(top.tolist())
            confidences.append(prob_row[top].tolist())
        return template.branches(paths, tokens, confidences)

    @model_time
    @torch.inference_mode()
    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [hidden_size] -> [num_heads, vocab], the heads' logits (the model's LM head)."""
        return self.runner.logits(self.heads(hidden))

    def from_parent(self, parent_hidden: torch.Tensor | None, paths, widths, noise=None) -> list[Branch]:
        """Branches from the heads on the hidden state that gave the root token (head k
        predicts depth k), with the heads' probabilities as confidences (coupled to the
        sampler's ``noise(depth, ids)`` where there is some)."""
        if parent_hidden is None:
            return []
        logits = self._head_logits(parent_hidden)[: len(widths)]
        return self.candidates(paths, widths, logits, logits.float().softmax(-1), noise)


def coupled_rating(probs: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A depth's ranking and confidences under the coupled sampler. probs: [V] the
    draft's q; noise: [V] the Gumbel noise the target's draw there adds to those V tokens.

    Ranking: ``log q + noise``, whose top is ``argmax(log q + G)``, the token the target's
    ``argmax(log p + G)`` lands on whenever p and q agree near the top. Confidence:
    ``softmax(log q + noise)``, the chance that token wins were the target q plus a
    fresh Gumbel perturbation as large again: above q for the coupled favourite, below
    it for the rest (the acceptance tracker corrects the estimate by what is accepted)."""
    ranking = probs.double().log() + noise.to(probs.device)
    return ranking, ranking.softmax(-1).to(probs.dtype)
