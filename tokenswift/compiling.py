"""Whether a run's one-token forwards are compiled: the one place that decides.

``[model] compile`` is ``true`` (compile), ``false`` (eager) or ``"auto"``, which
compiles where the **compile calibration** (:class:`CompileCalibration`: one-token
steps eager against compiled at two contexts, in turns, and what compiling took;
measured once per machine and model shape, then cached) says compiled steps are
faster at the run's mean context and the run saves more than compiling costs (nothing,
once this process has compiled the model): through the whole decoder's graph, or, where
that compile would not be repaid, through a run of layers' graph
(:class:`~tokenswift.model.compiled.LayeredForward`, ~5x cheaper to compile, its steps
:data:`LAYERED_STEP_SHARE` dearer). Until that comparison is cached, only runs
of :data:`AUTO_CALIBRATE_MIN_TOKENS` tokens or more make it (compiling first costs up
to two minutes on a small CPU). Never for models under :data:`AUTO_MIN_PARAMETERS`
(test models), under torchrun or tensor parallelism, or without a compiler.

The mechanism, :class:`~tokenswift.model.compiled.CompiledForward`, lives in the model
layer; the runner falls back to eager forwards (and says so once) where a compile
fails at its first call, and :class:`~tokenswift.costs.CostModel` asks the runner
whether it is compiled each time it predicts, so a fallback never leaves it predicting
compiled costs.
"""

from __future__ import annotations

import bisect
import statistics

import logging
from typing import ClassVar

import attrs

from tokenswift import compile_costs, distributed
from tokenswift.calibrate_apart import record_from_child
from tokenswift.machine import machine_name
from tokenswift.model import graph_store
from tokenswift.model.compiled import (
    ANY_SIZE, STORE_IMPORTS, CompiledForward, CompileUnavailable, compiler_problem, layered_problem, stored_graph,
)
from tokenswift.records import CachedRecord, machine_key
from tokenswift.timing import interleaved_ms, measured_contexts, one_token_step, tree_step

logger = logging.getLogger(__name__)

# compile = "auto" leaves smaller models eager: they are test models, and compiling
# takes longer than anything they run.
AUTO_MIN_PARAMETERS = 20_000_000
# ... and measures compiled against eager steps (compiling first: up to two minutes on a
# 2-core CPU) only for a run this long, which such a measurement can repay.
AUTO_CALIBRATE_MIN_TOKENS = 8192
COMPILE_CONTEXTS = (256, 2048)
# Compiled tree forwards are timed again at this context, so that their cost is
# extrapolated along their own growth with the context: the eager curve's overstated it
# (a 2-core Sapphire Rapids, 32K positions: a 5-token tree priced +35 ms over one token,
# measured +2; the tree choice there verified ~2 nodes a step).
TREE_FAR_CONTEXT = 8192
# Tree verify forwards compile at these padded sizes (each a graph), where they pay,
# and at the most new tokens whose query rows fit one 16-row tile of the decode kernel
# (:func:`tree_sizes_for`). 2: where rows are dear a tree of the root and one draft is
# what pays, and padded to 4 it paid for two rows it never used (a 2-core AMD EPYC
# Zen 4, 2K positions: 2 / 4 tokens 15.8 / 17.6 ms compiled, `calibrate --compile`).
TREE_SIZES = (2, 4, 8, 16, 32)
KERNEL_TILE_ROWS = 16
# compile = "auto" compiles tree graphs a run has not got only as far as their expected
# compile time (:mod:`tokenswift.compile_costs`: warm or cold) fits this share of the
# run's decode time: about half of what verifying trees gains a run where it gains
# (compiled, 2K: 1.1-1.2x on an AMD EPYC Zen 4, 1.2-1.4x on a Sapphire Rapids), so that a
# run repays what it compiles. Compiling every tree size the policy chose mid-run made the
# README's 2,000-token job 0.73x `--preset ar` on a Zen 4 (25.8 s compiling against 8.0)
# and a 16K prompt with a new RoPE factor 0.04x on a Sapphire Rapids. Sizes not compiled
# run eagerly, and the cost model prices them so: the policy verifies them only where
# that pays.
TREE_COMPILE_SHARE = 0.1
# Runs of fewer new tokens verify trees through the graph of a run of layers
# (compiled.LayeredForward), longer ones through the whole decoder's, each one graph of
# every tree size; every run takes the whole decoder's once it is compiled in the
# process or stored (`tokenswift calibrate --compile` stores it: whole_trees_ready). On a
# 2-core AMD EPYC Zen 4 (SmolLM2, 2K positions, in turns) the layered tree graph
# compiled in ~6 s against ~93 s cold for the whole decoder's, and its forwards took
# 0.5-1.3 ms longer (the five calls' prologues): a 2-token tree +2.0 ms over a one-token
# forward where the whole graph's costs +0.8.
WHOLE_TREES_FROM_TOKENS = 32768
# A one-token step through a run of layers' graph takes this much longer than through the
# whole decoder's (same host, in turns: 0.5-0.9 ms of ~14 ms), so compile = "auto" takes
# it for a run too short to repay the whole decoder's compile (~7 s warm against ~1-2 s
# on a 2-core AMD EPYC Zen 4) and long enough to repay its own.
LAYERED_STEP_SHARE = 0.06


