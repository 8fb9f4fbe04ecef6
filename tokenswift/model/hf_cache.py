"""The bridge to transformers: a ``Cache`` over the runner's :class:`KVStore`, and the
:class:`ForwardPlan` that tells the layers what one forward does.

Transformers' attention modules call ``cache.update(k, v, layer_idx)`` with the new
tokens' keys (already RoPE-rotated) and values, and attend over what it returns. Here
``update`` hands them to the plan's view (:mod:`tokenswift.model.kv`), which writes
them where they belong and returns the keys/values to attend over. The same plan
object travels to the attention function as the ``tokenswift_plan`` keyword argument
(transformers passes extra forward kwargs through to it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tokenswift.model.kv import KVStore, KVView

if TYPE_CHECKING:
    from tokenswift.model.attention import AttentionRecorder

PLAN_KWARG = "tokenswift_plan"


@attrs.define(eq=False)
class ForwardPlan:
    """One runner forward: the ``view`` its new tokens join, whether attention may skip
    the mask (``dense``: a single query sees every key), and an optional recorder of the
    last query's attention probabilities."""

    view: KVView
    dense: bool = False
    recorder: AttentionRecorder | None = None
    _grouped_mask: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)

    def grouped_mask(self, mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` ([1, 1, n, K] bool, the same in every layer) repeated for the ``group``
        query heads of a KV head and made additive ([1, 1, group * n, K], 0 / -inf):
        built once per forward instead of once per layer."""
        if self._grouped_mask is None or self._grouped_mask.dtype != dtype:
            n, keys = mask.shape[-2], mask.shape[-1]
            allowed = mask.expand(1, 1, n, keys).repeat(1, 1, group, 1)
            self._grouped_mask = torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill_(~allowed, float("-inf"))
        return self._grouped_mask


class StoreLayer(CacheLayerMixin):
    """One layer of :class:`StoreCache`."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: StoreCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self._layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102 - storage is preallocated
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states/value_states: [1, kv_heads, n, head_dim], keys already RoPE-rotated.
        return self._cache.plan.view.join(self._cache.store, self._layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.store.length

    def get_max_length(self) -> int:
        return self._cache.store.capacity


class StoreCache(Cache):
    """A transformers ``Cache`` whose layers read and write a :class:`KVStore` as the
    current :class:`ForwardPlan` says."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.plan: ForwardPlan | None = None
        super().__init__(layers=[StoreLayer(self, i) for i in range(store.num_layers)])
