"""Partial drafting caches refreshed when their recent window fills.

While the committed context fits the ``budget``, drafting sees all of it. Beyond, a
selection of ``budget - recent`` positions (chosen by the subclass) is copied into a
:class:`~tokenswift.model.kv.CompactView`; newly committed positions are appended to
it, and once ``recent`` of them have accumulated the selection is made again from
scratch. Verification always uses the full KV.
"""

from __future__ import annotations

import abc
import logging

import attrs
import torch

from tokenswift.errors import SpecError
from tokenswift.interfaces import CachePolicy
from tokenswift.model.kv import CompactView
from tokenswift.validation import int_at_least

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class RefreshingOptions:
    budget: int = attrs.field(default=4096, converter=int_at_least("cache.budget", 2))
    sink: int = attrs.field(default=16, converter=int_at_least("cache.sink", 0))
    recent: int | None = attrs.field(default=None, converter=int_at_least("cache.recent", 1, optional=True))

    def __attrs_post_init__(self):
        if self.recent_size >= self.budget - self.sink:
            raise SpecError(
                f"cache.recent ({self.recent_size}) must be smaller than budget - sink ({self.budget - self.sink})"
            )

    @property
    def recent_size(self) -> int:
        return self.recent if self.recent is not None else max(1, self.budget // 4)


class RefreshingPolicy(CachePolicy):
    Options = RefreshingOptions
    scratch = 1  # new-token room in the view's buffers: the root pass forwards one token

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        self.view: CompactView | None = None
        self.covered = 0  # committed positions [0, covered) are accounted for in the view
        self.refreshes = 0

    def start(self, state) -> None:
        self.view, self.covered, self.refreshes = None, 0, 0

    @property
    def selection_size(self) -> int:
        return self.options.budget - self.options.recent_size

    def view_positions(self, context_positions: int) -> int:
        return self.options.budget + self.scratch if context_positions > self.options.budget else 0

    def partial(self, committed_positions):
        return committed_positions > self.options.budget

    def update_view(self, state):
        store = self.context.runner.store
        length = store.length
        if length <= self.options.budget:
            return None  # the whole context fits the budget
        if self.view is None or self.view.size + (length - self.covered) > self.options.budget:
            if self.view is None:
                self.view = CompactView(store, self.options.budget, scratch=self.scratch)
            self.view.load(store, self.select(state, length))
            self.refreshes += 1
            logger.debug("drafting cache refreshed at %d committed positions", length)
        else:
            self.view.append(store, self.covered, length)
        self.covered = length
        return self.view

    def sink_positions(self, length: int) -> torch.Tensor:
        return torch.arange(min(self.options.sink, length))

    @abc.abstractmethod
    def select(self, state, length: int) -> torch.Tensor:
        """Committed positions to keep: [S] or [layers, kv_heads, S], S = selection_size."""
