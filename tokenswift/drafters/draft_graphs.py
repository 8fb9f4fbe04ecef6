"""The ``eagle`` draft layer's level as compiled graphs of fixed shapes.

A level of a proposal (:class:`~tokenswift.drafters.eagle.EagleDrafter`) forwards a few
(token, feature) pairs through the draft layer, attending to the layer's cache, and
ranks the next tokens by the draft head. In eager PyTorch that is ~60 small operators
(norms, rotary, attention, eight products, casts) whose fixed costs outweigh reading
the layer's and the head's ~18 MB of weights. :class:`CompiledLevel` runs the embedding,
the layer and the head product as one graph per padded row count
(:data:`LEVEL_ROWS`). The shapes never change: the layer's keys and values live in
fixed buffers (:class:`~tokenswift.drafters.eagle.DraftKV`) that the mask says which
columns to read, so a graph compiles once and is never recompiled as the text grows.
(A previous version compiled the layer with dynamic shapes over a growing cache: it
recompiled mid-run and made proposals twice as slow; ``docs/compiled.md``.)

Padding rows repeat the last real row, see only themselves and are dropped by the
caller. Drafts only choose what is verified, so the graph's rounding (its reductions
in another order) never changes what a run emits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tokenswift.model import compiled as compiled_forwards
from tokenswift.model.compiled import CompileUnavailable, first_compiled_call, own_code, use_inductor_cache

logger = logging.getLogger(__name__)

# The padded row counts a level runs at: one pair (a commit after a step that accepted
# nothing), a few (a commit after accepted drafts), a level's expanded nodes (at most
# ``drafter.width``, 12 by default; ``drafter.children``, 10, at the first level), and
# 16. Wider calls run eagerly. In a run (2K prompt, greedy, a 2-core Sapphire Rapids) a
# level took 0.87 ms compiled at 1 row, 1.16 at 4 and 1.36 at 16. With levels as wide as
# the tree choice verifies, 353 of 553 calls in a greedy run had 5-8 rows (2-core AMD
# EPYC Zen 4): padded to 12 they took 1.73 ms after a 300 MB read and 1.2 just after
# another call, at 8 rows 1.53 and 0.86.
LEVEL_ROWS = (1, 4, 8, 12, 16)


class CompiledLevel:
    """``level(tokens, features, positions, keys, values, mask) -> (new keys, new values,
    outputs, logits)`` of the draft layer and head, compiled per row count at its
    first call. Raises :class:`~tokenswift.model.compiled.CompileUnavailable` where
    torch.compile cannot run (at construction) or failed (at the first call of a size,
    and every call after)."""

    def __init__(self, net: torch.nn.Module, embed: torch.nn.Module, head_logits: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device) -> None:
        problem = compiled_forwards.compiler_problem(device)  # looked up at call time: tests replace it
        if problem is not None:
            raise CompileUnavailable(problem)
        use_inductor_cache()

        def level(tokens, features, positions, keys, values, mask):
            # tokens [R] long, features [R, H], positions [R], keys/values [1, kv, C, d],
            # mask [R, C + R] -> new keys/values [1, kv, R, d], outputs [R, H], logits [R, V']
            new_keys, new_values, out = net.extend(
                embed(tokens).to(torch.float32), features, positions, keys, values, mask
            )
            return new_keys, new_values, out, head_logits(out)

        self._level = level
        # (rows, columns of the layer's cache) -> graph. The drafters of one model share
        # this object, and a drafter's cache size follows its options (window, depth,
        # width): keyed by rows alone, a second drafter's calls recompiled the first's
        # graphs mid-run (~0.7 s a proposal over a 256-token run, an AMD EPYC Zen 4).
        self._graphs: dict[tuple[int, int], Callable] = {}
        self._options = {
            # the layer, the embedding and the head are fixed for this object's life
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "cpp_wrapper": device.type == "cpu",
        }
        self.failure: CompileUnavailable | None = None
        self.compile_seconds = 0.0

    @staticmethod
    def rows_for(rows: int) -> int | None:
        """The padded row count ``rows`` real rows run at (None: eagerly)."""
        return next((size for size in LEVEL_ROWS if size >= rows), None)

    def compiled_rows(self, columns: int | None = None) -> tuple[int, ...]:
        """The row counts compiled so far (for a cache of ``columns`` columns; None: any)."""
        return tuple(sorted({rows for rows, size in self._graphs if columns is None or size == columns}))

    def __call__(self, tokens, features, positions, keys, values, mask):
        rows = tokens.shape[0]
        key = (rows, keys.shape[2])
        graph = self._graphs.get(key)
        if graph is not None:
            return graph(tokens, features, positions, keys, values, mask)
        if self.failure is not None:
            raise self.failure
        # a copy: torch.compile pops "guard_filter_fn" out of its options, and the graphs
        # of the other row counts then checked every module's guards at each call
        graph = torch.compile(own_code(self._level), dynamic=False, fullgraph=True, options=dict(self._options))
        try:
            out, seconds = first_compiled_call(graph, (tokens, features, positions, keys, values, mask), " of the draft level")
        except CompileUnavailable as exc:
            self.failure = exc
            raise
        self.compile_seconds += seconds
        self._graphs[key] = graph
        logger.info("compiled the draft level of %d rows in %.1f s", rows, seconds)
        return out