def whole_trees_ready(compiled: CompiledForward) -> bool:
    """The whole decoder's graph of every tree size is compiled in this process or in
    the graph store (``tokenswift calibrate --compile`` stores it): runs of any length
    then verify trees through it, which on a 2-core AMD EPYC Zen 4 (SmolLM2, 2K
    positions, in turns) took 13.4 / 14.5 / 14.9 / 16.8 ms for 2 / 3 / 4 / 6 tokens
    against 14.6 / 15.7 / 16.2 / 17.8 through a run of layers' graph (the five calls'
    prologues), loaded in ~0.1 s where it compiles in ~90 s cold."""
    if compiled.layered_problem is not None:  # no layered graphs: the whole decoder's anyway
        return True
    return compiled.ready("tree", ANY_SIZE) or compiled.stored("tree", ANY_SIZE)


def tree_sizes_for(runner) -> tuple[int, ...]:
    """:data:`TREE_SIZES` and ``16 // g`` new tokens (``g``: query heads per KV head),
    the most whose rows one tile of the decode kernel's AMX path takes: a forward of
    that many costs about what one token's does at long contexts, one more starts a
    second row group. For 9 query / 3 KV heads that is 5: on a 2-core Sapphire Rapids
    at 32K positions a 5-token verify padded to 8 took 73 ms, compiled at 5 ~55, one
    token 53 (and trees of root + 4 drafts are what the tree choice wants there)."""
    config = runner.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    aligned = KERNEL_TILE_ROWS // max(1, heads // kv_heads)
    extra = (aligned,) if 2 <= aligned < max(TREE_SIZES) else ()
    return tuple(sorted(set(TREE_SIZES + extra)))


