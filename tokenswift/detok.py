"""Incremental detokenization for streaming: text deltas that never split a character."""

from __future__ import annotations


class IncrementalDecoder:
    """Yields the text added by each batch of new tokens.

    Decodes a short sliding window (the last few tokens already printed plus the new
    ones) rather than the whole output, so the cost per step stays constant on
    100K-token runs; a delta that ends in an incomplete UTF-8 sequence is held back.
    """

    def __init__(self, tokenizer, context_tokens: int = 6) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for reference
        self.read_offset = 0  # tokens before this have been emitted as text
        self.context_tokens = context_tokens

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def prime(self, tokens: list[int]) -> str:
        """Start after ``tokens`` that were already emitted (a resumed run); returns their text."""
        self.tokens = list(tokens)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(0, self.read_offset - self.context_tokens)
        return self._decode(self.tokens)

    def push(self, new_tokens: list[int]) -> str:
        self.tokens.extend(new_tokens)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(0, self.read_offset - self.context_tokens)
        return delta
