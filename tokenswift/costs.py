"""Predicting what a step's parts cost here: the cost model the tree choice asks.

:class:`CostModel` interpolates the machine's :class:`~tokenswift.calibration.Calibration`
(linearly in context length, piecewise linearly in node count), scales one-token
forwards by the compiled/eager ratio of the
:class:`~tokenswift.compiling.CompileCalibration` while the runner's one-token forwards
are compiled, and corrects itself from the forward times the run observes.

Costs only choose which candidates are verified; they never change what is accepted.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenswift.calibration import Calibration
from tokenswift.compiling import CompileCalibration


class CostModel:
    """Predicted seconds of a step's parts: the calibration's curve, scaled by what the
    run observes (an exponential average of measured / predicted forward time), so that
    a loaded or a faster machine is followed within a few dozen steps while the shape of
    the curve (what one more node costs relative to a step) stays the measured one.

    compiled: asked at every prediction whether one-token forwards run compiled now
    (the runner's own answer: a compile that fails mid-run turns it false)."""

    def __init__(
        self, calibration: Calibration, *, compiled: Callable[[], bool] = lambda: False, smoothing: float = 0.05
    ) -> None:
        self.calibration = calibration
        self.compiled = compiled
        self.smoothing = smoothing
        self.scale = 1.0
        self.compile_calibration: CompileCalibration | None = None  # see use_compile_calibration

    def use_compile_calibration(self, calibration: CompileCalibration | None) -> None:
        """Scale one-token forwards by ``calibration``'s compiled/eager ratio while they
        run compiled (None: no comparison, eager costs)."""
        self.compile_calibration = calibration

    def _predicted(self, nodes: int, context: int) -> float:
        seconds = self.calibration.forward_seconds(nodes, context)
        if nodes == 1 and self.compile_calibration is not None and self.compiled():
            seconds *= self.compile_calibration.factor(context)
        return seconds

    def forward_seconds(self, nodes: int, context: int) -> float:
        return self._predicted(nodes, context) * self.scale

    @property
    def score_seconds(self) -> float:
        return self.calibration.score_ms / 1000 * self.scale

    def observe_forward(self, nodes: int, context: int, seconds: float) -> None:
        predicted = self._predicted(nodes, context)
        if predicted <= 0 or seconds <= 0:
            return
        ratio = min(max(seconds / predicted, 0.2), 5.0)  # one outlier (a page fault, a GC) moves it little
        self.scale += self.smoothing * (ratio - self.scale)