@attrs.frozen(kw_only=True)
class CompileCalibration(CachedRecord):
    """One-token forwards eager vs compiled on this machine, and what compiling took;
    tree verify forwards of :data:`TREE_SIZES` tokens likewise (at the last context),
    and compiled at a far context with a one-token step. The trees' and the far times
    are each timed in turns with a compiled one-token step at the last context, and
    kept relative to its time in :attr:`compiled_ms`."""

    FORMAT: ClassVar[str] = "tokenswift-compile-calibration/2"
    SUFFIX: ClassVar[str] = "-compile"
    TUPLES: ClassVar[tuple[str, ...]] = (
        "contexts", "eager_ms", "compiled_ms", "tree_sizes", "tree_eager_ms", "tree_compiled_ms", "tree_far_compiled_ms",
    )

    key: str
    machine: str
    contexts: tuple[int, ...]
    eager_ms: tuple[float, ...]  # per context: a one-token forward plus its LM-head row
    compiled_ms: tuple[float, ...]
    compile_seconds: float  # what the measurement's compile took (a first compile: no cached kernels)
    tree_sizes: tuple[int, ...] = ()
    tree_eager_ms: tuple[float, ...] = ()  # per tree size, at contexts[-1]
    tree_compiled_ms: tuple[float, ...] = ()
    tree_compile_seconds: float = 0.0  # what compiling every tree size took
    tree_far_context: int = 0  # where the compiled trees were timed again (0: not)
    tree_far_compiled_ms: tuple[float, ...] = ()  # per tree size, compiled, at tree_far_context
    far_compiled_ms: float = 0.0  # a compiled one-token step (with its LM-head row) at tree_far_context (0: not timed)
    # the graph the trees were timed through: "tree" (the whole decoder's, of every
    # size) or "layered-tree" (runs of layers'; records from before this field)
    tree_graph: str = "layered-tree"

    @classmethod
    def from_dict(cls, data: dict) -> CompileCalibration:
        """Also a record of the first format (one-token steps only): its trees count
        as not measured, so ``auto`` compiles none until ``calibrate --compile``; and one
        from before trees were timed at a second context (priced as before)."""
        if data.get("format") == "tokenswift-compile-calibration/1":
            data = {**data, "format": cls.FORMAT, "tree_sizes": [], "tree_eager_ms": [], "tree_compiled_ms": []}
        data = {"tree_far_context": 0, "tree_far_compiled_ms": [], "far_compiled_ms": 0.0, "tree_graph": "layered-tree", **data}
        return super().from_dict(data)

    def tree_saving_seconds(self, size: int) -> float | None:
        """Seconds a compiled verify forward of ``size`` tokens saves over an eager one
        (negative: it loses; None: not measured)."""
        if size not in self.tree_sizes:
            return None
        i = self.tree_sizes.index(size)
        return (self.tree_eager_ms[i] - self.tree_compiled_ms[i]) / 1000

    def _between_sizes(self, size: int, ms: tuple[float, ...]) -> float | None:
        """``ms`` (per measured tree size) at ``size``: as measured, or linear between the
        measured sizes around it (a graph of every size runs trees at their own size:
        compiled.TREE_TOKENS); None outside them."""
        sizes = self.tree_sizes
        if size in sizes:
            return ms[sizes.index(size)]
        above = bisect.bisect_left(sizes, size)
        if above == 0 or above == len(sizes) or list(sizes) != sorted(sizes):
            return None
        low, high = sizes[above - 1], sizes[above]
        return ms[above - 1] + (ms[above] - ms[above - 1]) * (size - low) / (high - low)

    def tree_compiled_seconds(self, size: int) -> float | None:
        """Seconds of a compiled verify forward of ``size`` tokens at ``contexts[-1]``
        positions, as measured or between the measured sizes (None: neither)."""
        ms = self._between_sizes(size, self.tree_compiled_ms)
        return None if ms is None else ms / 1000

    def tree_compiled_seconds_at(self, size: int, context: int) -> float | None:
        """Seconds of a compiled verify forward of ``size`` tokens at ``context``
        positions, linear through its two measurements (between the measured sizes
        for one not measured; None: not measured at two contexts)."""
        if not self.tree_far_compiled_ms:
            return None
        near, far = self._between_sizes(size, self.tree_compiled_ms), self._between_sizes(size, self.tree_far_compiled_ms)
        if near is None or far is None:
            return None
        return _extrapolate((self.contexts[-1], self.tree_far_context), (near, far), context) / 1000

    def one_token_compiled_seconds_at(self, context: int) -> float | None:
        """Seconds of a compiled one-token step (with its LM-head row) at ``context``
        positions, from this calibration's compiled measurements alone: linear through
        its contexts, past the last one through its time at :attr:`tree_far_context`
        (None there: not timed at it). The trees' prices come from their compiled
        measurements, so a one-token step's must too: priced as the eager curve times
        compiled/eager, one noisy eager time (68.8 ms at 2K against 46.8 at 256, a
        2-core AMD EPYC Zen 3) put a one-token step at half a 2-token tree's price
        against 0.72 measured, and the tree choice verified nothing."""
        last = self.contexts[-1]
        if context <= last:
            return _extrapolate(self.contexts, self.compiled_ms, context) / 1000
        if self.far_compiled_ms <= 0 or self.tree_far_context <= last:
            return None
        return _extrapolate((last, self.tree_far_context), (self.compiled_ms[-1], self.far_compiled_ms), context) / 1000

    @property
    def paying_tree_sizes(self) -> tuple[int, ...]:
        """The measured tree sizes whose compiled forwards are faster than eager ones."""
        return tuple(size for size in self.tree_sizes if (self.tree_saving_seconds(size) or 0.0) > 0)

    def milliseconds(self, context: int) -> tuple[float, float]:
        """(eager, compiled) ms of a one-token step at ``context`` positions: linear in
        the context (attention reads every position) up to the last measured context;
        past it the eager step goes on along its line and the compiled one saves what it
        saved there. Both paths attend through the same operator, so what compiling
        saves is the per-step overhead, not a share of the attention. Extrapolating the
        two lines apart instead turned a few tenths of a millisecond of noise between
        256 and 2,048 positions into "compiled loses 8 ms a step" at a 100K run's mean
        context: that run decoded eagerly, ~1.4x slower per token (2-core Sapphire
        Rapids, 2026-12-04: compiled 20.5 vs eager 31.4 ms at 2K, the same kernel)."""
        eager = _extrapolate(self.contexts, self.eager_ms, context)
        last = self.contexts[-1]
        if context <= last:
            return eager, _extrapolate(self.contexts, self.compiled_ms, context)
        saved = self.eager_ms[-1] - self.compiled_ms[-1]
        return eager, max(eager - saved, 0.0)

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


