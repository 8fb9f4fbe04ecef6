"""The ``prompt-lookup`` retriever: continue the latest earlier match of the last tokens.

As transformers' prompt lookup decoding: find the most recent earlier occurrence of
the last ``max_ngram`` tokens (then shorter, down to ``min_ngram``) anywhere in the
context, and propose the ``num_tokens`` tokens that followed it.
"""

from __future__ import annotations

import attrs

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

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        self._source: list[int] | None = None  # the token list indexed (a generation appends to it)
        self._indexed = 0  # n-grams ending before this index are in the tables
        self._latest: dict[int, dict[tuple[int, ...], int]] = {}  # n -> n-gram -> its latest start

    @property
    def max_tree_nodes(self) -> int:
        return self.options.num_tokens

    def start(self, state) -> None:
        self._source = None

    def _catch_up(self, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (the earlier ones)."""
        if tokens is not self._source or len(tokens) - 1 < self._indexed:
            self._source, self._indexed = tokens, 0
            self._latest = {n: {} for n in range(self.options.min_ngram, self.options.max_ngram + 1)}
        for end in range(self._indexed, len(tokens) - 1):  # n-gram tokens[end - n + 1 : end + 1]
            for n, latest in self._latest.items():
                if end + 1 >= n:
                    latest[tuple(tokens[end + 1 - n : end + 1])] = end + 1 - n
        self._indexed = max(self._indexed, len(tokens) - 1)

    def retrieve(self, state, first_tokens):
        tokens = state.tokens
        self._catch_up(tokens)
        length = len(tokens)
        for n in range(min(self.options.max_ngram, length - 1), self.options.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(tokens[length - n :]))
            if start is not None:
                return [tokens[start + n : start + n + self.options.num_tokens]]
        return []
