"""What the text has become: distinct-n over the last tokens and the model's own
negative log-likelihood of what it emitted.

Decoding is lossless, so the text is the model's; but a small model's long outputs
can turn to loops (the same lines again: distinct-4 falls) or to noise (invented words:
the model's own NLL of what it emitted rises). The paper reports distinct-n beside
every speedup for that reason. A :class:`TextHealthMonitor` keeps both figures
incrementally, O(n) per token, from the emitted tokens and their NLL under the raw
logits (before the penalty and the warpers: the verify forward's own rows, no extra
forward), and logs a warning when the text looks like a loop.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Sequence

import attrs

logger = logging.getLogger(__name__)

WINDOW = 1024  # distinct-n and the recent NLL are over the last this many emitted tokens
MAX_N = 4
# Healthy prose has distinct-4 near 1 over 1,024 tokens (the demo model at the paper's
# sampling: 0.97); a loop of a few lines falls far below (0.52 without the penalty, 0.06
# for one line repeated). 0 turns the warning off.
LOOP_THRESHOLD = 0.5
WARN_AFTER = 256  # a short window is distinct by construction: judge loops from this many tokens on
REARM_MARGIN = 0.1  # a loop warned about is warned about again only after distinct-4 rose this far above the threshold


@attrs.frozen(kw_only=True)
class TextHealth:
    """The text's health at one point of a generation.

    ``distinct[n - 1]``: distinct n-grams / n-grams over the last ``window_tokens``
    emitted tokens (n = 1..4); ``self_nll``: the model's mean negative log-likelihood
    (nats per token, raw logits) of every token this run emitted; ``recent_self_nll``:
    the same over the window. NaN where no token was scored."""

    window_tokens: int
    distinct: tuple[float, ...]
    self_nll: float
    recent_self_nll: float

    @property
    def distinct_4(self) -> float:
        return self.distinct[3]

    def summary(self) -> dict[str, float | None]:
        def rounded(value: float) -> float | None:
            return None if math.isnan(value) else round(value, 3)

        figures = {f"distinct_{n + 1}": rounded(value) for n, value in enumerate(self.distinct)}
        return {**figures, "self_nll": rounded(self.self_nll), "recent_self_nll": rounded(self.recent_self_nll)}


EMPTY_SUMMARY = {**{f"distinct_{n + 1}": None for n in range(MAX_N)}, "self_nll": None, "recent_self_nll": None}


class TextHealthMonitor:
    """Distinct-n (n = 1..4) over the last ``window`` tokens and the self-NLL, kept
    incrementally as tokens are pushed; warns once (through :mod:`logging`) when
    distinct-4 falls below ``loop_threshold`` with at least ``warn_after`` tokens in the
    window, and again only after it recovered."""

    def __init__(
        self, window: int = WINDOW, loop_threshold: float = LOOP_THRESHOLD, warn_after: int = WARN_AFTER
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < MAX_N:
            raise ValueError(f"the health window must be an integer >= {MAX_N}, got {window!r}")
        check_loop_threshold(loop_threshold)
        self.window, self.loop_threshold, self.warn_after = window, float(loop_threshold), min(warn_after, window)
        self._tokens: deque[int] = deque()
        self._grams = [Counter() for _ in range(MAX_N)]
        self._nlls: deque[float] = deque()
        self._recent_nll = 0.0
        self._total_nll, self._scored = 0.0, 0
        self._generated = 0
        self.looping = False  # distinct-4 is below the threshold now (warned)

    def prime(self, tokens: Sequence[int]) -> None:
        """Tokens emitted before this run (a resumed checkpoint): they count for
        distinct-n, not for the NLL, which this run did not compute."""
        for token in list(tokens)[-self.window:]:
            self._push_token(int(token))
        self._generated = len(tokens)

    def push(self, tokens: Sequence[int], nlls: Sequence[float]) -> None:
        """Emitted tokens and the NLL of each (the same length)."""
        if len(tokens) != len(nlls):
            raise ValueError(f"{len(tokens)} tokens but {len(nlls)} NLL values")
        for token, nll in zip(tokens, nlls):
            self._push_token(token)
            self._nlls.append(nll)
            self._recent_nll += nll
            if len(self._nlls) > self.window:
                self._recent_nll -= self._nlls.popleft()
            self._total_nll += nll
            self._scored += 1
        self._generated += len(tokens)
        self._watch()

    def _push_token(self, token: int) -> None:
        window = self._tokens
        window.append(token)
        size = len(window)
        for n, grams in enumerate(self._grams, start=1):
            if size >= n:
                grams[tuple(window[i] for i in range(size - n, size))] += 1
        if size > self.window:  # the n-grams that start at the oldest token leave with it
            for n, grams in enumerate(self._grams, start=1):
                gram = tuple(window[i] for i in range(n))
                grams[gram] -= 1
                if not grams[gram]:
                    del grams[gram]
            window.popleft()

    def distinct(self, n: int) -> float:
        count = len(self._tokens) - n + 1
        return len(self._grams[n - 1]) / count if count > 0 else math.nan

    def health(self) -> TextHealth:
        recent = len(self._nlls)
        return TextHealth(
            window_tokens=len(self._tokens),
            distinct=tuple(self.distinct(n) for n in range(1, MAX_N + 1)),
            self_nll=self._total_nll / self._scored if self._scored else math.nan,
            recent_self_nll=self._recent_nll / recent if recent else math.nan,
        )

    def _watch(self) -> None:
        if not self.loop_threshold or len(self._tokens) < self.warn_after:
            return
        distinct_4 = self.distinct(MAX_N)
        if not self.looping and distinct_4 < self.loop_threshold:
            self.looping = True
            logger.warning(
                "the text looks like a loop: distinct-4 over the last %d tokens is %.3f (below %.3g) at %d new tokens",
                len(self._tokens), distinct_4, self.loop_threshold, self._generated,
            )
        elif self.looping and distinct_4 >= self.loop_threshold + REARM_MARGIN:
            self.looping = False
            logger.info("the text left its loop: distinct-4 %.3f at %d new tokens", distinct_4, self._generated)


def check_loop_threshold(value: float) -> float:
    """The loop warning's threshold: a number in [0, 1] (0: no warning)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"loop_threshold must be a number in [0, 1] (0 turns the warning off), got {value!r}")
    return float(value)