def measure_compile(
    runner, *, repeats: int = 5, tree_sizes: tuple[int, ...] | None = None, whole_trees: bool = False
) -> CompileCalibration:
    """Compile ``runner``'s one-token forward and time it against the eager one, in
    turns, at :data:`COMPILE_CONTEXTS`; then each of ``tree_sizes`` (default
    :func:`tree_sizes_for` the model) as a verify forward at the last context (leaves
    the store empty and the runner eager). ``whole_trees``: the trees through the whole
    decoder's graph of every size (compiled and stored, ~1.5 minutes cold on a 2-core
    CPU, then loaded by every later run: see :func:`whole_trees_ready`), else through a
    run of layers' graph where the decoder allows.
    Raises :class:`~tokenswift.model.compiled.CompileUnavailable` where it cannot compile."""
    tree_sizes = tree_sizes_for(runner) if tree_sizes is None else tuple(tree_sizes)
    contexts = measured_contexts(runner, COMPILE_CONTEXTS)
    runner.allocate(max(contexts) + max((1, *tree_sizes)) + 1)
    compiled = runner.use_compiled(True)
    compiled.ledger_machine = machine_key(runner)
    layered_trees = compiled.layered_trees  # as the runs choose, given back after

    def compile_now(step) -> float:
        """Run ``step`` compiled once (compiling its graphs unless done before); the seconds compiling took."""
        before = compiled.compile_seconds
        runner.use_compiled(True)
        step()
        if runner.compiled is None:  # the compile failed and the runner fell back: nothing to compare
            raise compiled.failure or CompileUnavailable("torch.compile failed")
        return compiled.compile_seconds - before

    def eager_vs_compiled(step) -> tuple[float, float]:
        ms = interleaved_ms(
            {"eager": (lambda: runner.use_compiled(False), step), "compiled": (lambda: runner.use_compiled(True), step)},
            repeats,
        )
        return round(ms["eager"], 3), round(ms["compiled"], 3)

    try:
        compile_seconds = compile_now(one_token_step(runner, contexts[0]))
        if compile_seconds == 0.0:  # compiled earlier in this process: what that compile took
            compile_seconds = compiled.graph_seconds.get(("forward", 1), 0.0) + compiled.graph_seconds.get(("logits", 1), 0.0)
        if compiled.layered_problem is None:  # and a run of layers' graph, for the runs too short for the whole one
            compiled.layered_steps = True
            try:
                compile_now(one_token_step(runner, contexts[0]))
            finally:
                compiled.layered_steps = False
        eager_ms, compiled_ms = zip(*(eager_vs_compiled(one_token_step(runner, context)) for context in contexts))
        compiled.layered_trees = not whole_trees
        tree_graph = compiled.tree_graph_name
        runner.use_compiled_trees(tree_sizes)
        tree_steps = [tree_step(runner, contexts[-1], size) for size in tree_sizes]
        tree_compile_seconds = sum(compile_now(step) for step in tree_steps)
        # Every compiled time below is timed in turns with a compiled one-token step at
        # the last context and kept relative to it (at its time measured above): the
        # trees' prices against a one-token step's are ratios measured in turns, not
        # times taken minutes apart on a host that drifts (a 2-core AMD EPYC Zen 3: a
        # 2-token tree timed at 1.38x a one-token forward in one calibration and 1.08x
        # in the next, against 1.24-1.30x in turns).
        near, compiled_on = one_token_step(runner, contexts[-1]), lambda: runner.use_compiled(True)
        tree_ms = []
        for step in tree_steps:
            ms = interleaved_ms({"eager": (lambda: runner.use_compiled(False), step), "compiled": (compiled_on, step),
                                 "one token": (compiled_on, near)}, repeats)
            relative = compiled_ms[-1] / ms["one token"]
            tree_ms.append((round(ms["eager"] * relative, 3), round(ms["compiled"] * relative, 3)))
        tree_eager_ms, tree_compiled_ms = (tuple(m[0] for m in tree_ms), tuple(m[1] for m in tree_ms))
        far = max(TREE_FAR_CONTEXT, contexts[-1] + 1)
        runner.allocate(far + max((1, *tree_sizes)) + 1)
        runner.use_compiled(True)
        far_steps = {str(size): (compiled_on, tree_step(runner, far, size)) for size in tree_sizes}
        ms = interleaved_ms({**far_steps, "one token": (compiled_on, one_token_step(runner, far)), "near": (compiled_on, near)},
                            repeats)
        relative = compiled_ms[-1] / ms["near"]
        tree_far_ms = tuple(round(ms[str(size)] * relative, 3) for size in tree_sizes)
        far_ms = round(ms["one token"] * relative, 3)
    finally:
        runner.use_compiled(False)
        runner.use_compiled_trees(())
        runner.store.reset()
        compiled.layered_trees = layered_trees
    result = CompileCalibration(
        key=machine_key(runner), machine=machine_name(runner.device), contexts=contexts,
        eager_ms=tuple(eager_ms), compiled_ms=tuple(compiled_ms), compile_seconds=round(compile_seconds, 2),
        tree_sizes=tuple(tree_sizes), tree_eager_ms=tuple(tree_eager_ms), tree_compiled_ms=tuple(tree_compiled_ms),
        tree_compile_seconds=round(tree_compile_seconds, 2), tree_far_context=far, tree_far_compiled_ms=tree_far_ms,
        far_compiled_ms=far_ms, tree_graph=tree_graph,
    )
    logger.info(
        "compiled one-token steps: %s ms vs eager %s ms at contexts %s (compiling took %.1f s); "
        "trees of %s tokens: %s ms vs eager %s ms (compiling took %.1f s)",
        result.compiled_ms, result.eager_ms, contexts, result.compile_seconds,
        list(result.tree_sizes), result.tree_compiled_ms, result.tree_eager_ms, result.tree_compile_seconds,
    )
    return result


def load_compile_calibration(runner) -> CompileCalibration | None:
    """The cached comparison for this machine and model shape, if any."""
    return CompileCalibration.load(machine_key(runner))


def compile_calibration_for(runner) -> CompileCalibration:
    """The cached comparison of compiled and eager one-token steps, or a new one
    (compiles the model: up to ~2 minutes on a small CPU the first time; then cached)."""
    cached = load_compile_calibration(runner)
    if cached is not None:
        return cached
    cached = record_from_child(runner, "compile", load_compile_calibration)  # its memory released with the child
    if cached is not None:
        return cached
    logger.warning("measuring compiled against eager one-token forwards once (compiles the model; cached for next time)")
    result = measure_compile(runner)
    result.save()
    return result


@attrs.frozen(kw_only=True)
class CompileDecision:
    """compiled: one-token forwards run compiled; calibration: the comparison of
    compiled and eager steps (what the cost model scales one-node forwards by), where
    there is one."""

    compiled: bool
    calibration: CompileCalibration | None


def compile_calibration_for_trees(runner) -> CompileCalibration | None:
    """The compile calibration a run with compiled forwards needs where the cost model
    prices its trees: cached, or measured now (compiling the model, as the run would;
    ~1 minute on a 2-core CPU with inductor's cache warm). Without it the cost model
    prices compiled trees along the eager calibration's curve: a 4-token tree at 2K
    came out ~16.3 ms where it measures 15.1 against a 14.3 ms step (an AMD EPYC Zen 4).
    The calibration is keyed by the kernels' build, so every change of the kernels left
    ``compile = true`` runs without one until ``tokenswift calibrate --compile``. None
    for models under :data:`AUTO_MIN_PARAMETERS` (test models), under torchrun or
    tensor parallelism, or where compiling is unavailable."""
    if not _worth_compiling(runner):
        return None
    try:
        return compile_calibration_for(runner)
    except CompileUnavailable as exc:
        logger.warning("compiled tree forwards could not be measured (%s)", exc)
        return None


def decide(
    runner, choice: str | bool, *, prompt_tokens: int, new_tokens: int, prices_trees: bool = False
) -> CompileDecision:
    """Turn ``runner``'s compiled one-token forwards on or off for a run of
    ``new_tokens`` tokens after ``prompt_tokens``, as ``choice`` (``[model] compile``)
    says, and say which (see the module docstring). ``prices_trees``: the run's cost
    model prices its trees, so ``compile = true`` measures the compile calibration
    where none is cached (:func:`compile_calibration_for_trees`)."""
    calibration = load_compile_calibration(runner) if choice is not False else None
    if choice is True and prices_trees and calibration is None:
        calibration = compile_calibration_for_trees(runner)
    context = prompt_tokens + new_tokens // 2  # the run's mean context
    mode = "whole" if choice is True else _auto_mode(runner, context, new_tokens, calibration) if choice == "auto" else None
    on = mode is not None
    try:
        runner.use_compiled(on)
    except CompileUnavailable as exc:
        logger.warning("compile = %s, but compiled forwards are unavailable here, decoding eagerly: %s", choice, exc)
        runner.use_compiled(False)
    if runner.compiled is not None and calibration is None:  # auto has just measured it
        calibration = load_compile_calibration(runner)
    if runner.compiled is not None:
        runner.compiled.ledger_machine = machine_key(runner)
        runner.compiled.layered_trees = new_tokens < WHOLE_TREES_FROM_TOKENS and not whole_trees_ready(runner.compiled)
        runner.compiled.layered_steps = mode == "layered"
    sizes = tree_sizes(runner, choice, calibration)
    runner.tree_trial = None
    if choice == "auto" and sizes:
        sizes = affordable_tree_sizes(runner, sizes, calibration, context=context, new_tokens=new_tokens)
        missing = [size for size in sizes if not runner.compiled.has_tree_graph(size)]
        # compiled where the run's first speculative steps say it pays; not in long runs,
        # whose trees gain as the context grows (their first steps' rate says little of it)
        # and whose compile is a small share of them
        if missing and prices_trees and new_tokens < TRIAL_MAX_TOKENS:
            expected = tree_compile_seconds(runner, tuple(missing), calibration)
            if expected > TRIAL_COSTS_SECONDS:  # loading stored graphs costs less than the trial would
                runner.tree_trial = TreeTrial(compile_seconds=expected, tokens=new_tokens)
    runner.use_compiled_trees(sizes)
    return CompileDecision(compiled=runner.compiled is not None, calibration=calibration)


# A run that may compile tree graphs it has not got first verifies its trees eagerly,
# priced and judged as compiled ones, for this many speculative steps (TreeTrial): the
# README's 2,000-token job on a 2-core AMD EPYC Zen 4 compiled its tree graph and draft
# level (~2.5 s, ~5% of the run) and then verified trees at 1.01-1.08 tokens a step with
# the paper's sampling, 0.92x `--preset ar`. An eager tree costs ~10 ms more than a
# compiled one there: the trial costs ~0.1-0.2 s.
TRIAL_STEPS = 12
# ... and decides by this many steps of either kind, however few speculated
TRIAL_MAX_STEPS = 96
# ... unless compiling them is expected to cost no more than this (their graphs are in
# the graph store: loaded in ~0.02-0.1 s), about what the trial's eager trees would cost
TRIAL_COSTS_SECONDS = 0.25
# Runs of this many new tokens or more compile their trees without a trial
TRIAL_MAX_TOKENS = WHOLE_TREES_FROM_TOKENS


@attrs.define
class TreeTrial:
    """Whether compiling a run's tree graphs (``compile_seconds``, expected) pays over
    its ``tokens`` new tokens, judged by its first speculative steps verified eagerly:
    each counted at what it would have taken with compiled trees (the cost model's price
    of its tree forward in place of the eager one), against the run's plain steps.
    Compiling pays where the speculative steps' rate over the plain steps', applied to
    the tokens left, saves more than the compile costs."""

    compile_seconds: float
    tokens: int
    generated: int = 0
    speculative: list[tuple[int, float]] = attrs.Factory(list)  # (tokens emitted, seconds as compiled)
    plain: list[float] = attrs.Factory(list)  # seconds of each plain step
    steps: int = 0

    def observe(self, emitted: int, seconds: float, *, speculative: bool) -> bool | None:
        """Count a step; returns None while undecided, else whether to compile."""
        self.steps += 1
        self.generated += emitted
        if speculative:
            self.speculative.append((emitted, seconds))
        else:
            self.plain.append(seconds)
        if len(self.speculative) < TRIAL_STEPS and self.steps < TRIAL_MAX_STEPS:
            return None
        return self.saving_seconds() > self.compile_seconds

    def speedup(self) -> float | None:
        """Tokens a second of the speculative steps (as compiled) over the plain steps' (None: either unseen)."""
        if not self.speculative or not self.plain:
            return None
        plain = statistics.median(self.plain)
        return sum(e for e, _ in self.speculative) * plain / sum(s for _, s in self.speculative)

    def saving_seconds(self) -> float:
        """What speculating with compiled trees would save over the tokens left."""
        speedup = self.speedup()
        if speedup is None or speedup <= 1.0:
            return 0.0
        left = max(self.tokens - self.generated, 0)
        return left * statistics.median(self.plain) * (1 - 1 / speedup)


