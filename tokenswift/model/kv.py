"""Preallocated KV storage and the views forwards attend over. Every write of keys and
values happens in this module.

The runner owns one :class:`KVStore` per generation: per layer, a key and a value
buffer of shape ``[1, kv_heads, capacity, head_dim]`` allocated once. Positions
``[0, length)`` hold the committed context; positions ``[length, length + n)`` are the
staging area that a verify forward writes its new tokens into, until
:meth:`KVStore.commit` keeps a chosen subset of them.

A forward attends over a :class:`KVView` of the committed positions with its own new
tokens appended; the view decides where those new tokens' keys and values go:

* :class:`Staging` — every committed position; new tokens are *staged* (a verify forward);
* :class:`FullView` — every committed position; new tokens go to the staging area as
  scratch, nothing is staged (a drafting forward over the whole context);
* :class:`IndexView` — chosen positions, gathered; new tokens appended to a copy;
* :class:`CompactView` — chosen positions kept in the view's own buffers, with scratch
  room for the new tokens (the dynamic and streaming cache policies).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import attrs
import torch

from tokenswift import kernels

# Kept positions compacted by the native kernel where it is built (tests compare the two paths).
NATIVE_COMMIT = True


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
        self.staged = 0  # tokens a verify forward wrote after `length`, not yet committed
        self.noise_to = 0  # positions [0, noise_to) hold occupy's noise or what was written over it

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

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Write ``keys``/``values`` ([1, kv_heads, n, head_dim]) at positions
        ``[start, start + n)`` of one layer; returns ``start + n``."""
        end = start + keys.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV store overflow: {end} positions needed, capacity {self.capacity}")
        self.keys[layer][:, :, start:end] = keys
        self.values[layer][:, :, start:end] = values
        return end

    def prefix(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[0, end)`` of one layer, read in place (no copy)."""
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def commit(self, kept: torch.Tensor | Sequence[int]) -> None:
        """Keep staged positions ``kept`` (indices into staging, ascending) as committed.

        kept: [k] long (or a list of ints), each in ``[0, staged)``; they are compacted
        in place to ``[length, length + k)`` and the rest of staging is dropped. Checked
        and compared as Python ints: a step keeps a handful, and tensor reductions over
        them cost more than the copies (~0.2 ms a step on a 2-core AMD EPYC Zen 4).
        """
        kept = [int(i) for i in (kept.tolist() if isinstance(kept, torch.Tensor) else kept)]
        k = len(kept)
        if k:
            if max(kept) >= self.staged or min(kept) < 0:
                raise ValueError(
                    f"commit: kept positions {kept} must lie in [0, {self.staged}), "
                    "the tokens staged by the latest verify forward"
                )
            if any(b <= a for a, b in zip(kept, kept[1:])):
                raise ValueError(f"commit: kept positions must be strictly ascending, got {kept}")
            if kept != list(range(k)):  # the kept tokens are not already where they belong
                if NATIVE_COMMIT and self.keys[0].device.type == "cpu" and kernels.available():
                    # every buffer in one call: an index_select and a copy per buffer took
                    # ~0.5 ms a step for SmolLM2's 60 (a 2-core Sapphire Rapids)
                    torch.ops.tokenswift_cpu.compact_positions([*self.keys, *self.values], kept, self.length)
                else:
                    src = torch.tensor(kept, dtype=torch.long, device=self.keys[0].device) + self.length
                    for buf in (*self.keys, *self.values):
                        # index_select copies first, so overlapping source/destination is safe.
                        buf[:, :, self.length : self.length + k] = buf.index_select(2, src)
        self.length += k
        self.staged = 0

    def load(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Hold exactly the given positions, committed: per layer ``keys[layer]`` and
        ``values[layer]`` [1, kv_heads, P, head_dim] (a prefilled prompt's copy)."""
        length = keys[0].shape[2]
        if length >= self.capacity:
            raise ValueError(f"load: {length} positions do not fit a store of {self.capacity}")
        self.reset()
        for layer in range(self.num_layers):
            self.write(layer, 0, keys[layer], values[layer])
        self.length = length

    def occupy(self, length: int) -> None:
        """Treat positions ``[0, length)`` as committed (for timing forwards at a context
        length without computing one). Positions no earlier ``occupy`` reached are first
        filled with noise (a private generator, seed 0): a fresh store's memory is the
        operating system's zero page until written, so forwards timed over it read no KV
        from memory. Over such a store, on a 2-core AMD EPYC Zen 3 at 2K positions, a
        compiled 2-token tree timed at 0.95x a one-token step with its LM-head row, and
        over written KV at 1.16x (as in runs): the tree choice priced a drafted node at
        less than half its cost."""
        if not 0 <= length < self.capacity:
            raise ValueError(f"occupy: length must be in [0, {self.capacity}), got {length}")
        if length > self.noise_to:
            generator = torch.Generator(device=self.keys[0].device).manual_seed(0)
            with torch.inference_mode():  # the store may have been made in inference mode
                for tensor in (*self.keys, *self.values):
                    tensor[:, :, self.noise_to : length].normal_(generator=generator)
            self.noise_to = length
        self.length = length
        self.staged = 0

    def truncate(self, length: int) -> None:
        """Forget committed positions from ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate: length must be in [0, {self.length}], got {length}")
        self.length = length
        self.staged = 0


class KVView(abc.ABC):
    """The committed positions a forward attends over, and where its new tokens go."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """S, the number of committed positions each KV head sees."""

    @abc.abstractmethod
    def join(self, store: KVStore, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """The view's keys/values with the new tokens' ``keys``/``values``
        ([1, kv_heads, n, head_dim]) appended: [1, kv_heads, S + n, head_dim].
        Never writes into committed positions."""

    def finish(self, store: KVStore, new_tokens: int) -> None:
        """Called once after the forward (all layers joined)."""


class Staging(KVView):
    """Every committed position; the new tokens are staged for :meth:`KVStore.commit`
    (a verify forward)."""

    def __init__(self, store: KVStore) -> None:
        self._length = store.length

    def __repr__(self) -> str:
        return f"Staging(length={self._length})"

    @property
    def size(self) -> int:
        return self._length

    def join(self, store, layer, keys, values):
        end = store.write(layer, self._length, keys, values)
        return store.prefix(layer, end)

    def finish(self, store, new_tokens):
        store.staged = new_tokens


class FullView(KVView):
    """Every committed position, read in place; the new tokens use the staging area as
    scratch (overwritten by the next forward) and nothing is staged (a drafting forward)."""

    def __init__(self, store: KVStore) -> None:
        self._length = store.length

    def __repr__(self) -> str:
        return f"FullView(length={self._length})"

    @property
    def size(self) -> int:
        return self._length

    def join(self, store, layer, keys, values):
        if self._length + keys.shape[2] > store.capacity:  # no scratch room left: copy
            old_keys, old_values = store.prefix(layer, self._length)
            return torch.cat([old_keys, keys], dim=2), torch.cat([old_values, values], dim=2)
        end = store.write(layer, self._length, keys, values)
        return store.prefix(layer, end)


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

    def gather(self, store: KVStore, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The viewed keys and values of one layer: [1, kv_heads, S, head_dim] each (copies)."""
        shape = (1, store.kv_heads, self.size, store.head_dim)
        like = store.keys[layer]
        keys = torch.empty(shape, dtype=like.dtype, device=like.device)
        values = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.gather_into(store, layer, keys, values)
        return keys, values

    def gather_into(self, store: KVStore, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the viewed keys and values of one layer into ``keys``, ``values``
        ([1, kv_heads, >= S, head_dim]; their first S positions).

        Row copies per KV head (``index_select`` of whole 64-value rows), not
        ``Tensor.gather`` with an index expanded over the head dimension, which
        indexes every element: a 4,096-position view of 30 layers took 53-68 ms to
        gather that way, 6 ms this way (a 2-core AMD EPYC Zen 4)."""
        size = self.size
        for h in range(store.kv_heads):
            index = self.indices if self.indices.dim() == 1 else self.indices[layer, h]
            torch.index_select(store.keys[layer][0, h], 0, index, out=keys[0, h, :size])
            torch.index_select(store.values[layer][0, h], 0, index, out=values[0, h, :size])

    def join(self, store, layer, keys, values):
        view_keys, view_values = self.gather(store, layer)
        return torch.cat([view_keys, keys], dim=2), torch.cat([view_values, values], dim=2)


class CompactView(KVView):
    """A view with its own buffers ``[1, kv_heads, capacity + scratch, head_dim]`` per
    layer: filled from chosen positions, then extended with newly committed positions.
    Forwards over it read the buffers in place; their new tokens use the ``scratch``
    room after the contents."""

    def __init__(self, store: KVStore, capacity: int, scratch: int = 1) -> None:
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
            view.gather_into(store, layer, self.keys[layer], self.values[layer])
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

    def contents(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The view's keys and values of one layer, read in place: [1, kv_heads, S, head_dim]."""
        return self.keys[layer][:, :, : self._size], self.values[layer][:, :, : self._size]

    def join(self, store, layer, keys, values):
        end = self._size + keys.shape[2]
        if end > self.keys[layer].shape[2]:  # more new tokens than scratch room: copy
            old_keys, old_values = self.contents(layer)
            return torch.cat([old_keys, keys], dim=2), torch.cat([old_values, values], dim=2)
        self.keys[layer][:, :, self._size : end] = keys
        self.values[layer][:, :, self._size : end] = values
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
