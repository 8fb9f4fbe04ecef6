"""Preallocated KV storage and its adapter to transformers' public Cache API.

The runner owns one :class:`KVStore` per generation: per layer, a key and a value
buffer of shape ``[1, kv_heads, capacity, head_dim]`` allocated once. Positions
``[0, length)`` hold the committed context; positions ``[length, length + n)`` are the
staging area that a forward over the full store writes its new tokens into, until
:meth:`KVStore.commit` keeps a chosen subset of them.

Transformers' attention modules call ``cache.update(k, v, layer_idx)`` with keys that
are already RoPE-rotated and expect the keys/values to attend over in return. The
:class:`StoreCache` answers according to the *plan* the runner set for the current
forward: either the full store (new tokens written into staging) or a caller-chosen
:class:`KVView` with the new tokens appended (nothing written into the store).
"""

from __future__ import annotations

import abc

import attrs
import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class KVStore:
    """Per-layer key/value buffers ``[1, kv_heads, capacity, head_dim]``, allocated once."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0  # committed positions
        self.staged = 0  # tokens written after `length` by the latest full forward

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def kv_heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[3]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def reset(self) -> None:
        self.length = 0
        self.staged = 0

    def commit(self, kept: torch.Tensor) -> None:
        """Keep staged positions ``kept`` (indices into staging, ascending) as committed.

        kept: [k] long, each in ``[0, staged)``; they are compacted in place to
        ``[length, length + k)`` and the rest of staging is dropped.
        """
        kept = kept.to(dtype=torch.long)
        k = int(kept.numel())
        if k:
            if int(kept.max()) >= self.staged or int(kept.min()) < 0:
                raise ValueError(
                    f"commit: kept positions {kept.tolist()} must lie in [0, {self.staged}), "
                    "the tokens staged by the latest full forward"
                )
            if not bool((kept[1:] > kept[:-1]).all()):
                raise ValueError(f"commit: kept positions must be strictly ascending, got {kept.tolist()}")
            src = kept + self.length
            if not torch.equal(src, torch.arange(self.length, self.length + k, device=src.device)):
                for buf in (*self.keys, *self.values):
                    # index_select copies first, so overlapping source/destination is safe.
                    buf[:, :, self.length : self.length + k] = buf.index_select(2, src)
        self.length += k
        self.staged = 0

    def truncate(self, length: int) -> None:
        """Forget committed positions from ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate: length must be in [0, {self.length}], got {length}")
        self.length = length
        self.staged = 0


