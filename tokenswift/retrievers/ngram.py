"""The ``ngram`` retriever: TokenSwift's token reuse.

A table of the n-grams (n = 4) seen so far, keyed by their first token, with
continuations ranked by count. For each depth-1 candidate of the drafter (or for the
root when there is none) the ``top_k`` most frequent continuations become branches.

An n-gram enters the table only once all its tokens have left the penalty window:
tokens inside it are being penalised, so n-grams made of them would mostly be
rejected (the paper's rule). The prompt is preloaded by the same rule.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict

import attrs

from tokenswift.interfaces import Retriever
from tokenswift.tree import Branch
from tokenswift.validation import int_at_least


class NgramRetriever(Retriever):
    """Frequent n-grams of the text so far, keyed by their first token."""

    @attrs.frozen(kw_only=True)
    class Options:
        n: int = attrs.field(default=4, converter=int_at_least("retriever.n", 2))
        top_k: int = attrs.field(default=20, converter=int_at_least("retriever.top_k", 0))
        keys: int = attrs.field(default=1, converter=int_at_least("retriever.keys", 1))
        window: int | None = attrs.field(default=None, converter=int_at_least("retriever.window", 0, optional=True))

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        # n-grams join the table once they leave this many most recent tokens.
        penalty = context.penalty
        self.window = options.window if options.window is not None else (penalty.window if penalty is not None else 0)
        self.table: dict[int, Counter] = defaultdict(Counter)
        self.fed = 0  # n-grams starting before this index are in the table
        self._ranking: dict[int, list] = {}  # key -> its ranked continuations, until the key's counts change

    @property
    def max_tree_nodes(self) -> int:
        return self.options.keys * self.options.top_k * self.options.n

    def start(self, state) -> None:
        self.table = defaultdict(Counter)
        self.fed = 0
        self._ranking = {}
        self._feed(state.tokens)

    def observe(self, state, outcome) -> None:
        self._feed(state.tokens)

    def _feed(self, tokens: list[int]) -> None:
        n = self.options.n
        limit = len(tokens) - self.window - n  # last start whose n-gram has left the window
        for start in range(self.fed, limit + 1):
            self.table[tokens[start]][tuple(tokens[start + 1 : start + n])] += 1
            self._ranking.pop(tokens[start], None)
        self.fed = max(self.fed, limit + 1)

    def continuations(self, key: int) -> list[tuple[int, ...]]:
        """The ``top_k`` most frequent continuations after ``key`` (ties: first seen)."""
        return [c for c, _ in self._ranked(key)]

    def _ranked(self, key: int) -> list[tuple[tuple[int, ...], float]]:
        """The ``top_k`` most frequent continuations after ``key`` with their share of its
        n-grams (ranked once per change of the key's counts: a frequent key has
        thousands of continuations in a long text, a step must not rank them anew)."""
        ranking = self._ranking.get(key)
        if ranking is None:
            counts = self.table.get(key)
            if not counts or self.options.top_k == 0:
                return []
            total = sum(counts.values())
            top = heapq.nlargest(self.options.top_k, counts.items(), key=lambda item: item[1])
            ranking = self._ranking[key] = [(c, count / total) for c, count in top]
        return ranking

    def retrieve(self, state, first_tokens):
        # A continuation's first token is as likely as its share of the key's n-grams;
        # the tokens after it get no estimate of their own (the pipeline learns one).
        if not first_tokens:
            return [Branch(c, [share] + [None] * (len(c) - 1)) for c, share in self._ranked(state.tokens[-1])]
        return [
            Branch((key, *c), [None, share] + [None] * (len(c) - 1))
            for key in first_tokens[: self.options.keys]
            for c, share in self._ranked(key)
        ]
