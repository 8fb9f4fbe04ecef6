"""What compiling a graph costs on this machine, its inductor cache cold or warm.

A graph's first call compiles it: seconds when inductor's cache already holds its
kernels (a warm compile: tracing, then loading them), up to minutes when it does not (a
cold compile: every kernel generated and built). On a 2-core AMD EPYC Zen 4 (2026-12-05)
SmolLM2-135M's tree forwards took ~5 s each warm and ~90 s cold, its one-token forward
7.4 s warm, while a 2,000-token run decodes in ~35 s: which of the two a run meets decides
whether a graph can pay for itself in it (:func:`tokenswift.compiling.affordable_tree_sizes`).

The ledger (``$TOKENSWIFT_CACHE/calibration/compiled-graphs.json``) keeps, per graph
(machine key, graph, size), the seconds its last cold and warm compiles took, told apart
by inductor's own counters (an FX graph cache hit with no miss is warm). A graph the
ledger has seen compiled is expected warm (inductor keeps its kernels on disk); one it
has not, cold. A graph in the graph store (:mod:`tokenswift.model.graph_store`) is
expected to cost what loading it took there last (its ``stored`` seconds: 0.02-0.1 s for
SmolLM2-135M on that Zen 4).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
from pathlib import Path

from tokenswift.paths import cache_dir

logger = logging.getLogger(__name__)

LEDGER_NAME = "compiled-graphs.json"
# Before any measurement on this machine: what a warm / cold compile of one graph is
# taken to cost (SmolLM2-135M, 2-core CPUs: 5-7 s warm, 75-100 s cold).
DEFAULT_WARM_SECONDS = 8.0
DEFAULT_COLD_SECONDS = 90.0
# ... and of graphs of a run of layers (tokenswift.model.compiled.LayeredForward),
# which compile about a fifth of the decoder (~1 s warm, ~7 s cold there)
DEFAULT_SECONDS = {"layered-tree": (1.5, 10.0)}
# ... and what loading a graph from the graph store is taken to cost before it was timed
# here (SmolLM2-135M's tree graph on a 2-core AMD EPYC Zen 4: 0.02-0.05 s)
DEFAULT_STORED_SECONDS = 0.1


def ledger_path() -> Path:
    return cache_dir() / "calibration" / LEDGER_NAME


def _read() -> dict:
    path = ledger_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the compile ledger %s (%s)", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def graph_key(machine: str, graph: str, size: int) -> str:
    return f"{machine}/{graph}/{int(size)}"


def _graph_of(key: str) -> str:
    """The graph's name in a :func:`graph_key` (its machine part may hold slashes)."""
    parts = key.rsplit("/", 2)
    return parts[1] if len(parts) == 3 else ""


def _kind(name: str) -> str:
    """Graphs of one kind cost alike to compile: of a run of layers, or of the whole decoder."""
    return "layered" if name.startswith("layered-") else "whole"


def record(key: str, seconds: float, warm: bool, *, stored: bool = False) -> None:
    """Note that compiling graph ``key`` took ``seconds``, its cache ``warm`` or cold, or
    that loading it from the graph store did (``stored``: :mod:`tokenswift.model.graph_store`)
    (written whole or not at all; a ledger that cannot be written is only said)."""
    data = _read()
    entry = data.get(key) if isinstance(data.get(key), dict) else {}
    entry["stored" if stored else "warm" if warm else "cold"] = round(float(seconds), 2)
    data[key] = entry
    path = ledger_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
            json.dump(data, out, indent=1, sort_keys=True)
        os.replace(out.name, path)
    except OSError as exc:
        logger.warning("could not write the compile ledger %s (%s)", path, exc)


def expected_seconds(key: str, *, seen: bool = False, cold_default: float | None = None, stored: bool = False) -> float:
    """What compiling graph ``key`` is expected to take now: where it is in the graph
    store (``stored``), what loading it took last (else :data:`DEFAULT_STORED_SECONDS`);
    else warm if it was compiled on
    this machine before (the ledger has seen it, or ``seen``: a calibration compiled
    it), at its own warm time, else the median warm time of the graphs of its kind
    (of a run of layers, or of the whole decoder) measured warm, else
    :data:`DEFAULT_SECONDS` or :data:`DEFAULT_WARM_SECONDS`; cold if not, at
    ``cold_default``, else the median cold time of the graphs of its kind, else the
    defaults' cold time."""
    data = _read()
    entry = data.get(key)
    if stored:
        loaded = entry.get("stored") if isinstance(entry, dict) else None
        return float(loaded) if isinstance(loaded, (int, float)) else DEFAULT_STORED_SECONDS
    name = _graph_of(key)
    entries = [e for k, e in data.items() if isinstance(e, dict) and _kind(_graph_of(k)) == _kind(name)]
    default_warm, default_cold = DEFAULT_SECONDS.get(name, (DEFAULT_WARM_SECONDS, DEFAULT_COLD_SECONDS))
    if (isinstance(entry, dict) and entry) or seen:
        entry = entry if isinstance(entry, dict) else {}
        if isinstance(entry.get("warm"), (int, float)):
            return float(entry["warm"])
        warm = [e["warm"] for e in entries if isinstance(e.get("warm"), (int, float))]
        return float(statistics.median(warm)) if warm else default_warm
    if cold_default is not None:
        return float(cold_default)
    cold = [e["cold"] for e in entries if isinstance(e.get("cold"), (int, float))]
    return float(statistics.median(cold)) if cold else default_cold


def cache_counts() -> tuple[int, int]:
    """inductor's FX graph cache (hits, misses) in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - every supported torch has it
        return 0, 0
    inductor = counters.get("inductor", {})
    return int(inductor.get("fxgraph_cache_hit", 0)), int(inductor.get("fxgraph_cache_miss", 0))
