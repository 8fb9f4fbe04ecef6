"""The attention function the runner registers with transformers.

It runs SDPA with grouped KV heads folded into the query dimension (no copies of the
cache, no slow ``enable_gqa`` kernel), falling back to transformers' own SDPA path for
anything unusual. What else a forward asks for comes in the one ``tokenswift_plan``
keyword argument (a class:`~tokenswift.model.plan.ForwardPlan`): the view of
committed positions every new token sees, the tree mask among the new tokens, and an
optional :class:`~tokenswift.model.plan.AttentionRecorder`, which keeps the last query's attention
probabilities over every key, summed over the query heads of each KV group (the
dynamic cache policy ranks positions by them).

On a CPU, one or two new tokens go through tokenswift's own decode kernel
(:mod:`tokenswift.kernels`: the KV split across threads, one pass over it) where it
could be built. Otherwise one new token needs no mask; many (a prompt chunk over a long context) on a CPU go
through :func:`split_attention`: the committed prefix unmasked through the flash
kernel, the tree block masked, merged by log-sum-exp, so no [n, context] mask is
built. A small tree, or any forward on another device, uses one grouped additive mask
built once per forward and shared by every layer (:func:`splits_better` says why).
Either way each layer's KV is read once for all new tokens.

Registered under the name ``"tokenswift"`` in both ``AttentionInterface`` and
``AttentionMaskInterface`` (a custom attention name without a mask function silently
gets no mask on multi-token steps).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tokenswift import kernels
from tokenswift.model.plan import EXTERNAL_KV_KWARG, PLAN_KWARG, ForwardPlan
from tokenswift.model.kv import KVStore, Staging

ATTENTION_NAME = "tokenswift"


def _fold(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, q_heads, n, D] -> [1, kv_heads, group * n, D]: the query heads of a KV group
    are consecutive, so they fold into the query-length dimension (a view)."""
    _, q_heads, n, dim = query.shape
    return query.reshape(1, kv_heads, (q_heads // kv_heads) * n, dim)


def _unfold(out: torch.Tensor, q_heads: int, n: int) -> torch.Tensor:
    """[1, kv_heads, group * n, D] -> [1, n, q_heads, D] (what transformers expects)."""
    return out.reshape(1, q_heads, n, out.shape[-1]).transpose(1, 2).contiguous()


def grouped_attention(query, key, value, mask, scaling: float) -> torch.Tensor:
    """SDPA with grouped KV heads and no copies of the keys/values.

    query: [1, q_heads, n, D]; key/value: [1, kv_heads, K, D] (may be strided views of
    the store); mask: additive [1, 1, group * n, K] (already grouped), bool [1, 1, n, K],
    or None. The query heads of each KV group are folded into the query-length
    dimension, so every KV head is read once and SDPA runs without ``enable_gqa``
    (several times slower on CPU) and without ``repeat_kv`` copies. Returns [1, n, q_heads, D].
    """
    _, q_heads, n, _ = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    if mask is not None and mask.dtype == torch.bool and group > 1:
        mask = mask.expand(1, 1, n, mask.shape[-1]).repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(_fold(query, kv_heads), key, value, attn_mask=mask, scale=scaling)
    return _unfold(out, q_heads, n)


_prefix_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def split_attention(query, key, value, prefix: int, tree_bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of n new tokens over ``prefix`` committed keys that all of them see,
    plus the new tokens' own keys under a tree mask, without an [n, prefix + n] mask.

    query: [1, q_heads, n, D]; key/value: [1, kv_heads, prefix + n, D] (the new tokens'
    keys last); tree_bias: [group * n, n] additive (0 / -inf, the tree mask repeated
    for the query heads of a KV head). The prefix runs through the CPU flash kernel
    with no mask, giving its outputs and log-sum-exps; the tree block ([group * n, n]
    logits) is computed directly; the two are merged by their log-sum-exps in float32
    (float64 for float64 models). Every KV position is read once for all n tokens.
    Returns [1, n, q_heads, D].
    """
    _, q_heads, n, _ = query.shape
    kv_heads = key.shape[1]
    folded = _fold(query, kv_heads)  # [1, kv_heads, group * n, D]
    wide = torch.float64 if query.dtype == torch.float64 else torch.float32
    tree_keys, tree_values = key[:, :, prefix:].to(wide), value[:, :, prefix:].to(wide)  # [1, kv_heads, n, D]
    logits = folded.to(wide) @ tree_keys.transpose(-1, -2) * scaling + tree_bias  # [1, kv_heads, group * n, n]
    tree_lse = logits.logsumexp(dim=-1, keepdim=True)  # finite: every token sees itself
    tree_out = (logits - tree_lse).exp() @ tree_values  # [1, kv_heads, group * n, D]
    if prefix == 0:
        return _unfold(tree_out.to(query.dtype), q_heads, n)
    prefix_out, prefix_lse = _prefix_attention(
        folded, key[:, :, :prefix], value[:, :, :prefix], 0.0, False, scale=scaling
    )  # [1, kv_heads, group * n, D], [1, kv_heads, group * n]
    prefix_lse = prefix_lse.to(wide).unsqueeze(-1)
    total = torch.logaddexp(prefix_lse, tree_lse)
    out = prefix_out.to(wide) * (prefix_lse - total).exp() + tree_out * (tree_lse - total).exp()
    return _unfold(out.to(query.dtype), q_heads, n)


SPLIT_FROM_TOKENS = 32


def splits_better(new_tokens: int, prefix: int) -> bool:
    """Whether :func:`split_attention` beats one grouped mask per forward on a CPU.

    Measured on the 2-core AMD EPYC (bfloat16 demo model, same process, alternating):
    trees of 4-16 nodes run 2-5% faster with the dense mask at 2K and 16K context (the
    mask is small, the split's extra per-layer operations are not); a 512-token prompt
    chunk runs 9% faster split at 16K (its dense mask is 52 MB per forward), 7% slower at
    2K, where its own causal block is as big as the prefix; 64 tokens at 16K: 6% faster.
    """
    return new_tokens >= SPLIT_FROM_TOKENS and prefix >= 4 * new_tokens


def _record(plan: ForwardPlan, layer: int, query, key, scaling: float) -> None:
    """Give the plan's recorder (if any) the last query's probabilities over ``key``."""
    if plan.recorder is not None:
        allowed = None if plan.dense else plan.full_mask()[0, 0, -1]
        plan.recorder.record(layer, query, key, allowed, scaling)


def plan_attention(layer: int, query, key, value, plan: ForwardPlan, scaling: float) -> torch.Tensor:
    """Attention of a runner forward as its ``plan`` says (batch 1, no dropout, no
    softcap): query [1, q_heads, n, D]; key/value [1, kv_heads, S + n, D], the view's
    positions then the new tokens'. Records the last query's probabilities if the plan
    has a recorder. Returns [1, n, q_heads, D]."""
    _record(plan, layer, query, key, scaling)
    if key.dtype != query.dtype:  # a prefill computed in another dtype than the stored KV's
        key, value = key.to(query.dtype), value.to(query.dtype)
    if kernels.serves(query, key, value):
        return kernels.decode_attention(query, key, value, plan.prefix, None if plan.dense else plan.tree_mask, scaling)
    if plan.dense:
        return grouped_attention(query, key, value, None, scaling)
    group = query.shape[1] // key.shape[1]
    if query.device.type == "cpu" and splits_better(plan.new_tokens, plan.prefix):
        bias = plan.tree_bias(group, torch.float64 if query.dtype == torch.float64 else torch.float32)
        return split_attention(query, key, value, plan.prefix, bias, scaling)
    return grouped_attention(query, key, value, plan.grouped_mask(group, query.dtype), scaling)


# -- compiled forwards ----------------------------------------------------------------
#
# A compiled forward (tokenswift.model.compiled) traces the model with no cache: each
# layer hands its new tokens' keys/values to the attention function, which calls
# ``tokenswift::attend``, an operator opaque to the compiler. It writes them where the
# active plan's view says and attends as above, in eager code: so every view, cache
# policy and the attention recorder work unchanged, and the compiled graph (norms,
# rotary embedding, projections, MLP) depends on nothing but the number of new tokens.

_ACTIVE: list[tuple[ForwardPlan, KVStore, "_StagedKernel | None"]] = []
# While a compiled run of layers runs (tokenswift.model.compiled.LayeredForward): the
# index of the layer the next ``tokenswift::attend`` call is for.
_NEXT_LAYER: list[int] = []


class _StagedKernel:
    """A verify forward's attention, layer by layer, with what is the same for every layer
    settled once per forward: whether the decode kernel serves it, and the kernel's chunk
    size. Each layer then writes its new keys and values into the store's staging (as
    :meth:`~tokenswift.model.kv.Staging.join` does) and attends, in one call of
    :func:`~tokenswift.kernels.staged_attention`: what :func:`plan_attention` would do,
    without its per-layer checks. It exists because a compiled step leaves the graph for
    ``tokenswift::attend`` at every layer: those checks and wrappers took 0.2-0.35 ms of a
    9-18 ms SmolLM2 one-token forward, 0-0.5 of a tree of 4 (512-4K positions, two runs in
    turns; a 2-core AMD EPYC Zen 4, docs/compiled.md); the join and the kernel's wrapper,
    ten operator calls a layer from Python, another 1.3-2.0 ms of a 24-31 ms forward on a
    2-core Sapphire Rapids (`benchmarks/results/amx-s27/staged_attention_turns.py`)."""

    __slots__ = ("plan", "store", "mask", "chunk", "dtype", "prefix")

    def __init__(self, plan: ForwardPlan, store: KVStore) -> None:
        self.plan, self.store = plan, store
        self.mask = None if plan.dense else plan.tree_mask
        end = plan.prefix + plan.new_tokens
        self.chunk = kernels.chunk_size(end if self.mask is None else plan.prefix, store.kv_heads)
        self.dtype = store.keys[0].dtype
        self.prefix = plan.prefix  # the view's committed positions: the new tokens are written after them

    @classmethod
    def serving(cls, plan: ForwardPlan, store: KVStore) -> "_StagedKernel | None":
        """The fast path for ``plan`` over ``store``, or None where the general path
        must run (another view, a recorder, a store without staging room, a dtype or
        size the kernel does not serve, or no kernel)."""
        if not (FAST_STAGED and isinstance(plan.view, Staging) and plan.recorder is None):
            return None
        keys = store.keys[0]
        n = plan.new_tokens
        if (
            keys.device.type != "cpu" or keys.dtype not in (torch.float32, torch.float64, torch.bfloat16)
            or n > kernels.max_tokens(keys.dtype) or plan.prefix + n > store.capacity or not kernels.available()
        ):
            return None
        return cls(plan, store)

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        if query.dtype != self.dtype:  # a prefill computed in another dtype than the stored KV's
            return None
        return kernels.staged_attention(
            query, key, value, self.store.keys[layer], self.store.values[layer], self.prefix, self.mask, scaling,
            self.chunk,
        )


# The fast path of tokenswift::attend (_StagedKernel); off, every layer takes the
# general path (the tests compare the two).
FAST_STAGED = True


@contextlib.contextmanager
def attending(plan: ForwardPlan, store: KVStore):
    """Make ``plan`` over ``store`` the one ``tokenswift::attend`` serves."""
    _ACTIVE.append((plan, store, _StagedKernel.serving(plan, store)))
    try:
        yield
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def layers_from(first: int):
    """The ``tokenswift::attend`` calls inside are for layers ``first``, ``first + 1``,
    ... in the order they come, whatever layer index their graph was traced with (one
    graph serves every run of alike layers)."""
    _NEXT_LAYER.append(first)
    try:
        yield
    finally:
        _NEXT_LAYER.pop()


@torch.library.custom_op("tokenswift::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float) -> torch.Tensor:
    """The new tokens' keys/values joined to the active plan's view (written into the
    KV store or the view's buffers) and attended over. query: [1, q_heads, n, D];
    key/value: [1, kv_heads, n, D] (RoPE applied). Returns [1, n, q_heads, D]."""
    if not _ACTIVE:
        raise RuntimeError("tokenswift::attend runs only inside a runner forward (no active plan)")
    plan, store, fast = _ACTIVE[-1]
    if _NEXT_LAYER:
        layer = _NEXT_LAYER[-1]
        _NEXT_LAYER[-1] += 1
    if fast is not None:
        out = fast(layer, query, key, value, scaling)
        if out is not None:
            return out
    keys, values = plan.view.join(store, layer, key, value)
    return plan_attention(layer, query, keys, values, plan, scaling)


@attend.register_fake
def _attend_shape(query, key, value, layer, scaling):
    _, q_heads, n, dim = query.shape
    return query.new_empty(1, n, q_heads, dim)


def tokenswift_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function registered as ``"tokenswift"`` (see the module docstring)."""
    plan = kwargs.pop(PLAN_KWARG, None)
    external = kwargs.pop(EXTERNAL_KV_KWARG, False)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    unsupported = dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    if external:
        if unsupported or query.shape[0] != 1:
            raise NotImplementedError("compiled forwards support batch 1 without dropout, softcap or attention sinks")
        return torch.ops.tokenswift.attend(query, key, value, module.layer_idx, float(scaling)), None
    if plan is not None:
        if unsupported or query.shape[0] != 1:
            _record(plan, module.layer_idx, query, key, scaling)
            mask = None if plan.dense else plan.full_mask()
            return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
        return plan_attention(module.layer_idx, query, key, value, plan, scaling), None
    # No mask on a multi-token step means "causal" to transformers (its own forwards
    # outside the runner): leave that, and any other unusual case, to its SDPA path.
    implicit_causal = attention_mask is None and query.shape[2] > 1
    if implicit_causal or unsupported or query.shape[0] != 1 or (attention_mask is not None and attention_mask.dtype != torch.bool):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return grouped_attention(query, key, value, attention_mask, scaling), None


_registered = False


def register_attention() -> str:
    """Register the attention and mask functions (idempotent); return their name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, tokenswift_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME
