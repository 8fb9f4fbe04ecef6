"""Timing forwards: the harness every calibration measures with.

Interference on a shared machine only ever adds time, so the least of a few runs
estimates what the machine does undisturbed (:class:`~tokenswift.costs.CostModel` then
scales the curve to the conditions a run meets); variants compared with each other run
in turns, so that a machine's drift falls on all of them alike.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tokenswift.model.kv import Staging


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


LLC_FALLBACK_BYTES = 64 * 2**20  # where the last-level cache's size cannot be read


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size as Linux reports it (``LLC_FALLBACK_BYTES`` where
    it does not)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=0) or LLC_FALLBACK_BYTES


class CacheEvictor:
    """Called, writes twice the last-level cache's size, so that what a product reads
    next comes from memory, as it does in a step: there the forward has just streamed
    the decoder's weights (~200 MB for SmolLM2) through the caches. Its buffer lives as
    long as the evictor (a calibration's timings), not the process."""

    def __init__(self) -> None:
        self.buffer = torch.zeros(2 * last_level_cache_bytes() // 4, dtype=torch.float32)

    def __call__(self) -> None:
        self.buffer.add_(1.0)


def least_ms(fn, repeats: int, *, before=None) -> float:
    """The least of ``repeats`` timings of ``fn`` (after a warm-up), in milliseconds;
    ``before``: called before each timing, untimed (a :class:`CacheEvictor`)."""
    fn()  # warm-up: allocators, oneDNN primitives for this shape
    times = []
    for _ in range(max(repeats, 1)):
        if before is not None:
            before()
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def interleaved_ms(variants: dict, repeats: int) -> dict:
    """The least milliseconds of each variant (a ``(setup, run)`` pair) over ``repeats``
    rounds that run every variant once."""
    times: dict = {name: [] for name in variants}
    for setup, run in variants.values():
        setup()
        run()  # warm-up
    for _ in range(repeats):
        for name, (setup, run) in variants.items():
            setup()
            synchronize()
            start = time.perf_counter()
            run()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * min(values) for name, values in times.items()}


def chain_forward(runner, nodes: int, context: int):
    """A forward of a ``nodes``-token chain over ``context`` committed positions (the
    store's contents do not matter for timing, so nothing is prefilled)."""
    tokens = torch.zeros(nodes, dtype=torch.long)
    mask = torch.ones(nodes, nodes, dtype=torch.bool).tril()
    depths = torch.arange(nodes)

    def run():
        runner.store.occupy(context)
        runner.forward(tokens, tree_mask=mask, depths=depths, logits_rows=None, view=Staging(runner.store))

    return run


def one_token_step(runner, context: int):
    """A one-token forward and its LM-head row over ``context`` committed positions."""
    token = torch.zeros(1, dtype=torch.long)

    def run():
        runner.store.occupy(context)
        runner.logits(runner.forward(token, logits_rows=None).hidden)

    return run


def tree_step(runner, context: int, nodes: int):
    """A verify forward of a ``nodes``-token tree (a root and its children, each
    seeing the root) over ``context`` committed positions, staged, never committed."""
    tokens = torch.zeros(nodes, dtype=torch.long)
    mask = torch.eye(nodes, dtype=torch.bool)
    mask[:, 0] = True
    depths = torch.ones(nodes, dtype=torch.long)
    depths[0] = 0

    def run():
        runner.store.occupy(context)
        runner.forward(tokens, tree_mask=mask, depths=depths, logits_rows=None)

    return run


def measured_contexts(runner, wanted: tuple[int, ...]) -> tuple[int, ...]:
    """``wanted`` context lengths, each at most half the model's context."""
    limit = int(getattr(runner.config, "max_position_embeddings", None) or wanted[-1] * 2)
    return tuple(sorted({min(c, max(limit // 2, 2)) for c in wanted}))
