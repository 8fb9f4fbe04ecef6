"""The attention function the runner registers with transformers.

It runs SDPA with grouped KV heads folded into the query dimension (no copies of the
cache, no slow ``enable_gqa`` kernel), falling back to transformers' own SDPA path for
anything unusual. What else a forward asks for comes in the one ``tokenswift_plan``
keyword argument (a :class:`~tokenswift.model.hf_cache.ForwardPlan`): ``dense`` (one
query: no mask needed) and an optional :class:`AttentionRecorder`, which keeps the
last query's attention probabilities over every key, summed over the query heads of
each KV group (the dynamic cache policy ranks positions by them).

Registered under the name ``"tokenswift"`` in both ``AttentionInterface`` and
``AttentionMaskInterface`` (a custom attention name without a mask function silently
gets no mask on multi-token steps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tokenswift.model.hf_cache import PLAN_KWARG

ATTENTION_NAME = "tokenswift"


class AttentionRecorder:
    """Collects, per layer, the last query's attention probabilities per KV head.

    After a forward, ``probabilities[layer]`` is a float32 tensor ``[kv_heads, K]``, K
    the number of keys that query attended over (view or full store, plus new tokens).
    """

    def __init__(self) -> None:
        self.probabilities: dict[int, torch.Tensor] = {}

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, mask, scaling: float) -> None:
        # query: [1, q_heads, n, D]; key: [1, kv_heads, K, D]; mask: [1, 1, n, K] bool or None
        q_heads, kv_heads = query.shape[1], key.shape[1]
        last_query = query[0, :, -1:, :].float()  # [q_heads, 1, D]
        keys = key[0].float().repeat_interleave(q_heads // kv_heads, dim=0)  # [q_heads, K, D]
        logits = (last_query @ keys.transpose(1, 2)).squeeze(1) * scaling  # [q_heads, K]
        if mask is not None:
            logits = logits.masked_fill(~mask[0, 0, -1].bool(), float("-inf"))
        probs = logits.softmax(dim=-1)
        self.probabilities[layer] = probs.view(kv_heads, q_heads // kv_heads, -1).sum(dim=1)


def grouped_attention(query, key, value, mask, scaling: float, plan=None) -> torch.Tensor:
    """SDPA with grouped KV heads and no copies of the keys/values.

    query: [1, q_heads, n, D]; key/value: [1, kv_heads, K, D] (may be strided views of
    the store); mask: [1, 1, n, K] bool or None. The query heads of each KV group are
    folded into the query-length dimension ([1, kv_heads, group * n, D]), so every KV
    head is read once and SDPA runs without ``enable_gqa`` (which is several times
    slower on CPU) and without ``repeat_kv`` copies. With a ``plan``, the repeated mask
    is built once per forward (:meth:`ForwardPlan.grouped_mask`). Returns [1, n, q_heads, D].
    """
    _, q_heads, n, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    packed = query.reshape(1, kv_heads, group * n, dim)  # heads of a group are consecutive
    if mask is not None and plan is not None:
        mask = plan.grouped_mask(mask, group, query.dtype)
    elif mask is not None and group > 1:
        mask = mask.expand(1, 1, n, mask.shape[-1]).repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(1, q_heads, n, dim).transpose(1, 2).contiguous()


def tokenswift_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function registered as ``"tokenswift"`` (see the module docstring)."""
    plan = kwargs.pop(PLAN_KWARG, None)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if plan is not None:
        if plan.recorder is not None:
            plan.recorder.record(module.layer_idx, query, key, attention_mask, scaling)
        if plan.dense:
            attention_mask = None  # every query sees every key
    unsupported = dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    # No mask on a multi-token step means "causal" to transformers (its own forwards
    # outside the runner): leave that, and any other unusual case, to its SDPA path.
    implicit_causal = attention_mask is None and query.shape[2] > 1
    if implicit_causal or unsupported or query.shape[0] != 1 or (attention_mask is not None and attention_mask.dtype != torch.bool):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return grouped_attention(query, key, value, attention_mask, scaling, plan), None


_registered = False


def register_attention() -> str:
    """Register the attention and mask functions (idempotent); return their name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, tokenswift_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME
