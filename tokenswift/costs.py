"""The machine's costs: what one forward and scoring one node take, here, for this model.

Speculation pays only when a tree's expected tokens outweigh its cost, and the cost of
a tree node differs by more than 5x between machines (a GPU verifies 100 nodes in the
time of one; a CPU without native bfloat16 pays for each). So the costs are measured:
:func:`calibrate` times the runner's verify forward for a range of new-token counts at
two context lengths (the KV store's contents do not matter for timing, so nothing is
prefilled), decides whether oneDNN packed linears are faster
(:mod:`tokenswift.model.linear`), and times scoring one node (LM-head row, penalty,
warpers, draw). The result, a :class:`Calibration`, is cached per machine + model shape
+ dtype + device + torch version in ``$TOKENSWIFT_CACHE/calibration/``.
:class:`CostModel` interpolates it (linearly in context length, piecewise linearly in
node count) and corrects itself from the forward times the run observes.

Costs only choose which candidates are verified; they never change what is accepted.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from tokenswift.machine import machine_name
from tokenswift.model.kv import Staging
from tokenswift.paths import cache_dir

logger = logging.getLogger(__name__)

FORMAT = "tokenswift-calibration/1"
NODE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CONTEXTS = (256, 4096)
BUDGET_SECONDS = 20.0  # what a calibration aims to take at most
EXPENSIVE = 6.0  # forwards costing more than this many one-token forwards are not measured


def model_shape(runner) -> dict:
    config = runner.config
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": config.hidden_size,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "layers": runner.num_layers,
        "heads": config.num_attention_heads,
        "kv_heads": runner.kv_heads,
        "vocab": runner.vocab_size,
    }


def calibration_key(runner) -> str:
    identity = {
        "machine": machine_name(runner.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": runner.device.type,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "model": model_shape(runner),
        "format": FORMAT,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


@attrs.frozen(kw_only=True)
class Calibration:
    """Measured costs of one model shape + dtype + device on one machine."""

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

    def to_dict(self) -> dict:
        return {"format": FORMAT, **attrs.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        data = dict(data)
        if data.pop("format", None) != FORMAT:
            raise ValueError("not a tokenswift calibration")
        data["contexts"] = tuple(data["contexts"])
        data["nodes"] = tuple(data["nodes"])
        data["forward_ms"] = tuple(tuple(row) for row in data["forward_ms"])
        return cls(**data)

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


def _least_ms(fn, repeats: int) -> float:
    """The least of ``repeats`` timings of ``fn`` (after a warm-up), in milliseconds.
    Interference on a shared machine only ever adds time, so the least of a few runs
    estimates what the machine does undisturbed; :class:`CostModel` then scales the
    curve to the conditions the run meets."""
    fn()  # warm-up: allocators, oneDNN primitives for this shape
    times = []
    for _ in range(max(repeats, 1)):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _chain_forward(runner, nodes: int, context: int):
    """A forward of a ``nodes``-token chain over ``context`` committed positions."""
    tokens = torch.zeros(nodes, dtype=torch.long)
    mask = torch.ones(nodes, nodes, dtype=torch.bool).tril()
    depths = torch.arange(nodes)

    def run():
        runner.store.occupy(context)
        runner.forward(tokens, tree_mask=mask, depths=depths, logits_rows=None, view=Staging(runner.store))

    return run


def _interleaved_ms(variants: dict, repeats: int) -> dict:
    """The least milliseconds of each variant (a ``(setup, run)`` pair) over
    ``repeats`` rounds that run every variant once, so that a machine's drift falls on
    all of them alike (see :func:`_least_ms` for why the least)."""
    times: dict = {name: [] for name in variants}
    for setup, run in variants.values():
        setup()
        run()  # warm-up
    for _ in range(repeats):
        for name, (setup, run) in variants.items():
            setup()
            _synchronize()
            start = time.perf_counter()
            run()
            _synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * min(values) for name, values in times.items()}


def _choose_linears(runner, context: int, repeats: int) -> tuple[int | None, bool, dict]:
    """Where oneDNN packed linears are faster: (forwards from how many tokens, the LM
    head, the measurements)."""
    rows, measured = (1, 4, 16), {"default": [], "packed": []}
    for n in rows:
        forward = _chain_forward(runner, n, context)
        ms = _interleaved_ms(
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
    lm_ms = _interleaved_ms(
        {
            "default": (lambda: runner.use_packed_linears(None, False), lambda: runner.logits(hidden)),
            "packed": (lambda: runner.use_packed_linears(None, True), lambda: runner.logits(hidden)),
        },
        repeats,
    )
    measured["lm_head_row"] = [round(lm_ms["default"], 2), round(lm_ms["packed"], 2)]
    return packed_from_rows, lm_ms["packed"] < lm_ms["default"], measured


def calibrate(runner, scorer, *, max_nodes: int = NODE_COUNTS[-1], progress=None) -> Calibration:
    """Measure this machine's costs for ``runner``'s model (leaves its KV store empty)."""
    started = time.perf_counter()
    limit = int(getattr(runner.config, "max_position_embeddings", None) or CONTEXTS[-1] * 2)
    contexts = tuple(sorted({min(c, max(limit // 2, 2)) for c in CONTEXTS}))
    runner.allocate(max(contexts) + max(NODE_COUNTS) + 1)
    # Node counts beyond the point where a forward costs EXPENSIVE x a one-token forward
    # are never worth verifying; the curve is extrapolated past the last one measured.
    one = _least_ms(_chain_forward(runner, 1, contexts[-1]), 1)
    nodes = [1, 2]  # at least a slope
    for n in NODE_COUNTS[2:]:
        if n > max(max_nodes, 2) or _least_ms(_chain_forward(runner, n, contexts[-1]), 0) > EXPENSIVE * one:
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
        ms = _interleaved_ms({n: (lambda: None, _chain_forward(runner, n, context)) for n in nodes}, repeats)
        row = [ms[n] for n in nodes]
        for i in range(1, len(row)):  # more nodes never cost less: what says so is noise
            row[i] = max(row[i], row[i - 1])
        forward_ms.append(tuple(round(t, 3) for t in row))
        if progress is not None:
            progress()
    runner.store.reset()

    from tokenswift.sampling import Sampler

    sampler = Sampler(scorer.sampling.greedy, torch.Generator().manual_seed(0))
    hidden = torch.zeros(1, runner.config.hidden_size, dtype=runner.dtype, device=runner.device)
    context_ids = scorer.context(list(range(min(scorer.window, 64))), device=runner.device)
    score_ms = _least_ms(lambda: sampler.draw(scorer(context_ids, runner.logits(hidden))[0]), max(3, repeats))
    calibration = Calibration(
        key=calibration_key(runner),
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
        score_ms=round(score_ms, 3),
        linears_ms=linears_ms,
        seconds=round(time.perf_counter() - started, 2),
    )
    logger.info(
        "calibrated in %.1f s on %s (packed linears from %s rows, LM head %s)",
        calibration.seconds, calibration.machine, packed_from_rows, "packed" if packed_lm_head else "default",
    )
    return calibration


def calibration_path(key: str) -> Path:
    return cache_dir() / "calibration" / f"{key}.json"


def load_calibration(runner) -> Calibration | None:
    """The cached calibration for this machine and model shape, if any."""
    return _read_cached(calibration_path(calibration_key(runner)), Calibration)


def _read_cached(path: Path, kind):
    """``kind.from_dict`` of the JSON at ``path``; None if there is none or it is unreadable."""
    try:
        return kind.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logger.warning("ignoring an unreadable cached %s %s (%s)", kind.__name__, path, exc)
        return None


def _write_json(path: Path, data: dict) -> bool:
    """Write ``data`` to ``path`` whole or not at all (a temporary file, renamed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not cache %s (%s); it will be measured again next time", path.name, exc)
        return False
    return True


def save_calibration(calibration: Calibration) -> Path | None:
    path = calibration_path(calibration.key)
    return path if _write_json(path, calibration.to_dict()) else None


def calibration_for(runner, scorer, *, refresh: bool = False) -> Calibration:
    """The cached calibration, or a new one (measured once, then cached); applies its
    choice of linear backend to ``runner``."""
    calibration = None if refresh else load_calibration(runner)
    if calibration is None:
        logger.warning("measuring this machine's forward costs once for %s (cached for next time)", runner.dtype)
        calibration = calibrate(runner, scorer)
        save_calibration(calibration)
    if runner.can_pack_linears:
        runner.use_packed_linears(calibration.packed_from_rows, calibration.packed_lm_head)
    return calibration


class CostModel:
    """Predicted seconds of a step's parts: the calibration's curve, scaled by what the
    run observes (an exponential average of measured / predicted forward time), so that
    a loaded or a faster machine is followed within a few dozen steps while the shape of
    the curve (what one more node costs relative to a step) stays the measured one."""

    def __init__(self, calibration: Calibration, *, smoothing: float = 0.05) -> None:
        self.calibration = calibration
        self.smoothing = smoothing
        self.scale = 1.0
        # With compiled one-token forwards: their measured cost over the eager one's
        # (a function of the context; None: eager).
        self.one_token_factor: Callable[[int], float] | None = None

    def _predicted(self, nodes: int, context: int) -> float:
        seconds = self.calibration.forward_seconds(nodes, context)
        if nodes == 1 and self.one_token_factor is not None:
            seconds *= self.one_token_factor(context)
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


# -- compiled one-token forwards ---------------------------------------------------------

COMPILE_FORMAT = "tokenswift-compile-calibration/1"
COMPILE_CONTEXTS = (256, 2048)


@attrs.frozen(kw_only=True)
class CompileCalibration:
    """One-token forwards eager vs compiled (:mod:`tokenswift.model.compiled`) on this
    machine, and what compiling took."""

    key: str
    machine: str
    contexts: tuple[int, ...]
    eager_ms: tuple[float, ...]  # per context: a one-token forward plus its LM-head row
    compiled_ms: tuple[float, ...]
    compile_seconds: float  # what the measurement's compile took (a first compile: no cached kernels)

    def to_dict(self) -> dict:
        return {"format": COMPILE_FORMAT, **attrs.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> CompileCalibration:
        data = dict(data)
        if data.pop("format", None) != COMPILE_FORMAT:
            raise ValueError("not a tokenswift compile calibration")
        for name in ("contexts", "eager_ms", "compiled_ms"):
            data[name] = tuple(data[name])
        return cls(**data)

    def milliseconds(self, context: int) -> tuple[float, float]:
        """(eager, compiled) ms of a one-token step at ``context`` positions (linear in
        the context: attention reads every position)."""
        return (
            _extrapolate(self.contexts, self.eager_ms, context),
            _extrapolate(self.contexts, self.compiled_ms, context),
        )

    def factor(self, context: int) -> float:
        """Compiled over eager time of a one-token step at ``context``."""
        eager, compiled = self.milliseconds(context)
        return compiled / eager if eager > 0 else 1.0

    def saving_seconds(self, context: int) -> float:
        """Seconds a compiled one-token step saves at ``context`` (negative: it loses)."""
        eager, compiled = self.milliseconds(context)
        return (eager - compiled) / 1000


def _extrapolate(xs, ys, x):
    if len(xs) == 1:
        return ys[0]
    (x0, x1), (y0, y1) = xs[:2], ys[:2]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def _one_token_step(runner, context: int):
    token = torch.zeros(1, dtype=torch.long)

    def run():
        runner.store.occupy(context)
        runner.logits(runner.forward(token, logits_rows=None).hidden)

    return run


def measure_compile(runner, *, repeats: int = 5) -> CompileCalibration:
    """Compile ``runner``'s one-token forward and time it against the eager one, in
    turns, at :data:`COMPILE_CONTEXTS` (leaves the store empty and the runner eager).
    Raises :class:`~tokenswift.model.compiled.CompileUnavailable` where it cannot compile."""
    limit = int(getattr(runner.config, "max_position_embeddings", None) or COMPILE_CONTEXTS[-1] * 2)
    contexts = tuple(sorted({min(c, max(limit // 2, 2)) for c in COMPILE_CONTEXTS}))
    runner.allocate(max(contexts) + 2)
    compiled = runner.use_compiled(True)
    before = compiled.compile_seconds
    try:
        _one_token_step(runner, contexts[0])()  # compiles both graphs (unless done before)
        compile_seconds = compiled.compile_seconds - before
        eager_ms, compiled_ms = [], []
        for context in contexts:
            step = _one_token_step(runner, context)
            ms = _interleaved_ms(
                {"eager": (lambda: runner.use_compiled(False), step), "compiled": (lambda: runner.use_compiled(True), step)},
                repeats,
            )
            eager_ms.append(round(ms["eager"], 3))
            compiled_ms.append(round(ms["compiled"], 3))
    finally:
        runner.use_compiled(False)
        runner.store.reset()
    result = CompileCalibration(
        key=calibration_key(runner), machine=machine_name(runner.device), contexts=contexts,
        eager_ms=tuple(eager_ms), compiled_ms=tuple(compiled_ms), compile_seconds=round(compile_seconds, 2),
    )
    logger.info(
        "compiled one-token steps: %s ms vs eager %s ms at contexts %s (compiling took %.1f s)",
        result.compiled_ms, result.eager_ms, contexts, result.compile_seconds,
    )
    return result


def compile_calibration_path(key: str) -> Path:
    return cache_dir() / "calibration" / f"{key}-compile.json"


def load_compile_calibration(runner) -> CompileCalibration | None:
    """The cached comparison for this machine and model shape, if any."""
    return _read_cached(compile_calibration_path(calibration_key(runner)), CompileCalibration)


def compile_calibration_for(runner) -> CompileCalibration:
    """The cached comparison of compiled and eager one-token steps, or a new one
    (compiles the model: up to ~2 minutes on a small CPU the first time; then cached)."""
    cached = load_compile_calibration(runner)
    if cached is not None:
        return cached
    logger.warning("measuring compiled against eager one-token forwards once (compiles the model; cached for next time)")
    result = measure_compile(runner)
    save_compile_calibration(result)
    return result


def save_compile_calibration(result: CompileCalibration) -> Path | None:
    path = compile_calibration_path(result.key)
    return path if _write_json(path, result.to_dict()) else None
