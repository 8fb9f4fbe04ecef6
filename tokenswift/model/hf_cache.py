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
# A compiled forward passes this (True) instead of a plan: the attention function then
# joins the keys/values itself (see tokenswift.model.attention.attend).
EXTERNAL_KV_KWARG = "tokenswift_external_kv"


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
    _full_mask: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    _additive_masks: dict[str, torch.Tensor] = attrs.field(factory=dict, init=False, repr=False)

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
        """[1, 1, n, S + n] bool: the prefix for all, then the tree mask (built once)."""
        if self._full_mask is None:
            n = self.new_tokens
            visible = torch.ones(n, self.prefix, dtype=torch.bool, device=self.tree_mask.device)
            self._full_mask = torch.cat([visible, self.tree_mask], dim=1).view(1, 1, n, self.prefix + n)
        return self._full_mask

    def tree_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The tree mask repeated for the ``group`` query heads of a KV head, additive
        (0 / -inf): [group * n, n], built once per forward."""
        return self._additive("tree", self.tree_mask, group, dtype)

    def grouped_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`full_mask` repeated likewise: [1, 1, group * n, S + n], once per
        forward (the dense path)."""
        return self._additive("full", self.full_mask(), group, dtype)

    def _additive(self, key: str, allowed: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
        """``allowed`` ([..., n, K] bool) repeated ``group`` times along its rows and made
        additive (0 / -inf) in ``dtype``; cached per forward under ``key``."""
        cached = self._additive_masks.get(key)
        if cached is None or cached.dtype != dtype:
            repeated = allowed.repeat(*([1] * (allowed.dim() - 2)), group, 1)
            cached = torch.zeros(repeated.shape, dtype=dtype, device=repeated.device).masked_fill_(~repeated, float("-inf"))
            self._additive_masks[key] = cached
        return cached


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
