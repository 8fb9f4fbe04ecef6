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
    """One runner forward of n new tokens: the ``view`` of S committed positions they
    all see, the ``tree_mask`` among themselves ([n, n] bool, row i = the new tokens
    token i sees, itself included), and an optional recorder of the last query's
    attention probabilities.

    Attention never needs an [n, S + n] mask: every new token sees all S viewed
    positions, so the attention function splits each layer's attention into that
    unmasked prefix and the tiny masked tree block (see
    :func:`tokenswift.model.attention.split_attention`). :meth:`full_mask` builds the
    dense mask for the paths that still want one.
    """

    view: KVView
    tree_mask: torch.Tensor
    recorder: AttentionRecorder | None = None
    _tree_bias: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    _grouped_mask: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)

    @property
    def new_tokens(self) -> int:
        return int(self.tree_mask.shape[0])

    @property
    def prefix(self) -> int:
        """S: the committed positions every new token sees (keys ``[0, S)`` of a layer)."""
        return self.view.size

    @property
    def dense(self) -> bool:
        """One new token: it sees every key, no mask at all."""
        return self.new_tokens == 1

    def full_mask(self) -> torch.Tensor:
        """[1, 1, n, S + n] bool: the prefix for all, then the tree mask."""
        n = self.new_tokens
        visible = torch.ones(n, self.prefix, dtype=torch.bool, device=self.tree_mask.device)
        return torch.cat([visible, self.tree_mask], dim=1).view(1, 1, n, self.prefix + n)

    def tree_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The tree mask repeated for the ``group`` query heads of a KV head, additive
        (0 / -inf): [group * n, n], built once per forward."""
        if self._tree_bias is None or self._tree_bias.dtype != dtype:
            allowed = self.tree_mask.repeat(group, 1)
            self._tree_bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return self._tree_bias

    def grouped_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`full_mask` repeated for the ``group`` query heads of a KV head and made
        additive ([1, 1, group * n, S + n], 0 / -inf), once per forward (the dense path)."""
        if self._grouped_mask is None or self._grouped_mask.dtype != dtype:
            allowed = self.full_mask().repeat(1, 1, group, 1)
            self._grouped_mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
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
