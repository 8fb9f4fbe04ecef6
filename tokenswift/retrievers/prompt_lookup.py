"""The ``prompt-lookup`` retriever: continue the latest earlier match of the last tokens.

As transformers' prompt lookup decoding: find the most recent earlier occurrence of
the last ``max_ngram`` tokens (then shorter, down to ``min_ngram``) anywhere in the
context, and propose the ``num_tokens`` tokens that followed it.
"""

from __future__ import annotations

import attrs
import torch

from tokenswift.errors import SpecError
from tokenswift.interfaces import Retriever
from tokenswift.validation import int_at_least


class PromptLookupRetriever(Retriever):
    """The continuation of the latest earlier match of the last n tokens."""

    @attrs.frozen(kw_only=True)
    class Options:
        max_ngram: int = attrs.field(default=3, converter=int_at_least("retriever.max_ngram", 1))
        min_ngram: int = attrs.field(default=1, converter=int_at_least("retriever.min_ngram", 1))
        num_tokens: int = attrs.field(default=10, converter=int_at_least("retriever.num_tokens", 1))

        def __attrs_post_init__(self):
            if self.min_ngram > self.max_ngram:
                raise SpecError(f"retriever.min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")

    @property
    def max_tree_nodes(self) -> int:
        return self.options.num_tokens

    def retrieve(self, state, first_tokens):
        tokens = torch.tensor(state.tokens)
        length = tokens.numel()
        for n in range(min(self.options.max_ngram, length - 1), self.options.min_ngram - 1, -1):
            windows = tokens[: length - 1].unfold(0, n, 1)  # [length - n, n]: earlier n-grams only
            hits = (windows == tokens[length - n :]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                follow = tokens[start : start + self.options.num_tokens].tolist()
                if follow:
                    return [follow]
        return []
