"""The model layer's central contract: what one runner forward does.

A :class:`ForwardPlan` travels with every forward of the runner
(:mod:`tokenswift.model.runner`): the transformers ``Cache`` adapter
(:mod:`tokenswift.model.hf_cache`) hands the new keys/values to its view, and the
registered attention function (:mod:`tokenswift.model.attention`) reads its view size,
tree mask and recorder from the ``tokenswift_plan`` keyword argument.
"""

from __future__ import annotations

import attrs
import torch

from tokenswift.model.kv import KVView

PLAN_KWARG = "tokenswift_plan"
# A compiled forward passes this (True) instead of a plan: the attention function then
# joins the keys/values itself (see tokenswift.model.attention.attend).
EXTERNAL_KV_KWARG = "tokenswift_external_kv"
RECORD_BLOCK = 4096  # keys converted to float32 at a time by AttentionRecorder


class AttentionRecorder:
    """Collects, per layer, the last query's attention probabilities per KV head.

    After a forward, ``probabilities[layer]`` is a float32 tensor ``[kv_heads, K]``, K
    the number of keys that query attended over (view or full store, plus new tokens).
    """

    def __init__(self) -> None:
        self.probabilities: dict[int, torch.Tensor] = {}

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, allowed: torch.Tensor | None, scaling: float) -> None:
        # query: [1, q_heads, n, D]; key: [1, kv_heads, K, D]; allowed: [K] bool (the last query's row) or None
        q_heads, kv_heads = query.shape[1], key.shape[1]
        group = q_heads // kv_heads
        last_query = query[0, :, -1, :].float().view(kv_heads, group, -1)  # [kv_heads, group, D]
        length = key.shape[2]
        logits = torch.empty(kv_heads, group, length, dtype=torch.float32, device=key.device)
        # A KV head's query heads against its keys, float32 a block of keys at a time: no
        # copy of the whole KV per query head (at 32K positions that copy took 2.4 s of a
        # refresh of the dynamic cache, on a 2-core Sapphire Rapids; now 0.22 s).
        for start in range(0, length, RECORD_BLOCK):
            block = key[0, :, start : start + RECORD_BLOCK].float()  # [kv_heads, b, D]
            logits[:, :, start : start + block.shape[1]] = last_query @ block.transpose(1, 2)
        logits.mul_(scaling)
        if allowed is not None:
            logits.masked_fill_(~allowed, float("-inf"))
        self.probabilities[layer] = logits.softmax(dim=-1).sum(dim=1)  # [kv_heads, K]


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
