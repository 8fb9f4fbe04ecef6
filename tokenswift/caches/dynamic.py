"""The ``dynamic`` cache policy (TokenSwift): sinks, important positions, recent window.

At each refresh the root token is forwarded over the full KV once with attention
recording; per layer and KV head, the attention probabilities of that query (summed
over the query heads of the KV group) rank the positions after the sinks, and the top
ones are kept. Each KV head thus keeps its own positions.
"""

from __future__ import annotations

import torch

from tokenswift.caches.refreshing import RefreshingPolicy
from tokenswift.model.kv import FullView


def position_importance(runner, root_token: int) -> torch.Tensor:
    """[layers, kv_heads, L]: attention of ``root_token`` (at position L) over the
    committed positions, summed over each KV group's query heads."""
    store = runner.store
    out = runner.forward(torch.tensor([root_token]), view=FullView(store), logits_rows=None, record_attention=True)
    return torch.stack([out.attention[layer][:, : store.length] for layer in range(store.num_layers)])


class DynamicPolicy(RefreshingPolicy):
    """Sinks + the most attended positions per layer and KV head + a recent window."""

    def select(self, state, length):
        sink = self.sink_positions(length)
        keep = self.selection_size - sink.numel()
        importance = position_importance(self.context.runner, state.tokens[-1])[:, :, sink.numel() :]  # [layers, heads, L - sink]
        top = importance.topk(keep, dim=-1).indices.sort(dim=-1).values + sink.numel()
        layers, heads, _ = top.shape
        sink = sink.to(top.device)
        return torch.cat([sink.view(1, 1, -1).expand(layers, heads, -1), top], dim=-1)
