"""Drawing tokens: argmax, or a Gumbel-max draw keyed by (seed, position).

The coupled sampler (the default) draws the token at absolute position t as
``argmax(scores + G_t)``, G_t noise fixed by (seed, t) alone. A speculative run and
autoregressive decoding with the same seed thus draw every emitted token from the same
scores with the same noise: in float32/float64 the outputs are identical, not just equal
in law. Drafters may see G_t (the draw is still exact: the noise is independent of the
scores, whatever a drafter did with it, since a draft only decides what is verified).
The inverse-CDF sampler (one uniform per emitted token, in order) is what checkpoints
written before the coupled one resume with.
"""

from __future__ import annotations

import abc

import numpy as np
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


SAMPLERS = ("coupled", "inverse-cdf")


class Sampler(abc.ABC):
    """Turns the processed scores of one position into its token.

    ``position`` is the token's absolute index in the text (prompt included): the
    coupled sampler's draw at a position depends on nothing but the scores and
    (seed, position), so any run that reaches the same prefix draws the same token
    there, however it got there."""

    greedy: bool = False

    @abc.abstractmethod
    def draw(self, scores: torch.Tensor, position: int) -> int:
        """scores: [vocab] processed scores of one position -> one token id."""

    def noise(self, position: int, size: int) -> torch.Tensor | None:
        """The Gumbel noise [size] float64 the draw at ``position`` adds to the scores
        (None: this sampler's draws are not Gumbel-max draws)."""
        return None

    # -- randomness beyond the draw (the rejection verifier, drafts sampled from q) ------
    #
    # Keyed by (position, stream) where a sampler keys its randomness: a stream is a use
    # (STREAM_ACCEPT + i: the test of a node's i-th child; STREAM_RESIDUAL: a bonus from
    # the residual; STREAM_DRAFTS: a node's children drawn from q), so no two uses of
    # one position share a number.

    def uniform(self, position: int, stream: int) -> float:
        """A uniform number in [0, 1) for ``stream`` at ``position``."""
        raise NotImplementedError(f"{type(self).__name__} draws no extra random numbers")

    def gumbel(self, position: int, size: int, stream: int) -> torch.Tensor:
        """Standard Gumbel noise [size] float64 for ``stream`` at ``position``."""
        raise NotImplementedError(f"{type(self).__name__} draws no extra random numbers")

    def accept(self, probability: float, position: int, stream: int) -> bool:
        """True with ``probability``."""
        return self.uniform(position, stream) < probability

    def choose(self, probs: torch.Tensor, position: int, stream: int) -> int:
        """One token drawn from ``probs`` ([vocab], summing to 1)."""
        return self.without_replacement(probs, 1, position, stream)[0]

    def without_replacement(self, probs: torch.Tensor, k: int, position: int, stream: int) -> list[int]:
        """``k`` distinct tokens drawn from ``probs`` one after another without
        replacement, in the order drawn (Gumbel-top-k: the k largest of log probs + G);
        fewer where fewer have any probability."""
        k = min(k, int((probs > 0).sum()))
        keys = probs.to(torch.float64).log() + self.gumbel(position, probs.numel(), stream).to(probs.device)
        return keys.topk(k).indices.tolist()


class ArgmaxSampler(Sampler):
    """Greedy decoding."""

    greedy = True

    def draw(self, scores: torch.Tensor, position: int) -> int:
        return int(scores.argmax())


STREAM_ACCEPT = 1
STREAM_DRAFTS = 1 << 20
STREAM_RESIDUAL = 1 << 21


def _mix(*words: int) -> int:
    """One 64-bit word from several (splitmix64 over their sequence)."""
    state = 0
    for word in words:
        state = (state ^ (int(word) & (2**64 - 1))) * 0xBF58476D1CE4E5B9 & (2**64 - 1)
        state ^= state >> 31
        state = (state + 0x9E3779B97F4A7C15) & (2**64 - 1)
    return state


