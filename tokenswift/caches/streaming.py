"""The ``streaming`` cache policy: attention sinks plus the most recent positions."""

from __future__ import annotations

import torch

from tokenswift.caches.refreshing import RefreshingPolicy


class StreamingPolicy(RefreshingPolicy):
    """Sink positions plus a window of the most recent ones."""

    def select(self, state, length):
        sink = self.sink_positions(length)
        recent = torch.arange(length - (self.selection_size - sink.numel()), length)
        return torch.cat([sink, recent])
