"""The bridge to transformers: a ``Cache`` over the runner's :class:`KVStore`, whose
layers do what the forward's :class:`~tokenswift.model.plan.ForwardPlan` says.

Transformers' attention modules call ``cache.update(k, v, layer_idx)`` with the new
tokens' keys (already RoPE-rotated) and values, and attend over what it returns. Here
``update`` hands them to the plan's view (:mod:`tokenswift.model.kv`), which writes
them where they belong and returns the keys/values to attend over. The same plan
object travels to the attention function as the ``tokenswift_plan`` keyword argument
(transformers passes extra forward kwargs through to it).
"""

from __future__ import annotations

import weakref

from transformers.cache_utils import Cache, CacheLayerMixin

from tokenswift.model.kv import KVStore
from tokenswift.model.plan import ForwardPlan


class StoreLayer(CacheLayerMixin):
    """One layer of :class:`StoreCache`. It refers to its cache weakly: a strong
    reference made the cache, its layers and its store a reference cycle, so a store
    the runner replaced (a longer request, a calibration's contexts) stayed allocated
    until Python's cyclic collector ran, which a process allocating few objects rarely
    does (after 100 requests of growing prompts a full collection freed 153.7 MiB of them;
    a store of 16K positions is 360 MiB)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: StoreCache, layer_idx: int) -> None:
        super().__init__()
        self._cache_ref = weakref.ref(cache)
        self._layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102 - storage is preallocated
        return None

    @property
    def _cache(self) -> StoreCache:
        cache = self._cache_ref()
        if cache is None:
            raise RuntimeError("this cache layer outlived its StoreCache (the runner replaced its KV store)")
        return cache

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states/value_states: [1, kv_heads, n, head_dim], keys already RoPE-rotated.
        cache = self._cache
        return cache.plan.view.join(cache.store, self._layer_idx, key_states, value_states)

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
