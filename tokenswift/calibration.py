"""Measuring what a forward costs here: the calibration of one model shape on one machine.

Speculation pays only when a tree's expected tokens outweigh its cost, and the cost of
a tree node differs by more than 5x between machines (a GPU verifies 100 nodes in the
time of one; a CPU without native bfloat16 pays for each). So :func:`calibrate` times
the runner's verify forward for a range of new-token counts at two context lengths,
decides whether oneDNN packed linears are faster (:mod:`tokenswift.model.linear`), and
times scoring one node (LM-head row, penalty, warpers, draw). The result, a
:class:`Calibration`, is cached per machine + model shape + dtype + device + torch
version (:mod:`tokenswift.records`); :class:`~tokenswift.costs.CostModel` predicts from it.

Costs only choose which candidates are verified; they never change what is accepted.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from tokenswift.calibrate_apart import record_from_child
from tokenswift.machine import machine_name
from tokenswift.records import CALIBRATION_FORMAT, CachedRecord, machine_key
from tokenswift.sampling import make_sampler
from tokenswift.scoring import FEW_PRODUCT_ROWS, ONE_PRODUCT_ROWS, finite_rows
from tokenswift.timing import CacheEvictor, chain_forward, interleaved_ms, least_ms, measured_contexts

logger = logging.getLogger(__name__)

NODE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CONTEXTS = (256, 4096)
BUDGET_SECONDS = 20.0  # what a calibration aims to take at most
EXPENSIVE = 6.0  # forwards costing more than this many one-token forwards are not measured


@attrs.frozen(kw_only=True)
class Calibration(CachedRecord):
    """Measured costs of one model shape + dtype + device on one machine."""

    FORMAT: ClassVar[str] = CALIBRATION_FORMAT
    TUPLES: ClassVar[tuple[str, ...]] = ("contexts", "nodes")
    NESTED: ClassVar[tuple[str, ...]] = ("forward_ms",)

    key: str
    machine: str
    torch: str
    device: str
    dtype: str
    threads: int
    packed_from_rows: int | None  # forwards of at least this many tokens use oneDNN packed linears (None: never)
    packed_lm_head: bool  # the LM head (scoring, drafting) uses them
    contexts: tuple[int, ...]
    nodes: tuple[int, ...]  # new tokens per forward
    forward_ms: tuple[tuple[float, ...], ...]  # [context][nodes], milliseconds (least of a few repeats)
    score_ms: float  # scoring one node: LM-head row, penalty, warpers, draw
    linears_ms: dict = attrs.field(factory=dict)  # the comparison, ms: forwards of 1/4/16 nodes and the LM head's row
    seconds: float = 0.0  # how long the calibration took
    # The LM head's product alone, for one row and for ONE_PRODUCT_ROWS rows (None: a
    # calibration from before they were measured): a step computes its likeliest nodes'
    # rows in one product (tokenswift.costs.CostModel.scoring_seconds).
    head_ms: float | None = None
    head_rows_ms: float | None = None
    head_few_rows_ms: float | None = None  # FEW_PRODUCT_ROWS rows (None: from before it was measured)
    # Whether scoring and the head's products were timed with the CPU's caches evicted
    # first, as a step meets them (False: a calibration from before, timed warm; it gets
    # them timed again).
    head_cold: bool = False

    def forward_seconds(self, nodes: int, context: int) -> float:
        """Seconds of a verify forward of ``nodes`` new tokens over ``context`` positions:
        piecewise linear in the node count, linear in the context past the first one
        measured (attention reads every position), with a per-position cost that never
        falls as nodes are added (what a noisy measurement would say otherwise)."""
        base = _interpolate(self.nodes, self.forward_ms[0], nodes)
        if len(self.contexts) == 1:
            return base / 1000
        per_position = _interpolate(self.nodes, self._per_position_ms(), nodes)
        return (base + per_position * max(context - self.contexts[0], 0)) / 1000

    def _per_position_ms(self) -> list[float]:
        (c0, c1), (row0, row1) = self.contexts[:2], self.forward_ms[:2]
        slopes, largest = [], 0.0
        for t0, t1 in zip(row0, row1):
            largest = max(largest, (t1 - t0) / (c1 - c0))
            slopes.append(largest)
        return slopes

    def table(self) -> str:
        """A markdown table of the measured forward costs."""
        head = "| context | " + " | ".join(f"{n} node{'s' if n > 1 else ''}" for n in self.nodes) + " |"
        lines = [head, "|---|" + "---|" * len(self.nodes)]
        for context, row in zip(self.contexts, self.forward_ms):
            lines.append(f"| {context} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")
        return "\n".join(lines)

    def apply_linears(self, runner) -> None:
        """Give ``runner`` the linear backend this calibration found faster."""
        if runner.can_pack_linears:
            runner.use_packed_linears(self.packed_from_rows, self.packed_lm_head)


def _interpolate(xs, ys, x):
    """Piecewise-linear through (xs, ys), extrapolated with the last segment's slope (in
    proportion to x from a single point)."""
    if x <= xs[0]:
        return ys[0]
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _choose_linears(runner, context: int, repeats: int) -> tuple[int | None, bool, dict]:
    """Where oneDNN packed linears are faster: (forwards from how many tokens, the LM
    head, the measurements)."""
    rows, measured = (1, 4, 16), {"default": [], "packed": []}
    for n in rows:
        forward = chain_forward(runner, n, context)
        ms = interleaved_ms(
            {
                "default": (lambda: runner.use_packed_linears(None), forward),
                "packed": (lambda: runner.use_packed_linears(1), forward),
            },
            repeats,
        )
        for name in measured:
            measured[name].append(round(ms[name], 2))
    faster = [p < d for p, d in zip(measured["packed"], measured["default"])]
    packed_from_rows = None
    for i, n in enumerate(rows):  # from the smallest row count after which packed stays faster
        if all(faster[i:]):
            packed_from_rows = n if i == 0 else rows[i - 1] + 1
            break
    hidden = torch.zeros(1, runner.config.hidden_size, dtype=runner.dtype, device=runner.device)
    lm_ms = interleaved_ms(
        {
            "default": (lambda: runner.use_packed_linears(None, False), lambda: runner.logits(hidden)),
            "packed": (lambda: runner.use_packed_linears(None, True), lambda: runner.logits(hidden)),
        },
        repeats,
    )
    measured["lm_head_row"] = [round(lm_ms["default"], 2), round(lm_ms["packed"], 2)]
    return packed_from_rows, lm_ms["packed"] < lm_ms["default"], measured


def calibrate(runner, scorer, *, max_nodes: int = NODE_COUNTS[-1], progress=None) -> Calibration:
    """Measure this machine's costs for ``runner``'s model (leaves its KV store empty
    and its linear backend the one found faster)."""
    started = time.perf_counter()
    contexts = measured_contexts(runner, CONTEXTS)
    runner.allocate(max(contexts) + max(NODE_COUNTS) + 1)
    # Node counts beyond the point where a forward costs EXPENSIVE x a one-token forward
    # are never worth verifying; the curve is extrapolated past the last one measured.
    one = least_ms(chain_forward(runner, 1, contexts[-1]), 1)
    nodes = [1, 2]  # at least a slope
    for n in NODE_COUNTS[2:]:
        if n > max(max_nodes, 2) or least_ms(chain_forward(runner, n, contexts[-1]), 0) > EXPENSIVE * one:
            break
        nodes.append(n)
    nodes = tuple(nodes)
    sweep_ms = one * len(contexts) * sum(1 + n / 16 for n in nodes)  # one round, roughly
    repeats = max(1, min(5, int(BUDGET_SECONDS * 1000 / max(sweep_ms, 1e-3)) - 1))

    packed_from_rows, packed_lm_head, linears_ms = None, False, {}
    if runner.can_pack_linears:
        packed_from_rows, packed_lm_head, linears_ms = _choose_linears(runner, contexts[-1], max(5, repeats))
        runner.use_packed_linears(packed_from_rows, packed_lm_head)

    forward_ms = []
    for context in contexts:
        ms = interleaved_ms({n: (lambda: None, chain_forward(runner, n, context)) for n in nodes}, repeats)
        row = [ms[n] for n in nodes]
        for i in range(1, len(row)):  # more nodes never cost less: what says so is noise
            row[i] = max(row[i], row[i - 1])
        forward_ms.append(tuple(round(t, 3) for t in row))
        if progress is not None:
            progress()
    runner.store.reset()

    calibration = Calibration(
        key=machine_key(runner),
        machine=machine_name(runner.device),
        torch=torch.__version__,
        device=runner.device.type,
        dtype=str(runner.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        packed_from_rows=packed_from_rows,
        packed_lm_head=packed_lm_head,
        contexts=contexts,
        nodes=nodes,
        forward_ms=tuple(forward_ms),
        **scoring_ms(runner, scorer, max(3, repeats)),
        linears_ms=linears_ms,
        seconds=round(time.perf_counter() - started, 2),
    )
    logger.info(
        "calibrated in %.1f s on %s (packed linears from %s rows, LM head %s)",
        calibration.seconds, calibration.machine, packed_from_rows, "packed" if packed_lm_head else "default",
    )
    return calibration


def load_calibration(runner) -> Calibration | None:
    """The cached calibration for this machine and model shape, if any."""
    return Calibration.load(machine_key(runner))


def scoring_ms(runner, scorer, repeats: int) -> dict[str, Any]:
    """The calibration's scoring fields: scoring one node (its LM-head row, penalty,
    warpers, draw) and the head's products of 1, ``ONE_PRODUCT_ROWS`` and
    ``FEW_PRODUCT_ROWS`` rows, ms (least of ``repeats``).

    On a CPU each is timed with the caches evicted first (``head_cold``), as a step meets
    the head after its forward has streamed the decoder's weights. Timed warm on a
    2-core AMD EPYC Zen 4 (32 MB L3), SmolLM2's 57 MB head took 0.73 ms for one row
    and 1.09 ms for four, so four rows in one product looked 1.5x one and each step
    computed its accepted nodes' rows in products of their own: 1.8-1.9 ms each, its
    steps of 2 and 3 tokens spent 3.6-3.9 and 5.3-6.0 ms in the head where one
    product takes ~2. Cold, one row takes ~1.7 ms and four ~1.9."""
    cold = runner.device.type == "cpu"
    evict = CacheEvictor() if cold else None  # freed on return: nothing stays resident for the run
    sampler = make_sampler(scorer.sampling, seed=0)
    hidden = torch.zeros(1, runner.config.hidden_size, dtype=runner.dtype, device=runner.device)
    context_ids = scorer.context(list(range(min(scorer.window, 64))), device=runner.device)
    # The draw is timed where the scores it draws from are drawable: a penalty may turn
    # this made-up context's scores to NaN (a run stops there; the calibration must not).
    if finite_rows(scorer(context_ids, runner.logits(hidden)))[0]:
        score_ms = least_ms(lambda: sampler.draw(scorer(context_ids, runner.logits(hidden))[0], 0), repeats, before=evict)
    else:
        score_ms = least_ms(lambda: scorer(context_ids, runner.logits(hidden)), repeats, before=evict)
    head_ms, head_rows_ms, head_few_rows_ms = (
        head_product_ms(runner, rows, repeats, before=evict) for rows in (1, ONE_PRODUCT_ROWS, FEW_PRODUCT_ROWS)
    )
    return {
        "score_ms": round(score_ms, 3), "head_ms": round(head_ms, 3), "head_rows_ms": round(head_rows_ms, 3),
        "head_few_rows_ms": round(head_few_rows_ms, 3), "head_cold": cold,
    }


def head_product_ms(runner, rows: int, repeats: int, *, before=None) -> float:
    """The LM head's product of ``rows`` rows, ms (least of ``repeats``; ``before``: run
    untimed before each, a :class:`~tokenswift.timing.CacheEvictor`)."""
    hidden = torch.zeros(rows, runner.config.hidden_size, dtype=runner.dtype, device=runner.device)
    return least_ms(lambda: runner.logits(hidden), repeats, before=before)


def calibration_for(runner, scorer, *, refresh: bool = False, sections: Mapping[str, Any] | None = None) -> Calibration:
    """The cached calibration, or a new one (measured once, then cached): in a process
    of its own where one can load the model (:mod:`tokenswift.calibrate_apart`;
    ``sections``: the run's penalty and sampling, for the child's scorer), else here. A
    cached one from before the few-rows product was measured gets it measured
    (milliseconds) and saved, rather than the whole calibration again; so does one
    whose scoring was timed with the caches warm (:func:`scoring_ms`)."""
    calibration = None if refresh else load_calibration(runner)
    if calibration is None and not refresh:
        calibration = record_from_child(runner, "forwards", load_calibration, sections)
    if calibration is None:
        logger.warning("measuring this machine's forward costs once for %s (cached for next time)", runner.dtype)
        calibration = calibrate(runner, scorer)
        calibration.save()
    elif calibration.head_ms is not None and (
        calibration.head_few_rows_ms is None or calibration.head_cold != (runner.device.type == "cpu")
    ):
        calibration = attrs.evolve(calibration, **scoring_ms(runner, scorer, 5))
        calibration.save()
    return calibration
