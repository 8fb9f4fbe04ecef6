"""Drawing tokens: argmax, or an inverse-CDF draw with one uniform number per token.

Drawing by inverse CDF with exactly one uniform number per emitted token means a
speculative run consumes the random stream exactly like autoregressive decoding:
with the same seed, every emitted token is the same draw from the same distribution,
so (in float64) the outputs are identical, not just equal in law.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tokenswift.spec import SamplingSpec


def build_warpers(spec: SamplingSpec, device=None) -> LogitsProcessorList:
    """The warpers of ``spec`` in the order transformers' ``generate`` applies them."""
    warpers = LogitsProcessorList()
    if spec.greedy:
        return warpers
    if spec.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(spec.temperature))
    if spec.top_k is not None:
        warpers.append(TopKLogitsWarper(top_k=spec.top_k))
    if spec.top_p is not None and spec.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=spec.top_p))
    if spec.min_p is not None and spec.min_p > 0:
        warpers.append(MinPLogitsWarper(min_p=spec.min_p))
    if spec.eta is not None:
        warpers.append(EtaLogitsWarper(epsilon=spec.eta, device=device or "cpu"))
    return warpers


class Sampler:
    """Turns processed scores into tokens: argmax when greedy, else an inverse-CDF draw
    from ``softmax(scores)`` with one uniform from ``generator`` (always a CPU
    generator, so the random stream is the same on every device)."""

    def __init__(self, greedy: bool, generator: torch.Generator) -> None:
        self.greedy = greedy
        self.generator = generator

    def draw(self, scores: torch.Tensor) -> int:
        """scores: [vocab] processed scores of one position -> one token id."""
        if self.greedy:
            return int(scores.argmax())
        probs = torch.softmax(scores.to(torch.float64), dim=-1)
        cdf = probs.cumsum(-1)
        u = torch.rand((), generator=self.generator, dtype=torch.float64).to(cdf.device) * cdf[-1]
        token = int(torch.searchsorted(cdf, u.view(1), right=True))
        token = min(token, scores.numel() - 1)
        while probs[token] == 0:  # never return a filtered token at a CDF plateau edge
            token -= 1
        return token
