"""The ``dynamic`` cache policy (TokenSwift): sinks, important positions, recent window.

At each refresh the root token is forwarded over the full KV once with attention
recording; per layer and KV head, the attention probabilities of that query (summed
over the query heads of the KV group) rank the positions after the sinks, and the top
ones are kept. Each KV head thus keeps its own positions.
"""

from __future__ import annotations

import torch

from tokenswift.caches.refreshing import RefreshingCache
from tokenswift.model.attention import ScoreRecorder
from tokenswift.model.kv import FullView


def importance_scores(runner, root_token: int) -> torch.Tensor:
    """[layers, kv_heads, L]: attention of ``root_token`` (at position L) over the
    committed positions, summed over each KV group's query heads."""
    store = runner.store
    recorder = ScoreRecorder()
    runner.forward(torch.tensor([root_token]), view=FullView(store), logits_rows=None, recorder=recorder)
    return torch.stack([recorder.scores[layer][:, : store.length] for layer in range(store.num_layers)])


class DynamicCache(RefreshingCache):
    """Sinks + the most attended positions per layer and KV head + a recent window."""

    def select(self, state, length):
        sink = self.sink_positions(length)
        keep = self.selection_size - sink.numel()
        scores = importance_scores(state.runner, state.tokens[-1])[:, :, sink.numel() :]  # [layers, heads, L - sink]
        top = scores.topk(keep, dim=-1).indices.sort(dim=-1).values + sink.numel()
        layers, heads, _ = top.shape
        sink = sink.to(top.device)
        return torch.cat([sink.view(1, 1, -1).expand(layers, heads, -1), top], dim=-1)