def _tree_compile_costs(runner, sizes: tuple[int, ...], calibration: CompileCalibration | None) -> dict[int, float]:
    """Per size of ``sizes`` (ascending), what compiling its tree graph is expected to
    take now (0: compiled in this process; a graph serving several sizes is priced at
    each: see :func:`tree_compile_seconds`)."""
    compiled = runner.compiled
    machine = machine_key(runner)
    name = compiled.tree_graph_name
    # A calibration's tree compiles say what whole-decoder graphs cost (cold) and that
    # their kernels are cached; graphs of a run of layers (compiled.LayeredForward)
    # are ~10x cheaper and the ledger alone knows which of them were compiled here.
    whole = name == "tree"
    # the calibration's compile is of the same kind of graph: one of every size, or one a size
    timed_whole = calibration is not None and calibration.tree_graph == name and bool(calibration.tree_sizes)
    one_graph = compiled.graph_tokens(name, TREE_SIZES[0]) == ANY_SIZE
    cold = (calibration.tree_compile_seconds / (1 if one_graph else len(calibration.tree_sizes))
            if whole and timed_whole else None)

    def expected(size: int) -> float:  # a size the calibration compiled is in inductor's cache
        seen = whole and timed_whole and size in calibration.tree_sizes
        tokens = compiled.graph_tokens(name, size)
        graph = compile_costs.graph_key(machine, name, tokens)
        return compile_costs.expected_seconds(graph, seen=seen, cold_default=cold, stored=compiled.stored(name, tokens))

    return {size: 0.0 if compiled.has_tree_graph(size) else expected(size) for size in sorted(sizes)}


def tree_compile_seconds(runner, sizes: tuple[int, ...], calibration: CompileCalibration | None) -> float:
    """What compiling the tree graphs of ``sizes`` is expected to take now, each graph once."""
    costs = _tree_compile_costs(runner, sizes, calibration)
    return _graphs_once(runner.compiled, costs, costs)


def _graphs_once(compiled, costs: dict[int, float], sizes) -> float:
    """The compile ``costs`` of ``sizes``, a graph serving several of them counted once."""
    name = compiled.tree_graph_name
    return sum({compiled.graph_tokens(name, size): costs[size] for size in sizes}.values())


def affordable_tree_sizes(
    runner, sizes: tuple[int, ...], calibration: CompileCalibration | None, *, context: int, new_tokens: int
) -> tuple[int, ...]:
    """Of ``sizes``, the tree graphs a run of ``new_tokens`` at a mean ``context`` may
    compile: those compiled in this process already (free), then, smallest first, each
    whose expected compile time (:func:`tokenswift.compile_costs.expected_seconds`: warm
    where the ledger has seen it compiled, else cold) still fits
    :data:`TREE_COMPILE_SHARE` of the run's expected decode time."""
    compiled = runner.compiled
    if compiled is None:
        return ()
    step_seconds = calibration.milliseconds(context)[1] / 1000 if calibration is not None else 0.02
    budget = TREE_COMPILE_SHARE * new_tokens * step_seconds
    name = compiled.tree_graph_name
    costs = _tree_compile_costs(runner, sizes, calibration)
    kept, spent, paid = [], 0.0, set()  # paid: the graphs kept (one may serve every size: compiled.TREE_TOKENS)
    for size, cost in costs.items():
        graph = compiled.graph_tokens(name, size)
        if graph in paid or spent + cost <= budget:
            kept.append(size)
            spent += 0.0 if graph in paid else cost
            paid.add(graph)
    left = [size for size in costs if size not in kept]
    if left:
        logger.info(
            "compile = auto: tree forwards of %s tokens stay eager in this run (compiling them, ~%.0f s, "
            "would not be repaid by %d tokens: %.1f s allowed)", left, _graphs_once(compiled, costs, left), new_tokens, budget,
        )
    return tuple(kept)


def compile_trees_now(runner, choice: str | bool = True) -> float:
    """Compile the tree sizes a run with ``choice`` would compile (:func:`tree_sizes`)
    now, outside any run (a benchmark before its timed turns); the seconds it took.
    Leaves the runner's compile settings as they were and its store empty."""
    saved = runner.compiled, runner.compiled_tree_sizes
    compiled = runner.use_compiled(True)
    sizes = tree_sizes(runner, choice, load_compile_calibration(runner))
    before = compiled.compile_seconds
    try:
        runner.use_compiled_trees(sizes)
        runner.allocate(max((1, *sizes)) + 8)
        for size in sizes:
            if not compiled.has_tree_graph(size):
                tree_step(runner, 8, size)()
    finally:
        runner.use_compiled(saved[0] is not None)
        runner.use_compiled_trees(saved[1])
        runner.store.reset()
    return compiled.compile_seconds - before


