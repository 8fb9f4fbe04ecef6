"""An online suffix automaton over token ids.

Appending a token costs O(1) amortised. After each append, the automaton knows the
longest suffix of the text that also ended somewhere earlier, and where: the
continuation after that earlier occurrence is the natural guess for what comes next
(longest-match continuation, as in SuffixDecoding).
"""

from __future__ import annotations


class SuffixAutomaton:
    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]  # transitions per state
        self.link: list[int] = [-1]  # suffix link
        self.length: list[int] = [0]  # longest string of the state
        self.end: list[int] = [-1]  # an end position (index of its last token) of an occurrence
        self.last = 0
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        position = len(self.tokens)
        self.tokens.append(token)
        current = self._new_state(self.length[self.last] + 1, position)
        state = self.last
        while state != -1 and token not in self.next[state]:
            self.next[state][token] = current
            state = self.link[state]
        if state == -1:
            self.link[current] = 0
        else:
            target = self.next[state][token]
            if self.length[state] + 1 == self.length[target]:
                self.link[current] = target
            else:
                clone = self._new_state(self.length[state] + 1, self.end[target])
                self.next[clone] = dict(self.next[target])
                self.link[clone] = self.link[target]
                while state != -1 and self.next[state].get(token) == target:
                    self.next[state][token] = clone
                    state = self.link[state]
                self.link[target] = clone
                self.link[current] = clone
        self.last = current

    def _new_state(self, length: int, end: int) -> int:
        self.next.append({})
        self.link.append(-1)
        self.length.append(length)
        self.end.append(end)
        return len(self.length) - 1

    def matches(self, limit: int, min_length: int = 1) -> list[tuple[int, int]]:
        """Up to ``limit`` earlier occurrences of suffixes of the text, longest first:
        ``(match_length, end_position)`` with ``end_position`` before the last token."""
        out = []
        state = self.link[self.last]
        while state > 0 and len(out) < limit and self.length[state] >= min_length:
            out.append((self.length[state], self.end[state]))
            state = self.link[state]
        return out
