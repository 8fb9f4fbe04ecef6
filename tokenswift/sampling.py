"""Drawing tokens: argmax, or a Gumbel-max draw keyed by (seed, position).

A Gumbel-max sampler draws the token at absolute position t as
``argmax(scores + G_t)``, G_t noise fixed by (seed, t) alone. A speculative run and
autoregressive decoding with the same seed thus draw every emitted token from the same
scores with the same noise: in float32/float64 the outputs are identical, not just equal
in law. Drafters may see G_t (the draw is still exact: the noise is independent of the
scores, whatever a drafter did with it, since a draft only decides what is verified).
The keyed sampler (the default) computes G_t one token at a time, from a hash of (seed,
t, token id), so a draw needs the noise of the tokens the warpers kept only and a
drafter that of its draft vocabulary only. The coupled sampler before it drew G_t for the
whole vocabulary from a Philox stream keyed by (seed, t); the inverse-CDF sampler (one
uniform per emitted token, in order) came before that. Checkpoints resume with the
sampler they were drawn with.
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


class MinPWarper(MinPLogitsWarper):
    """transformers' min-p warper, without its search for the top token where it keeps
    one (``min_tokens_to_keep = 1``, as :func:`build_warpers` asks): that token's
    probability is the row's maximum p, never below ``min_p * p`` for ``min_p <= 1``, so
    its mask entry is False already and marking it kept changes nothing. The same scores
    bit for bit (``tests/test_warpers.py`` compares the two), without the top-1
    search, which took 112 of the 227 us a 49,152-token row's warper took (a 2-core Intel
    Xeon without AMX): the warpers run once for every node a step scores."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self.min_tokens_to_keep != 1:
            return super().__call__(input_ids, scores)
        probs = torch.softmax(scores, dim=-1)
        return scores.masked_fill(probs < self.min_p * probs.amax(dim=-1, keepdim=True), self.filter_value)


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
        warpers.append(MinPWarper(min_p=spec.min_p))
    if spec.eta is not None:
        warpers.append(EtaLogitsWarper(epsilon=spec.eta, device=device or "cpu"))
    return warpers


SAMPLERS = ("keyed", "coupled", "inverse-cdf")


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

    def noise_at(self, position: int, ids: torch.Tensor, size: int) -> torch.Tensor | None:
        """The noise of :meth:`noise` at token ``ids`` only ([n] long, of a vocabulary of
        ``size``) -> [n] float64 on ``ids``' device (None: no Gumbel-max draws). A sampler
        whose noise is keyed by token computes those entries alone."""
        full = self.noise(position, size)
        return None if full is None else full.to(ids.device)[ids]

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
    (Philox) keyed by (seed, position), computed on the CPU: the same on every device and rank. That is an
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
            cached = self._vector(position, size)
            if len(self._noise) >= self.CACHED:
                del self._noise[min(self._noise)]
            self._noise[key] = cached
        return cached

    def _vector(self, position: int, size: int) -> torch.Tensor:
        """The noise [size] float64 of ``position`` (uncached)."""
        rng = np.random.Generator(np.random.Philox(key=[position, self.seed]))
        exponential = np.maximum(rng.standard_exponential(size), 1e-300)  # never log(0)
        return torch.from_numpy(-np.log(exponential))

    def draw(self, scores: torch.Tensor, position: int) -> int:
        kept = torch.isfinite(scores).nonzero()[:, 0]  # what the warpers left (filtered: -inf)
        if len(kept) == scores.numel():
            noise = self.noise(position, scores.numel()).to(scores.device)
            return int((scores.to(torch.float64) + noise).argmax())
        # Only a kept token can win: the argmax over them, in id order, is the argmax over
        # all (a tie goes to the lowest id either way). After min-p a few tokens are kept,
        # and this is ~0.05 ms where the sum over the vocabulary in float64 was ~0.6.
        return int(kept[(scores[kept].to(torch.float64) + self.noise_at(position, kept, scores.numel())).argmax()])

    def _stream(self, position: int, stream: int) -> np.random.Generator:
        return np.random.Generator(np.random.Philox(key=[position, _mix(self.seed, stream)]))

    def uniform(self, position: int, stream: int) -> float:
        return float(self._stream(position, stream).random())

    def gumbel(self, position: int, size: int, stream: int) -> torch.Tensor:
        exponential = np.maximum(self._stream(position, stream).standard_exponential(size), 1e-300)
        return torch.from_numpy(-np.log(exponential))


def _signed(word: int) -> int:
    """A 64-bit word as the int64 with its bits."""
    word &= 2**64 - 1
    return word - 2**64 if word >= 2**63 else word


_WEYL = _signed(0x9E3779B97F4A7C15)  # splitmix64's increment and its two multipliers
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def _shifted(words: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 words (``>>`` on int64 copies the sign bit)."""
    return (words >> bits) & ((1 << (64 - bits)) - 1)


def keyed_bits(key: int, ids: torch.Tensor) -> torch.Tensor:
    """splitmix64 of ``key + (id + 1) * 0x9E3779B97F4A7C15`` for each of ``ids`` ([n]
    long): [n] int64 words holding the 64 output bits (the products wrap modulo 2**64,
    as int64 arithmetic does). The output of SplitMix64 started at ``key``, at step
    ``id + 1``: a counter-based generator whose every number is computed alone."""
    words = ids.to(torch.int64).add(1).mul_(_WEYL).add_(_signed(key))
    words = (words ^ _shifted(words, 30)).mul_(_MIX_1)
    words = (words ^ _shifted(words, 27)).mul_(_MIX_2)
    return words ^ _shifted(words, 31)


def keyed_gumbel(key: int, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [n] float64 for ``ids`` under ``key``: ``-log(-log u)``, u
    the top 52 bits of :func:`keyed_bits` plus a half, over 2**52 (in (0, 1), never 0 or 1:
    every value finite). Computed on the CPU (a GPU's float64 log may round otherwise)
    and returned on ``ids``' device."""
    uniform = _shifted(keyed_bits(key, ids.cpu()), 12).to(torch.float64).add_(0.5).mul_(2.0**-52)
    return uniform.log_().neg_().log_().neg_().to(ids.device)


class KeyedSampler(CoupledSampler):
    """Gumbel-max as :class:`CoupledSampler` draws, the noise of each token computed alone:
    G at (position, token) is :func:`keyed_gumbel` of a key mixed from (seed, position).
    A draw after min-p computes the noise of the handful of tokens kept (~30 us where
    the coupled sampler's Philox vector of 49,152 cost ~0.35 ms a position, drafts and
    draws), a drafter that of its draft vocabulary. The extra random numbers of the
    rejection verifier are the coupled sampler's streams."""

    def _vector(self, position: int, size: int) -> torch.Tensor:
        return keyed_gumbel(_mix(self.seed, position), torch.arange(size))

    def noise_at(self, position: int, ids: torch.Tensor, size: int) -> torch.Tensor:
        if position < 0:
            raise ValueError(f"a draw's position must be >= 0, got {position}")
        return keyed_gumbel(_mix(self.seed, position), ids)


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
    if spec.sampler == "coupled":
        return CoupledSampler(seed)
    return KeyedSampler(seed)
