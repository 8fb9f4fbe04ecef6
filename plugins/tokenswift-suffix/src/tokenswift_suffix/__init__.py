"""tokenswift-suffix: the ``suffix`` retriever, a tokenswift plugin.

Where ``prompt-lookup`` matches the last 1-3 tokens, ``suffix`` finds the *longest*
suffix of the whole context that occurred before (any length, via a suffix
automaton updated in O(1) per token) and proposes what followed it; shorter matches
with other continuations become further branches.
"""

from __future__ import annotations

import attrs

from tokenswift import hookimpl
from tokenswift.interfaces import Retriever
from tokenswift.validation import int_at_least

from tokenswift_suffix.automaton import SuffixAutomaton

__version__ = "0.1.0"


class SuffixRetriever(Retriever):
    """Continuations of the longest earlier matches of the context's suffix."""

    @attrs.frozen(kw_only=True)
    class Options:
        num_tokens: int = attrs.field(default=8, converter=int_at_least("retriever.num_tokens", 1))
        branches: int = attrs.field(default=3, converter=int_at_least("retriever.branches", 1))
        min_match: int = attrs.field(default=2, converter=int_at_least("retriever.min_match", 1))

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        self.automaton = SuffixAutomaton()

    @property
    def max_tree_nodes(self) -> int:
        return self.options.num_tokens * self.options.branches

    def start(self, state) -> None:
        self.automaton = SuffixAutomaton()
        for token in state.tokens:
            self.automaton.append(token)

    def observe(self, state, outcome) -> None:
        for token in state.tokens[len(self.automaton) :]:
            self.automaton.append(token)

    def retrieve(self, state, first_tokens):
        tokens = self.automaton.tokens
        branches, seen = [], set()
        for _, end in self.automaton.matches(self.options.branches * 4, self.options.min_match):
            follow = tuple(tokens[end + 1 : end + 1 + self.options.num_tokens])
            if follow and follow not in seen:
                seen.add(follow)
                branches.append(list(follow))
                if len(branches) == self.options.branches:
                    break
        return branches


@hookimpl
def tokenswift_register_components(registrar) -> None:
    registrar.add("retriever", "suffix", SuffixRetriever)
    registrar.add_preset(
        "suffix",
        {
            "drafter": {"name": "none"},
            "retriever": {"name": "suffix"},
            "cache": {"name": "full"},
            "verifier": {"name": "tree-sampling"},
            "penalty": {"name": "contextual", "value": 1.2, "window": 1024},
            "sampling": {"temperature": 1.0, "min_p": 0.1},
        },
    )
