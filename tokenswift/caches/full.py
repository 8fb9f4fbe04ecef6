"""The ``full`` cache policy: drafting attends over the whole committed KV."""

from __future__ import annotations

from tokenswift.interfaces import CachePolicy
from tokenswift.model.kv import FullView


class FullCache(CachePolicy):
    """Draft over every committed position, read in place."""

    def drafting_view(self, state):
        return FullView(state.runner.store)
