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
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenswift import kernels
from tokenswift.model import compiled as compiled_forwards
from tokenswift.model import graph_store
from tokenswift.model.compiled import CompileUnavailable, first_compiled_call, own_code, use_inductor_cache

logger = logging.getLogger(__name__)

# The row counts one graph of a level serves, traced with the row count symbolic: a
# one-row call (a commit after a step that accepted nothing) runs padded to two, wider
# ones eagerly. Levels are as wide as the tree choice verifies (353 of 553 calls in a
# greedy run had 5-8 rows, a 2-core AMD EPYC Zen 4). Graphs of fixed row counts (1, 4, 8,
# 12, 16, as before) compiled in 0.2-0.5 s each, ~1.4 s of the README's main job, and
# ran padded (a 5-row level at 8 rows: 1.05 ms against 0.68 at 4).
LEVEL_ROWS = (2, 16)
# Where tracing the row count symbolic fails: a graph per padded row count.
PADDED_ROWS = (1, 4, 8, 12, 16)


def draft_logits(features: torch.Tensor, head: torch.Tensor, kernel_head: bool) -> torch.Tensor:
    """features [n, H] float32 -> [n, V'] float32 logits over the draft vocabulary of
    ``head`` ([V', H]: bfloat16 through the few-rows kernel where ``kernel_head``, else float32)."""
    if kernel_head and len(features) <= kernels.MAX_LINEAR_ROWS:
        return kernels.few_rows_linear(features.to(torch.bfloat16).contiguous(), head).float()
    return features @ head.T.to(features.dtype)


# The drafter's modules whose code a level's graph traces (beside graph_store.GRAPH_SOURCES)
LEVEL_SOURCES = ("draft_graphs.py", "feature_net.py")


class CompiledLevel:
    """``level(tokens, features, positions, keys, values, mask) -> (new keys, new values,
    outputs, logits)`` of the draft layer and head, compiled at its first call for every
    row count of :data:`LEVEL_ROWS` (per padded row count where that fails). Raises
    :class:`~tokenswift.model.compiled.CompileUnavailable` where torch.compile cannot
    run (at construction) or failed (at the first call of a size, and every call after)."""

    def __init__(self, net: torch.nn.Module, embed: torch.nn.Module, head: torch.Tensor, kernel_head: bool,
                 device: torch.device) -> None:
        problem = compiled_forwards.compiler_problem(device)  # looked up at call time: tests replace it
        if problem is not None:
            raise CompileUnavailable(problem)
        use_inductor_cache()

        def level(net, embed, head, tokens, features, positions, keys, values, mask):
            # tokens [R] long, features [R, H], positions [R], keys/values [1, kv, C, d],
            # mask [R, C + R] -> new keys/values [1, kv, R, d], outputs [R, H], logits [R, V'].
            # The modules and the head are inputs, so that a stored graph (graph_store)
            # runs on the process's own.
            new_keys, new_values, out = net.extend(
                embed(tokens).to(torch.float32), features, positions, keys, values, mask
            )
            return new_keys, new_values, out, draft_logits(out, head, kernel_head)

        self._level = level
        self._inputs = (net, embed, head)
        # where the graph store is on: the level's graphs are stored under the identity
        # of the draft layer, the target's embedding and the head as this level uses them
        self.store_identity = graph_store.graph_identity(
            torch.nn.ModuleDict({"net": net, "embed": embed}),
            options={"head": (tuple(head.shape), str(head.dtype)), "kernel_head": bool(kernel_head),
                     "level_rows": LEVEL_ROWS, "cpp_wrapper": device.type == "cpu",
                     "sources": [graph_store.file_digest(Path(__file__).parent / name) for name in LEVEL_SOURCES]},
        ) if graph_store.enabled() else None
        # (rows, columns of the layer's cache) -> graph; rows 0: every row count of
        # LEVEL_ROWS. The drafters of one model share this object, and a drafter's cache
        # size follows its options (window, depth, width): keyed by rows alone, a second
        # drafter's calls recompiled the first's graphs mid-run (~0.7 s a proposal over a
        # 256-token run, an AMD EPYC Zen 4).
        self._graphs: dict[tuple[int, int], Callable] = {}
        self.one_graph = True  # one graph for every row count (False: tracing that failed; said once)
        self._options = {
            # the layer, the embedding and the head are fixed for this object's life
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "cpp_wrapper": device.type == "cpu",
        }
        self.failure: CompileUnavailable | None = None
        self.compile_seconds = 0.0

    def rows_for(self, rows: int) -> int | None:
        """The row count ``rows`` real rows run at (None: eagerly)."""
        if self.one_graph:
            return max(rows, LEVEL_ROWS[0]) if rows <= LEVEL_ROWS[1] else None
        return next((size for size in PADDED_ROWS if size >= rows), None)

    def rows_to_compile(self, columns: int) -> tuple[int, ...]:
        """Row counts whose calls would compile the graphs not yet compiled for a cache of ``columns`` columns."""
        if self.one_graph:
            return () if (0, columns) in self._graphs else (LEVEL_ROWS[0],)
        return tuple(rows for rows in PADDED_ROWS if (rows, columns) not in self._graphs)

    def compiled_for(self, columns: int) -> bool:
        """Some graph has been compiled for a cache of ``columns`` columns."""
        return any(size == columns for _, size in self._graphs)

    def __call__(self, tokens, features, positions, keys, values, mask):
        rows, columns = tokens.shape[0], keys.shape[2]
        key = (0 if self.one_graph else rows, columns)
        args = (*self._inputs, tokens, features, positions, keys, values, mask)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph(*args)
        if self.failure is not None:
            raise self.failure
        # a copy: torch.compile pops "guard_filter_fn" out of its options, and the graphs
        # of the other row counts then checked every module's guards at each call
        options = dict(self._options)
        if self.store_identity is not None:
            options["guard_filter_fn"] = compiled_forwards.serializable_guards(options["guard_filter_fn"])
        graph = torch.compile(own_code(self._level), dynamic=False, fullgraph=True, options=options)
        if self.store_identity is not None:  # loaded now where a process before stored it
            graph = graph_store.StoredGraph(graph, graph_store.graph_path(self.store_identity, f"level-{columns}", key[0]))
            started = time.perf_counter()  # loaded before the first call (which traces unless it loads): counted too
            graph.load()
            self.compile_seconds += time.perf_counter() - started
        if self.one_graph and not getattr(graph, "loaded", False):  # this call traces: its row count stands for every one of LEVEL_ROWS
            least, most = LEVEL_ROWS
            for tensor in (tokens, features, positions, mask):
                torch._dynamo.mark_dynamic(tensor, 0, min=least, max=most)
            torch._dynamo.mark_dynamic(mask, 1, min=columns + least, max=columns + most)
        try:
            out, seconds = first_compiled_call(graph, args, " of the draft level")
        except graph_store.RefusedGraph:  # made again, compiled this time
            return self(tokens, features, positions, keys, values, mask)
        except CompileUnavailable as exc:
            if self.one_graph:
                logger.warning("the draft level compiles a graph per row count: %s", exc)
                self.one_graph = False  # this call eager (the caller's fallback); later ones padded to PADDED_ROWS
                raise
            self.failure = exc
            raise
        self.compile_seconds += seconds
        self._graphs[key] = graph
        logger.info("%s the draft level of %s rows in %.2f s", "loaded" if getattr(graph, "loaded", False) else "compiled",
                    "%d-%d" % LEVEL_ROWS if self.one_graph else rows, seconds)
        return out
