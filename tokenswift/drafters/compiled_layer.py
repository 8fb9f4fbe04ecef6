"""The ``eagle`` drafter's layer forward compiled (:meth:`FeatureNet.extend`).

Eager, one draft forward of a pair or two runs ~50 small operators (norms, rotary
embedding, attention over the committed pairs, the SwiGLU MLP), and on a 2-core CPU their
fixed costs are most of its time: measured on a 2-core Sapphire Rapids (AMX-BF16), the
shipped layer over 515 committed pairs, 1-2 new ones, took 3.0 ms eager and 1.35 ms
compiled, and a 4-level proposal runs it four times. So where the target's forwards run
compiled (``[model] compile``), the drafter's run compiled too.

One graph with dynamic shapes serves every net of the same shape (its parameters are
graph inputs), every count of committed pairs and of new ones: a graph for one new pair
and one for several, compiled at first use (~10 s each with inductor's cache warm, ~30 s
cold), kept under inductor's cache. The compiled layer computes the same function in
another order of operations: drafts only choose what is verified, so rounding never
reaches the output. A compile that fails is said once; the drafter then runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenswift.model.compiled import CompileUnavailable, compiler_problem, use_inductor_cache

logger = logging.getLogger(__name__)

_graph = None
_failure: CompileUnavailable | None = None
_ready: set[tuple[bool, bool]] = set()  # (several new pairs, kernel products) compiled
compile_seconds = 0.0  # what compiling took in this process


def _extend(net, embeds, features, positions, past_keys, past_values, mask):
    return net.extend(embeds, features, positions, past_keys, past_values, mask)


def usable(device: torch.device) -> bool:
    """Whether the compiled layer may run on ``device`` (a compiler is there, and no
    compile has failed in this process)."""
    return _failure is None and compiler_problem(device) is None


def extend(net, embeds, features, positions, past_keys, past_values, mask, *, kernel_linears: bool = False):
    """:meth:`FeatureNet.extend` through the compiled graph (compiling it at first use).
    ``kernel_linears``: the caller runs it under :class:`~tokenswift.model.linear.KernelLinears`
    (a graph of its own). Raises :class:`CompileUnavailable` where compiling fails."""
    global _graph, _failure, compile_seconds
    if _failure is not None:
        raise _failure
    key = (embeds.shape[0] > 1, kernel_linears)
    if key in _ready:
        return _graph(net, embeds, features, positions, past_keys, past_values, mask)
    if _graph is None:
        use_inductor_cache()
        # one code object, a graph per (pair count kind, products, net shape)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
        _graph = torch.compile(_extend, dynamic=True, options={"cpp_wrapper": embeds.device.type == "cpu"})
    logger.warning("compiling the eagle draft layer for %s new pair%s (once per process)",
                   "several" if key[0] else "one", "s" if key[0] else "")
    started = time.perf_counter()
    try:
        out = _graph(net, embeds, features, positions, past_keys, past_values, mask)
    except Exception as exc:  # inductor fails in many ways; each means "eager here"
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        _failure = CompileUnavailable(f"torch.compile failed: {type(exc).__name__}: {first_line}")
        raise _failure from exc
    seconds = time.perf_counter() - started
    compile_seconds += seconds
    _ready.add(key)
    logger.info("compiled the eagle draft layer (%s new pairs) in %.1f s", "several" if key[0] else "one", seconds)
    return out
