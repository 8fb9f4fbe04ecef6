"""The ``full`` cache policy: drafting attends over the whole committed KV."""

from __future__ import annotations

from tokenswift.interfaces import CachePolicy


class FullPolicy(CachePolicy):
    """Draft over every committed position, read in place."""

    def update_view(self, state):
        return None

    def partial(self, committed_positions):
        return False
