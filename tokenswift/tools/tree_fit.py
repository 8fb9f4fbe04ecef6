"""Fit a sparse draft tree to how a model's drafts are really accepted.

A tree spends its nodes where they are likely to be accepted. How likely depends on
the model, its heads and the sampling setting, so a tree is *measured*, not guessed
(Medusa's sparse-tree construction, applied to the ``tokenswift`` drafter):

1. **Replay.** Generate text with plain autoregressive decoding (the distribution
   every preset emits), then, for every position, rank the token that was drawn among
   the drafter's candidates at each depth: depth 1 by the LM head's scores after the
   penalty (what the ``tokenswift`` drafter proposes), depth k >= 2 by head k-1 on the
   same hidden state.
2. **Fit.** Estimate each (depth, rank)'s acceptance as its frequency in the replay
   and keep the ``nodes`` index paths with the highest product.
3. **Check.** :func:`tokens_per_step` walks the replayed text step by step down a
   tree, which is exactly how verification would have walked it, so the fitted tree
   and the default one can be compared on text they were not fitted on.

A fitted tree is saved as ``tree.json`` beside the heads
(:func:`tokenswift.drafters.template.save_tree`) and used by the drafter named in it
when its ``tree`` option is not given.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence

import torch

from tokenswift.drafters import head_based
from tokenswift.drafters.template import index_paths
from tokenswift.errors import SpecError
from tokenswift.pipeline import Pipeline
from tokenswift.registry import build_registry, get_plugin_manager
from tokenswift.sampling import make_sampler
from tokenswift.scoring import Scorer
from tokenswift.spec import PipelineSpec

logger = logging.getLogger(__name__)

DECODINGS = ("sampling", "greedy")  # what a tree is fitted to (pooled where both)
MISS = 10**9  # the rank of a token that is not among a depth's candidates


def rank_of(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """scores: [n, vocab], tokens: [n] -> [n] long: each token's rank (0 = best; ties
    count against it, as ``topk`` may order them either way)."""
    chosen = scores.gather(1, tokens[:, None].to(scores.device))
    return (scores > chosen).sum(1).cpu()


@torch.inference_mode()
def replay(
    model,
    heads,
    tokens: Sequence[int],
    start: int,
    scorer: Scorer,
    *,
    penalized_heads: bool = False,
    chunk: int = 256,
    noise=None,
) -> dict[str, torch.Tensor]:
    """Ranks of the drawn tokens ``tokens[start:]`` (m of them) of one generation.

    ``noise(position)``: the Gumbel-max sampler's noise [vocab] of the run that made
    the text (None: greedy, or the inverse-CDF sampler); with it, every rank is taken as
    the drafters rank coupled to the draw, by log-probability plus the noise of the
    token's position.

    model: the causal LM; heads: its :class:`~tokenswift.drafters.draft_heads.DraftHeads`;
    scorer: the scorer (penalty and warpers) of the pipeline that made the text.
    Returns, index i referring to ``tokens[start + i]``:

    * ``target`` [m]: rank in the target scores (penalty and warpers) at its position,
      which is also its rank among the penalised LM-head candidates;
    * ``lm`` [m]: rank in the raw LM-head logits;
    * ``heads`` / ``heads_penalized`` [num_heads, m]: rank of token t+k+2 in head k's
      logits on hidden(t), t = start + i - 1, raw / with the penalty of the context up
      to t (``MISS`` past the end of the text; the penalised ones only with
      ``penalized_heads``);
    * ``p_max`` [m]: the largest target probability at the position.
    """
    device = next(model.parameters()).device
    hidden = model.model(torch.tensor([list(tokens)], device=device)).last_hidden_state[0]  # [len, hidden_size]
    lm_head = model.get_output_embeddings()
    keys = ("target", "lm", "p_max", "heads") + (("heads_penalized",) if penalized_heads else ())
    out = {key: [] for key in keys}
    for begin in range(start, len(tokens), chunk):
        end = min(begin + chunk, len(tokens))
        h = hidden[begin - 1 : end - 1]  # hidden(t) scores token t+1
        drawn = torch.tensor(tokens[begin:end], device=device)
        logits = lm_head(h).float()  # [c, vocab]
        head_logits = heads.logits(h, lm_head).float()  # [c, num_heads, vocab]
        scores, penalised_heads = [], []
        for row, head_row, position in zip(logits, head_logits, range(begin, end)):
            context = scorer.context(tokens[:position], device=device)
            scores.append(scorer(context, row[None])[0])
            if penalized_heads:
                penalised_heads.append(scorer.penalize(context.expand(len(head_row), -1), head_row))
        scores = torch.stack(scores)
        out["target"].append(rank_of(_coupled(scores, range(begin, end), noise), drawn))
        out["lm"].append(rank_of(_coupled(logits, range(begin, end), noise), drawn))
        out["p_max"].append(scores.softmax(-1).max(-1).values.cpu())
        sources = {"heads": head_logits}
        if penalized_heads:
            sources["heads_penalized"] = torch.stack(penalised_heads)  # [c, num_heads, vocab]
        for key, source in sources.items():
            ranks = []
            for k in range(heads.num_heads):
                later = torch.tensor(tokens[begin + k + 1 : end + k + 1], dtype=torch.long)  # token t+k+2
                pad = torch.full((end - begin - len(later),), MISS)
                rows = _coupled(source[: len(later), k], range(begin + k + 1, begin + k + 1 + len(later)), noise)
                ranks.append(torch.cat([rank_of(rows, later), pad]))
            out[key].append(torch.stack(ranks))
    return {key: torch.cat(parts, dim=1 if key.startswith("heads") else 0) for key, parts in out.items()}


def _coupled(rows: torch.Tensor, positions, noise) -> torch.Tensor:
    """rows [c, vocab] as a head drafter ranks them coupled to the draw: among each
    row's :data:`~tokenswift.drafters.head_based.SHORTLIST` likeliest tokens, its
    probabilities (float32, as the drafters compute them) in log space plus each
    position's noise (the rest at -inf: never proposed); unchanged without noise."""
    if noise is None or len(rows) == 0:
        return rows
    probs = rows.float().softmax(-1)
    short = probs.topk(min(head_based.SHORTLIST, probs.shape[-1]), dim=-1).indices  # [c, S]
    full = torch.stack([noise(p) for p in positions]).to(rows.device)
    rated = probs.gather(-1, short).double().log() + full.gather(-1, short)
    return torch.full(probs.shape, -math.inf, dtype=torch.float64, device=rows.device).scatter_(-1, short, rated)