class KVView(abc.ABC):
    """A subset of the committed KV that a drafting forward attends over."""

    @abc.abstractmethod
    def layer_kv(self, store: KVStore, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, kv_heads, S, head_dim]`` of this view for one layer."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """S, the number of positions each KV head sees."""

    def join(self, store: KVStore, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        """The view's keys/values with the new tokens' ``keys``/``values`` appended
        ([1, kv_heads, S + n, head_dim]). Never writes into committed positions."""
        view_keys, view_values = self.layer_kv(store, layer_idx)
        return torch.cat([view_keys, keys], dim=2), torch.cat([view_values, values], dim=2)


@attrs.define(eq=False, repr=False)
class IndexView(KVView):
    """A view given by committed positions.

    indices: [S] (the same positions for every layer and head) or
    [num_layers, kv_heads, S] (chosen per layer and KV head).
    """

    indices: torch.Tensor

    def __repr__(self) -> str:
        return f"IndexView(indices={tuple(self.indices.shape)})"

    @property
    def size(self) -> int:
        return int(self.indices.shape[-1])

    def layer_kv(self, store: KVStore, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = store.keys[layer_idx], store.values[layer_idx]
        if self.indices.dim() == 1:
            return keys.index_select(2, self.indices), values.index_select(2, self.indices)
        index = self.indices[layer_idx][None, :, :, None].expand(1, -1, -1, store.head_dim)
        return keys.gather(2, index), values.gather(2, index)


class FullView(KVView):
    """Every committed position, read in place (no copy); nothing is written."""

    def __init__(self, store: KVStore) -> None:
        self._length = store.length

    def __repr__(self) -> str:
        return f"FullView(length={self._length})"

    @property
    def size(self) -> int:
        return self._length

    def layer_kv(self, store: KVStore, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return store.keys[layer_idx][:, :, : self._length], store.values[layer_idx][:, :, : self._length]

    def join(self, store: KVStore, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        # The new tokens go into staging (uncommitted, overwritten by the next full
        # forward): a slice is returned instead of a copy of the whole context.
        end = self._length + keys.shape[2]
        if end > store.capacity:
            return super().join(store, layer_idx, keys, values)
        store.keys[layer_idx][:, :, self._length : end] = keys
        store.values[layer_idx][:, :, self._length : end] = values
        return store.keys[layer_idx][:, :, :end], store.values[layer_idx][:, :, :end]


class CompactView(KVView):
    """A view with its own buffers ``[1, kv_heads, capacity, head_dim]`` per layer:
    filled once from chosen positions, then extended with newly committed positions.
    Forwards over it read the buffers in place (no gather per step)."""

    def __init__(self, store: KVStore, capacity: int, scratch: int = 8) -> None:
        shape = (1, store.kv_heads, capacity + scratch, store.head_dim)
        like = store.keys[0]
        self.keys = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(store.num_layers)]
        self.values = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(store.num_layers)]
        self.capacity = capacity
        self._size = 0

    def __repr__(self) -> str:
        return f"CompactView(size={self._size}, capacity={self.capacity})"

    @property
    def size(self) -> int:
        return self._size

    def load(self, store: KVStore, indices: torch.Tensor) -> None:
        """Replace the contents with committed positions ``indices`` ([S] or [layers, kv_heads, S])."""
        view = IndexView(indices.to(store.keys[0].device))
        if view.size > self.capacity:
            raise ValueError(f"{view.size} positions do not fit a view of capacity {self.capacity}")
        for layer in range(store.num_layers):
            keys, values = view.layer_kv(store, layer)
            self.keys[layer][:, :, : view.size] = keys
            self.values[layer][:, :, : view.size] = values
        self._size = view.size

    def append(self, store: KVStore, start: int, end: int) -> None:
        """Add committed positions ``[start, end)`` after the current contents."""
        count = end - start
        if self._size + count > self.capacity:
            raise ValueError(f"appending {count} positions overflows a view of capacity {self.capacity}")
        for layer in range(store.num_layers):
            self.keys[layer][:, :, self._size : self._size + count] = store.keys[layer][:, :, start:end]
            self.values[layer][:, :, self._size : self._size + count] = store.values[layer][:, :, start:end]
        self._size += count

    def layer_kv(self, store: KVStore, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx][:, :, : self._size], self.values[layer_idx][:, :, : self._size]

    def join(self, store: KVStore, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        end = self._size + keys.shape[2]
        if end > self.keys[layer_idx].shape[2]:
            return super().join(store, layer_idx, keys, values)
        self.keys[layer_idx][:, :, self._size : end] = keys  # scratch room after the contents
        self.values[layer_idx][:, :, self._size : end] = values
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]


@attrs.define(eq=False)
class ForwardPlan:
    """What the cache does with the new tokens of one forward."""

    view: KVView | None = None  # None: the full store, new tokens written into staging


class StoreLayer(CacheLayerMixin):
    """One layer of :class:`StoreCache`: serves keys/values from the runner's store."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: StoreCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self._layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102 - storage is preallocated
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states/value_states: [1, kv_heads, n, head_dim], keys already RoPE-rotated.
        store, plan = self._cache.store, self._cache.plan
        n = key_states.shape[2]
        if plan.view is None:
            start, end = store.length, store.length + n
            if end > store.capacity:
                raise RuntimeError(f"KV store overflow: {end} positions needed, capacity {store.capacity}")
            store.keys[self._layer_idx][:, :, start:end] = key_states
            store.values[self._layer_idx][:, :, start:end] = value_states
            return store.keys[self._layer_idx][:, :, :end], store.values[self._layer_idx][:, :, :end]
        return plan.view.join(store, self._layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.store.length

    def get_max_length(self) -> int:
        return self._cache.store.capacity


class StoreCache(Cache):
    """A transformers ``Cache`` whose layers read and write a :class:`KVStore`."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.plan = ForwardPlan()
        super().__init__(layers=[StoreLayer(self, i) for i in range(store.num_layers)])
