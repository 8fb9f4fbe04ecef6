"""The ``none`` penalty: scores pass through unchanged."""

from __future__ import annotations

import torch

from tokenswift.interfaces import Penalty


class NoPenalty(Penalty):
    """No penalty."""

    def apply(self, contexts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores
