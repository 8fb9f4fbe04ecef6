"""Predicting what a step's parts cost here: the cost model the tree choice asks.

:class:`CostModel` interpolates the machine's :class:`~tokenswift.calibration.Calibration`
(linearly in context length, piecewise linearly in node count), scales one-token
forwards by the compiled/eager ratio of the
:class:`~tokenswift.compiling.CompileCalibration` while the runner's one-token forwards
are compiled, prices a compiled tree forward as what the compile calibration measured at
its padded size, extrapolated through its two measured contexts (or, from a calibration
that timed it at one, moved along the eager curve), and corrects itself from the
forward times the run observes.

Costs only choose which candidates are verified; they never change what is accepted.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from tokenswift.calibration import Calibration
from tokenswift.compiling import CompileCalibration
from tokenswift.scoring import FEW_PRODUCT_ROWS, ONE_PRODUCT_ROWS

# The most a product of ONE_PRODUCT_ROWS head rows may cost, against one row, for a
# step to compute them together (measured 1.12x with the few-rows kernel on a Sapphire
# Rapids; several times one row for bfloat16 through PyTorch on AVX2).
WIDE_HEAD_SLACK = 1.5

SIZE_SEEN = 4  # forwards at a size before its own factor is used
SIZE_SMOOTHING = 0.1


class CostModel:
    """Predicted seconds of a step's parts: the calibration's curve, scaled by what the
    run observes (an exponential average of measured / predicted forward time), so that
    a loaded or a faster machine is followed within a few dozen steps; and corrected per
    size a forward runs at (:meth:`size_factor`), so that where the curve's shape is off
    (what one more node costs relative to a step) the run's own forwards set it right.

    compiled_size: asked at every prediction at which size a forward of n tokens runs
    compiled now, or None: eager (the runner's own answer,
    :meth:`~tokenswift.model.runner.Runner.compiled_size`: a compile that fails
    mid-run turns it to None)."""

    def __init__(
        self,
        calibration: Calibration,
        *,
        compiled_size: Callable[[int], int | None] = lambda nodes: None,
        smoothing: float = 0.05,
    ) -> None:
        self.calibration = calibration
        self.compiled_size = compiled_size
        self.smoothing = smoothing
        self.scale = 1.0
        # size a forward ran at -> (observations, average of measured / predicted over
        # ``scale``): how far the curve is off at that size, apart from the machine's drift
        self._sizes: dict[int, tuple[int, float]] = {}
        self._seen: list[tuple[int, float]] = []  # (size, factor) of the sizes seen SIZE_SEEN times, by size
        self.compile_calibration: CompileCalibration | None = None  # see use_compile_calibration

    def use_compile_calibration(self, calibration: CompileCalibration | None) -> None:
        """Scale one-token forwards by ``calibration``'s compiled/eager ratio while they
        run compiled (None: no comparison, eager costs)."""
        self.compile_calibration = calibration

    def _predicted(self, nodes: int, context: int) -> float:
        eager = self.calibration.forward_seconds(nodes, context)
        size = self.compiled_size(nodes) if self.compile_calibration is not None else None
        if size == 1:
            return self._one_token_compiled(context, eager)
        if size is None:
            return eager
        along = self._tree_along(size, context)
        if along is not None:  # measured at two contexts: along its own growth
            return along
        measured = self.compile_calibration.tree_compiled_seconds(size)
        if measured is None:
            return eager
        # Compiled at the padded size: what it measured at the compile calibration's
        # context, moved along the eager curve to this context (attention's share). The
        # eager curve's own value there is not what the compile calibration's eager
        # forward measured (two calibrations, an interpolation): on an AMD EPYC Zen 4 a
        # 4-token tree at 2K was priced 24.3 ms this way against 20.1 measured, and the
        # tree choice verified almost nothing.
        at = self.compile_calibration.contexts[-1]
        moved = self.calibration.forward_seconds(size, context) - self.calibration.forward_seconds(size, at)
        return max(measured + moved, 0.2 * eager)

    def _tree_along(self, size: int, context: int) -> float | None:
        """A compiled tree of ``size`` tokens timed at two contexts: on the line through
        them up to the far one; past it, at the ratio to a one-token forward measured
        there (where the one-token forward was timed there too), both then dominated
        by reading the KV. Extrapolated along the line, two single timings' noise grows
        with the distance: on a 2-core AMD EPYC Zen 4 (2K and 8K timed) a 2-token tree
        at 32K was priced 27% above one token where the run's forwards took 6-8% more,
        a 4-token one 37% (39% measured), and ``tokenswift`` verified nothing in most
        of its first 60 steps (0.99x ``ar`` over them, 1.21x after)."""
        calibration = self.compile_calibration
        far = calibration.tree_far_context
        if context <= far or calibration.far_compiled_ms <= 0 or self.calibration.head_ms is None:
            return calibration.tree_compiled_seconds_at(size, context)
        at_far = calibration.tree_compiled_seconds_at(size, far)
        if at_far is None:
            return None
        one_far = self._one_token_compiled(far, self.calibration.forward_seconds(1, far))
        return at_far * self._one_token_compiled(context, self.calibration.forward_seconds(1, context)) / one_far

    def _one_token_compiled(self, context: int, eager: float) -> float:
        """A compiled one-token forward at ``context``: the compile calibration's own
        compiled time less the LM-head row it included (the trees' prices are their
        compiled times too: the ratio between them is measured, not the product of
        two calibrations); past its last context, where it has no time at a second
        one, moved along the eager curve scaled by compiled/eager. Without the head's
        time: that scaled eager curve throughout."""
        calibration, head = self.compile_calibration, self.calibration.head_ms

        def scaled(at: int) -> float:  # the eager curve times compiled/eager
            return self.calibration.forward_seconds(1, at) * calibration.factor(at)

        if head is None:
            return scaled(context)
        measured = calibration.one_token_compiled_seconds_at(context)
        if measured is None:  # past the last context, not timed at a second one
            last = calibration.contexts[-1]
            measured = calibration.one_token_compiled_seconds_at(last) + scaled(context) - scaled(last)
        return max(measured - head / 1000, 0.2 * eager)

    def forward_seconds(self, nodes: int, context: int) -> float:
        return self._predicted(nodes, context) * self.scale * self.size_factor(nodes)

    def _size(self, nodes: int) -> int:
        """The size a forward of ``nodes`` tokens runs at (its padded compiled size)."""
        size = self.compiled_size(nodes) if self.compile_calibration is not None else None
        return size or nodes

    def size_factor(self, nodes: int) -> float:
        """How far the curve is off at the size a forward of ``nodes`` tokens runs at,
        as the run's forwards measured it (1: as predicted). Sizes seen fewer than
        :data:`SIZE_SEEN` times take the factor interpolated between the nearest seen
        ones (by size; the nearest beyond them). On an AMD EPYC Zen 4 the compile
        calibration priced an 8-token tree at 1.28x a one-token forward at 2K; in the
        run it took 1.47x, and the choice verified 8-token trees where 4 paid more."""
        seen = self._seen
        if not seen:
            return 1.0
        size = self._size(nodes)
        sizes = [s for s, _ in seen]
        at = bisect.bisect_left(sizes, size)
        if at < len(seen) and sizes[at] == size:
            return seen[at][1]
        if at == 0:
            return seen[0][1]
        if at == len(seen):
            return seen[-1][1]
        (low, low_factor), (high, high_factor) = seen[at - 1], seen[at]
        return low_factor + (high_factor - low_factor) * (size - low) / (high - low)

    @property
    def one_product_rows(self) -> int:
        """How many LM-head rows a step computes in one product, its likeliest nodes'
        with the root's: :data:`~tokenswift.scoring.ONE_PRODUCT_ROWS` where the
        calibration measured that many rows at most :data:`WIDE_HEAD_SLACK` times one
        row (a kernel that reads the head once for all rows), else
        :data:`~tokenswift.scoring.FEW_PRODUCT_ROWS` where that many are (a kernel that
        reads it once for a few rows), else 0 (the likely path alone,
        :meth:`~tokenswift.speculation.Choice.likely_path`: where products of several
        rows are dear, as bfloat16 through PyTorch on AVX2)."""
        c = self.calibration
        if c.head_ms is None:
            return 0
        if c.head_rows_ms is not None and c.head_rows_ms <= WIDE_HEAD_SLACK * c.head_ms:
            return ONE_PRODUCT_ROWS
        if c.head_few_rows_ms is not None and c.head_few_rows_ms <= WIDE_HEAD_SLACK * c.head_ms:
            return FEW_PRODUCT_ROWS
        return 0

    def _product_ms(self) -> float:
        """What the product of :attr:`one_product_rows` rows costs, ms."""
        c = self.calibration
        return c.head_rows_ms if self.one_product_rows == ONE_PRODUCT_ROWS else c.head_few_rows_ms

    def scoring_seconds(self, expected: float) -> float:
        """Scoring the ``expected`` nodes a step visits (the root, then each accepted
        node): each node's LM-head row, penalty, warpers and draw; with
        :attr:`one_product_rows`, the rows in one product (the head read once)."""
        c = self.calibration
        if not self.one_product_rows:
            return c.score_ms * expected / 1000 * self.scale
        return (self._product_ms() + max(c.score_ms - c.head_ms, 0.0) * expected) / 1000 * self.scale

    def observe_forward(self, nodes: int, context: int, seconds: float) -> None:
        predicted = self._predicted(nodes, context)
        if predicted <= 0 or seconds <= 0:
            return
        ratio = min(max(seconds / predicted, 0.2), 5.0)  # one outlier (a page fault, a GC) moves it little
        self.scale += self.smoothing * (ratio - self.scale)
        size = self._size(nodes)
        count, factor = self._sizes.get(size, (0, 0.0))
        relative = ratio / self.scale
        # the plain average of the first observations, then an exponential one
        weight = 1.0 / (count + 1) if count < SIZE_SEEN else SIZE_SMOOTHING
        self._sizes[size] = (count + 1, factor + weight * (relative - factor))
        # kept sorted here, once a step, not at each of the choice's predictions
        self._seen = sorted((s, f) for s, (n, f) in self._sizes.items() if n >= SIZE_SEEN)