class CoupledSampler(Sampler):
    """Gumbel-max: the token at ``position`` is ``argmax(scores + G)``, G a vector of
    standard Gumbel noise (``-log E``, E exponential) from a counter-based generator
    (Philox) keyed by (seed, position), the same on every device and rank. That is an
    exact draw from ``softmax(scores)``; and a drafter given the same G (see
    :meth:`noise`) proposes ``argmax(log q + G)``, which the target's own draw equals far
    more often than an independent draw from q would (Daliri, Musco, Suresh, arXiv
    2408.07978: at least (1 - TV) / (1 + TV)). Nothing is consumed from a stream, so a
    checkpoint needs no generator state."""

    CACHED = 64  # positions whose noise is kept (a step reads a few ahead of the text)

    def __init__(self, seed: int) -> None:
        self.seed = int(seed) & (2**64 - 1)
        self._noise: dict[tuple[int, int], torch.Tensor] = {}

    def noise(self, position: int, size: int) -> torch.Tensor:
        key = (position, size)
        cached = self._noise.get(key)
        if cached is None:
            if position < 0:
                raise ValueError(f"a draw's position must be >= 0, got {position}")
            rng = np.random.Generator(np.random.Philox(key=[position, self.seed]))
            exponential = np.maximum(rng.standard_exponential(size), 1e-300)  # never log(0)
            cached = torch.from_numpy(-np.log(exponential))
            if len(self._noise) >= self.CACHED:
                del self._noise[min(self._noise)]
            self._noise[key] = cached
        return cached

    def draw(self, scores: torch.Tensor, position: int) -> int:
        noise = self.noise(position, scores.numel()).to(scores.device)
        kept = torch.isfinite(scores).nonzero()[:, 0]  # what the warpers left (filtered: -inf)
        if len(kept) == scores.numel():
            return int((scores.to(torch.float64) + noise).argmax())
        # Only a kept token can win: the argmax over them, in id order, is the argmax over
        # all (a tie goes to the lowest id either way). After min-p a few tokens are kept,
        # and this is ~0.05 ms where the sum over the vocabulary in float64 was ~0.6.
        return int(kept[(scores[kept].to(torch.float64) + noise[kept]).argmax()])

    def _stream(self, position: int, stream: int) -> np.random.Generator:
        return np.random.Generator(np.random.Philox(key=[position, _mix(self.seed, stream)]))

    def uniform(self, position: int, stream: int) -> float:
        return float(self._stream(position, stream).random())

    def gumbel(self, position: int, size: int, stream: int) -> torch.Tensor:
        exponential = np.maximum(self._stream(position, stream).standard_exponential(size), 1e-300)
        return torch.from_numpy(-np.log(exponential))


class InverseCdfSampler(Sampler):
    """The sampler of checkpoints written before the coupled one (``sampling.sampler =
    "inverse-cdf"``): an inverse-CDF draw from ``softmax(scores)`` with one uniform from
    ``generator`` per emitted token, in order (a CPU generator, the same stream on every
    device)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def draw(self, scores: torch.Tensor, position: int) -> int:
        probs = torch.softmax(scores.to(torch.float64), dim=-1)
        cdf = probs.cumsum(-1)
        u = torch.rand((), generator=self.generator, dtype=torch.float64).to(cdf.device) * cdf[-1]
        token = int(torch.searchsorted(cdf, u.view(1), right=True))
        token = min(token, scores.numel() - 1)
        while probs[token] == 0:  # never return a filtered token at a CDF plateau edge
            token -= 1
        return token

    def uniform(self, position: int, stream: int) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def gumbel(self, position: int, size: int, stream: int) -> torch.Tensor:
        return -torch.empty(size, dtype=torch.float64).exponential_(generator=self.generator).clamp_min(1e-300).log()


def make_sampler(spec: SamplingSpec, *, seed: int, generator: torch.Generator | None = None) -> Sampler:
    """The sampler ``spec`` names, for a run with ``seed`` (the inverse-CDF sampler
    draws from ``generator``, by default one seeded with ``seed``)."""
    if spec.greedy:
        return ArgmaxSampler()
    if spec.sampler == "inverse-cdf":
        return InverseCdfSampler(generator if generator is not None else torch.Generator(device="cpu").manual_seed(seed))
    return CoupledSampler(seed)
