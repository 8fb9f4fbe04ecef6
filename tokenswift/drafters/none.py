"""The ``none`` drafter: no proposals (plain autoregressive decoding)."""

from __future__ import annotations

from tokenswift.interfaces import Drafter


class NoDrafter(Drafter):
    """Proposes nothing."""

    def propose(self, state, inputs):
        return []