def depth_ranks(first: torch.Tensor, deeper: Sequence[torch.Tensor], depth: int) -> torch.Tensor:
    """[m, depth] candidate ranks per step: row i is the step whose root is the token
    before generated token i; column 0 is ``first`` (the rank of token i), column
    k >= 1 is ``deeper[k-1]`` (the rank of token i+k, indexed by the same root)."""
    ranks = torch.full((first.shape[0], depth), MISS)
    ranks[:, 0] = first
    for k in range(1, depth):
        ranks[:, k] = deeper[k - 1][: first.shape[0]]
    return ranks


def tokenswift_ranks(replayed: dict[str, torch.Tensor], depth: int) -> torch.Tensor:
    """[m, depth] ranks for the ``tokenswift`` drafter: penalised LM head, raw heads."""
    return depth_ranks(replayed["target"], list(replayed["heads"]), depth)


def tokens_per_step(ranks: torch.Tensor, paths: Sequence[Sequence[int]]) -> float:
    """ranks: [m, depth] from :func:`depth_ranks`. Walks the text step by step down the
    tree ``paths`` (index paths, as ``drafter.tree`` takes them; a prefix-closed set) as
    verification would: accept while the drawn token's rank extends the path, then one
    bonus token. Returns emitted tokens / steps."""
    tree = {tuple(path) for path in paths}
    rows = ranks.tolist()
    depth = min(max(len(path) for path in tree), ranks.shape[1])
    position, steps = 0, 0
    while position < len(rows):
        path: tuple[int, ...] = ()
        for d in range(depth):
            deeper = (*path, rows[position][d])
            if deeper not in tree:
                break
            path = deeper
        position += len(path) + 1
        steps += 1
    return len(rows) / steps


