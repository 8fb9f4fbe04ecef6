"""TokenSwift's contextual penalty: a repetition penalty over the last ``window`` tokens.

transformers' ``RepetitionPenaltyLogitsProcessor`` penalises every token of its input
ids; here it is given each node's last ``window`` context tokens only, so tokens that
left the window are free again (this is what keeps 100K-token outputs from looping
without banning common words forever).
"""

from __future__ import annotations

import attrs
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from tokenswift.errors import SpecError
from tokenswift.interfaces import Penalty


def _positive_float(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"penalty.value must be a number > 0, got {value!r}")
    if not value > 0:
        raise SpecError(f"penalty.value must be > 0 (1.0 means no penalty), got {value!r}")
    return float(value)


def _window(value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"penalty.window must be an integer >= 0, got {value!r}")
    if value < 0:
        raise SpecError(f"penalty.window must be >= 0, got {value!r}")
    return value


class ContextualPenalty(Penalty):
    """Repetition penalty ``value`` on tokens among the last ``window`` context tokens."""

    @attrs.frozen(kw_only=True)
    class Options:
        value: float = attrs.field(default=1.2, converter=_positive_float)
        window: int = attrs.field(default=1024, converter=_window)

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        self._processor = RepetitionPenaltyLogitsProcessor(penalty=options.value)

    @property
    def window(self) -> int:
        return self.options.window if self.options.value != 1.0 else 0

    def apply(self, contexts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.window == 0 or contexts.shape[1] == 0:
            return scores
        return self._processor(contexts, scores)
