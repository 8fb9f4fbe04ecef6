"""The ``ngram`` retriever: TokenSwift's token reuse.

A table of the n-grams (n = 4) seen so far, keyed by their first token, with
continuations ranked by count. For each depth-1 candidate of the drafter (or for the
root when there is none) the ``top_k`` most frequent continuations become branches.

An n-gram enters the table only once all its tokens have left the penalty window:
tokens inside it are being penalised, so n-grams made of them would mostly be
rejected (the paper's rule). The prompt is preloaded by the same rule.

With ``recent`` (the default), the n-grams still inside the window are kept apart, and
their continuations are proposed after the table's with no confidence of their own: the
speculation policy learns how often such nodes are accepted apart from the table's
(:class:`~tokenswift.speculation.AcceptanceTracker`'s bin of nodes without an
estimate), so they are verified only where they pay. Under the paper's rule a text that
falls into a loop (the demo model's long runs do: a line of ``system`` repeated for
1,000 tokens, 1.05 tokens a step) offers nothing to reuse until the loop is older than
the window, though the penalty does not stop the model repeating it.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict

import attrs

from tokenswift.errors import SpecError
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
        recent: bool = attrs.field(default=True)

        @recent.validator
        def _check_recent(self, _attribute, value):
            if not isinstance(value, bool):
                raise SpecError(f"retriever.recent must be true or false, got {value!r}")

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        # n-grams join the table once they leave this many most recent tokens.
        penalty = context.penalty
        self.window = options.window if options.window is not None else (penalty.window if penalty is not None else 0)
        self.table: dict[int, Counter] = defaultdict(Counter)
        self.fed = 0  # n-grams starting before this index are in the table
        self._ranking: dict[int, list] = {}  # key -> its ranked continuations, until the key's counts change
        # with options.recent: the n-grams not yet in the table (some token still in the window)
        self.recent: dict[int, Counter] = defaultdict(Counter)
        self.recent_fed = 0  # n-grams starting before this index are in the table or in `recent`
        self._recent_ranking: dict[int, list] = {}

    @property
    def max_tree_nodes(self) -> int:
        return self.options.keys * self.options.top_k * self.options.n * (2 if self.options.recent else 1)

    def start(self, state) -> None:
        self.table = defaultdict(Counter)
        self.fed = 0
        self._ranking = {}
        self.recent = defaultdict(Counter)
        self.recent_fed = 0
        self._recent_ranking = {}
        self._feed(state.tokens)

    def observe(self, state, outcome) -> None:
        self._feed(state.tokens)

    def _feed(self, tokens: list[int]) -> None:
        n = self.options.n
        limit = len(tokens) - self.window - n  # last start whose n-gram has left the window
        for start in range(self.fed, limit + 1):
            key, continuation = tokens[start], tuple(tokens[start + 1 : start + n])
            self.table[key][continuation] += 1
            self._ranking.pop(key, None)
            if start < self.recent_fed:  # it leaves `recent` for the table
                counts = self.recent[key]
                counts[continuation] -= 1
                if counts[continuation] <= 0:
                    del counts[continuation]
                self._recent_ranking.pop(key, None)
        self.fed = max(self.fed, limit + 1)
        if not self.options.recent:
            return
        for start in range(max(self.recent_fed, self.fed), len(tokens) - n + 1):
            self.recent[tokens[start]][tuple(tokens[start + 1 : start + n])] += 1
            self._recent_ranking.pop(tokens[start], None)
        self.recent_fed = max(self.recent_fed, self.fed, len(tokens) - n + 1)

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

    def recent_continuations(self, key: int) -> list[tuple[int, ...]]:
        """The ``top_k`` most frequent continuations after ``key`` among the n-grams still
        inside the penalty window (``recent``; ties: first seen)."""
        ranking = self._recent_ranking.get(key)
        if ranking is None:
            counts = self.recent.get(key)
            top = heapq.nlargest(self.options.top_k, counts.items(), key=lambda item: item[1]) if counts else []
            ranking = self._recent_ranking[key] = [c for c, _ in top]
        return ranking

    def _branches(self, key: int) -> list[tuple[tuple[int, ...], float | None]]:
        """The continuations after ``key``, the table's with their share of its n-grams,
        then the window's not among them, with no estimate."""
        ranked = self._ranked(key)
        if not self.options.recent:
            return ranked
        seen = {c for c, _ in ranked}
        return ranked + [(c, None) for c in self.recent_continuations(key) if c not in seen]

    def retrieve(self, state, first_tokens):
        # A continuation's first token is as likely as its share of the key's n-grams;
        # the tokens after it get no estimate of their own (the pipeline learns one).
        if not first_tokens:
            return [Branch(c, [share] + [None] * (len(c) - 1)) for c, share in self._branches(state.tokens[-1])]
        return [
            Branch((key, *c), [None, share] + [None] * (len(c) - 1))
            for key in first_tokens[: self.options.keys]
            for c, share in self._branches(key)
        ]