def fit_tree(ranks: Sequence[torch.Tensor], nodes: int, max_rank: int = 32) -> list[tuple[int, ...]]:
    """The ``nodes`` index paths most likely to be accepted, estimating a path's chance
    as the product of its (depth, rank) frequencies in ``ranks`` (each [m, depth]) and
    considering the top ``max_rank`` candidates per depth. Prefix-closed (a path never
    scores above its prefix, so best-first adds prefixes first); sorted shallow first."""
    if nodes < 1:
        raise ValueError(f"a tree needs at least 1 node, got {nodes}")
    stacked = torch.cat(list(ranks))
    depth = stacked.shape[1]
    freq = [[(stacked[:, d] == r).double().mean().item() for r in range(max_rank)] for d in range(depth)]
    # best-first on chance (a min-heap of its negative); ties by path, a prefix before its extensions
    frontier = [(-freq[0][r], (r,)) for r in range(max_rank)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < nodes:
        negative_chance, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth:
            for r in range(max_rank):
                heapq.heappush(frontier, (negative_chance * freq[len(path)][r], (*path, r)))
    return sorted(chosen, key=lambda path: (len(path), path))


def fit_for_heads(
    model,
    tokenizer,
    heads,
    *,
    nodes: int,
    prompt: Sequence[int],
    new_tokens: int,
    seeds: Sequence[int],
    preset: str = "tokenswift",
    decodings: Sequence[str] = ("sampling",),
    default_tree: Sequence = (1, 3, 3, 3),
    progress=None,
) -> tuple[list[tuple[int, ...]], dict]:
    """Replay ``len(seeds)`` generations of ``new_tokens`` after ``prompt`` per decoding
    of ``decodings`` ("sampling": the penalty and sampling of ``preset``; "greedy": its
    penalty, greedy) and fit a ``nodes``-node tree for the ``tokenswift`` drafter on all
    of them pooled: one tree serves both, so it is fitted to both where both are asked
    for. ``progress(count)`` is called with new tokens as they come.

    Returns the tree fitted on all seeds and a record: per seed and decoding, tokens per
    step of a tree fitted on the *other* seeds and of ``default_tree`` (both replayed on
    it)."""
    if not seeds:
        raise ValueError("fit a tree on at least one seed")
    unknown = sorted(set(decodings) - set(DECODINGS))
    if unknown or not decodings:
        raise ValueError(f"unknown decodings {unknown or list(decodings)}; valid: {list(DECODINGS)}")
    presets = build_registry(get_plugin_manager()).presets
    if preset not in presets:
        raise SpecError(f"unknown preset {preset!r}; valid presets: {sorted(presets)}")
    spec = PipelineSpec.from_dict({"preset": preset}, presets)
    depth = heads.num_heads + 1
    default_paths = index_paths(list(default_tree))
    ranks = {}  # (seed, decoding) -> [m, depth]
    for decoding in decodings:
        sampling = spec.sampling.to_dict() if decoding == "sampling" else {"greedy": True}
        # The same penalty and sampling with plain decoding: the distribution every preset emits.
        ar = Pipeline.from_spec({"preset": "ar", "penalty": spec.penalty.to_dict(), "sampling": sampling}, model, tokenizer)
        for seed in seeds:
            stream = (lambda chunk: progress(len(chunk.tokens))) if progress is not None else None
            result = ar.generate(list(prompt), new_tokens, seed=seed, ignore_eos=True, stream=stream)
            noise = None
            sampler, vocab = make_sampler(ar.spec.sampling, seed=seed), ar.runner.vocab_size
            if sampler.noise(0, 1) is not None:  # a Gumbel-max sampler: drafts ranked with its noise
                noise = lambda position, sampler=sampler, vocab=vocab: sampler.noise(position, vocab)  # noqa: E731
            replayed = replay(model, heads, list(prompt) + result.tokens, len(prompt), ar.scorer, noise=noise)
            ranks[seed, decoding] = tokenswift_ranks(replayed, depth)
            logger.info("seed %d, %s: %d tokens replayed", seed, decoding, len(result.tokens))
    per_seed = []
    for (seed, decoding), held_out in ranks.items():
        others = [r for (s, _), r in ranks.items() if s != seed] or [held_out]
        per_seed.append({
            "seed": seed,
            "decoding": decoding,
            "fitted": round(tokens_per_step(held_out, fit_tree(others, nodes)), 3),
            "default": round(tokens_per_step(held_out, default_paths), 3),
        })
    by_decoding = {
        decoding: round(sum(s["fitted"] for s in per_seed if s["decoding"] == decoding) / len(seeds), 3)
        for decoding in decodings
    }
    record = {
        "nodes": nodes,
        "seeds": list(seeds),
        "decodings": list(decodings),
        "new_tokens": new_tokens,
        "prompt_tokens": len(prompt),
        "preset": preset,
        "penalty": spec.penalty.to_dict(),
        "sampling": spec.sampling.to_dict(),
        "default_tree": list(default_tree),
        "replayed_tokens_per_step": {
            "fitted": round(sum(s["fitted"] for s in per_seed) / len(per_seed), 3),
            "default": round(sum(s["default"] for s in per_seed) / len(per_seed), 3),
            "fitted_by_decoding": by_decoding,
            "per_seed": per_seed,
            "note": "each seed replayed with a tree fitted on the other seeds" if len(seeds) > 1 else "fitted and replayed on the same seed",
        },
    }
    return fit_tree(list(ranks.values()), nodes), record