def tree_sizes(runner, choice: str | bool, calibration: CompileCalibration | None) -> tuple[int, ...]:
    """The padded tree sizes whose verify forwards run compiled while one-token
    forwards do: those the calibration measured faster compiled (``true`` without a
    tree measurement: all of :func:`tree_sizes_for` the model; ``auto``: none until
    measured). A calibration measured before the model's sizes were what they are
    (:func:`tree_sizes_for`) counts for the sizes it measured."""
    if runner.compiled is None:
        return ()
    if calibration is not None and calibration.tree_sizes:
        return calibration.paying_tree_sizes
    return tree_sizes_for(runner) if choice is True else ()


def _worth_compiling(runner) -> bool:
    """Whether compiling (and measuring compiled forwards) is considered for ``runner`` at
    all: not under torchrun or tensor parallelism, not without a compiler, not for models
    under :data:`AUTO_MIN_PARAMETERS` (test models)."""
    if distributed.launched() or runner.tp_size != 1 or compiler_problem(runner.device) is not None:
        return False
    return sum(p.numel() for p in runner.model.parameters()) >= AUTO_MIN_PARAMETERS


def _auto_mode(runner, context: int, new_tokens: int, calibration: CompileCalibration | None) -> str | None:
    """``compile = "auto"``'s decision: one-token steps through the whole decoder's
    graph (``"whole"``), a run of layers' graph (``"layered"``: compiles ~5x faster,
    steps :data:`LAYERED_STEP_SHARE` longer) or eagerly (None); ``calibration``: the
    cached one, if any. The run's saving over eager steps must exceed what compiling
    the graph is expected to cost (nothing, once this process has compiled it)."""
    if not _worth_compiling(runner):
        return None
    if calibration is None:
        if new_tokens < AUTO_CALIBRATE_MIN_TOKENS:
            logger.info("compile = auto: eager (compiled forwards not yet measured on this machine; a run of %d+ "
                        "tokens measures them, or `tokenswift calibrate --compile`)", AUTO_CALIBRATE_MIN_TOKENS)
            return None
        try:
            calibration = compile_calibration_for(runner)
        except CompileUnavailable as exc:
            logger.warning("compile = auto: compiled forwards are unavailable here (%s)", exc)
            return None
    eager_ms, compiled_ms = calibration.milliseconds(context)
    ready = CompiledForward.ready_for(runner.model)
    options = {"whole": ((eager_ms - compiled_ms) / 1000 * new_tokens, 0.0 if ready else one_token_compile_seconds(runner))}
    if layered_problem(runner.model, runner.decoder) is None:
        saving = (eager_ms - compiled_ms * (1 + LAYERED_STEP_SHARE)) / 1000 * new_tokens
        options["layered"] = (saving, one_token_compile_seconds(runner, "layered-forward"))
    paying = {mode: saving - cost for mode, (saving, cost) in options.items() if saving > 0 and saving > cost}
    mode = max(paying, key=paying.get) if paying else None
    logger.info(
        "compile = auto: one-token steps %s at %d positions (%s over %d tokens)",
        {"whole": "compiled", "layered": "compiled by runs of layers", None: "eager"}[mode], context,
        "; ".join(f"{m}: {saving:.1f} s saved, compiling ~{cost:.1f} s" for m, (saving, cost) in options.items()), new_tokens,
    )
    return mode


def one_token_compile_seconds(runner, graph: str = "forward") -> float:
    """What compiling the one-token graphs is expected to take now: warm, since the
    calibration compiled them (inductor keeps their kernels), at what the compile ledger
    measured (:mod:`tokenswift.compile_costs`). (The calibration's own figure was 0 s
    where it was measured in a process that had compiled already, and every run then
    compiled: a 12-token run spent 15 s of its 23 s compiling on a Sapphire Rapids.) The
    forward alone: the LM-head row's graph compiles in ~0.1 s, and with no entry of its
    own the ledger would price it at the forward's median (~8 s), doubling the cost.
    A graph in the graph store (:mod:`tokenswift.model.graph_store`) costs what loading it took."""
    stored = stored_graph(runner.model, runner.logits_dtype, runner.kernel_linears, graph, 1)
    machine = machine_key(runner)
    seconds = compile_costs.expected_seconds(compile_costs.graph_key(machine, graph, 1), seen=True, stored=stored)
    if stored and not graph_store.prepared():  # and the imports loading needs, once a process
        seconds += compile_costs.expected_seconds(compile_costs.graph_key(machine, STORE_IMPORTS, 0), stored=True)
    return seconds
