"""Choosing each step's tree: the candidates worth verifying on this machine, now.

Every proposed node carries a confidence: its proposer's estimate that it is accepted
once its parent is (the heads' and the drafting pass's own probabilities, an n-gram's
share of its key's continuations). :class:`AcceptanceTracker` corrects those estimates
with what verification really accepts, per source, depth and confidence, so a
miscalibrated proposer cannot keep costing time. A node's chance of being accepted is
then the product of the corrected confidences along its path, and a step that verifies
the k likeliest nodes expects ``1 + (sum of their chances)`` tokens (the bonus token
always comes). :func:`choose` keeps the k that maximises expected tokens per
predicted second (:class:`~tokenswift.costs.CostModel`), k = 0 included: a plain
autoregressive step. That is EAGLE-2's dynamic tree, sized by the measured cost curve
as Sequoia sizes its trees.

:class:`RateChooser` makes two decisions by the tokens per second the steps of each
arm have realised: whether to speculate at all (the cost model prices the forwards it
measures, not everything a proposal, its scoring and its bookkeeping take on every
machine), and, for a drafter that drafts from a pass of the root over a *partial* KV
view (``tokenswift`` on long contexts), whether that pass pays for itself. Over the
whole context such a pass would compute exactly what the verify forward computes for
the root, so it is never run there.

None of this changes what is accepted: it only chooses what is proposed. Timings may
change the trees between two runs with the same seed, never the tokens.
"""

from __future__ import annotations

import bisect
import collections
import random
from collections import defaultdict
from collections.abc import Mapping

import attrs

from tokenswift.costs import CostModel
from tokenswift.interfaces import Verdict
from tokenswift.spec import PASS_GAIN
from tokenswift.tree import DRAFTER, RETRIEVER, DraftTree


class AcceptanceTracker:
    """Realised acceptance of verified nodes by (source, depth, confidence bin).

    A node is *tried* when verification reaches its parent, and *accepted* when the
    walk continues into it. The corrected confidence of a node is the bin's acceptance
    rate shrunk towards the proposer's own estimate by ``prior`` pseudo-trials (or
    towards its source and depth's rate, when it gave none).
    """

    BINS = (0.0, 0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)  # lower edges of the confidence bins
    NO_ESTIMATE = -1  # the bin of nodes proposed without a confidence

    def __init__(self, *, prior: float = 4.0, default: float = 0.05, max_depth: int = 8) -> None:
        self.prior = prior
        self.default = default
        self.max_depth = max_depth
        self.tried: dict[tuple[int, int, int], float] = defaultdict(float)
        self.accepted: dict[tuple[int, int, int], float] = defaultdict(float)
        self.tried_by_depth: dict[tuple[int, int], float] = defaultdict(float)
        self.accepted_by_depth: dict[tuple[int, int], float] = defaultdict(float)

    def _bin(self, confidence: float | None) -> int:
        return self.NO_ESTIMATE if confidence is None else bisect.bisect_right(self.BINS, confidence) - 1

    def depth_rate(self, source: int, depth: int) -> float:
        key = (source, min(depth, self.max_depth))
        return (self.accepted_by_depth[key] + self.prior * self.default) / (self.tried_by_depth[key] + self.prior)

    def corrected(self, source: int, depth: int, confidence: float | None) -> float:
        depth = min(depth, self.max_depth)
        key = (source, depth, self._bin(confidence))
        prior = self.depth_rate(source, depth) if confidence is None else min(max(confidence, 0.0), 1.0)
        return (self.accepted[key] + self.prior * prior) / (self.tried[key] + self.prior)

    def observe(self, tree: DraftTree, accepted: list[int]) -> None:
        """Count every child of the root and of the accepted nodes as tried."""
        taken = set(accepted)
        for parent in [0, *accepted]:
            for child in tree.children(parent).values():
                source, depth = tree.sources[child], min(tree.depths[child], self.max_depth)
                hit = 1.0 if child in taken else 0.0
                key = (source, depth, self._bin(tree.confidence[child]))
                self.tried[key] += 1
                self.accepted[key] += hit
                self.tried_by_depth[(source, depth)] += 1
                self.accepted_by_depth[(source, depth)] += hit


@attrs.frozen(kw_only=True)
class Choice:
    """keep: the node indices to verify (root first, every parent before its children);
    chance: each kept node's chance of being accepted (same order); expected_tokens:
    predicted tokens of the step; seconds: its predicted forward and scoring time."""

    keep: list[int]
    chance: list[float]
    expected_tokens: float
    seconds: float
    explored: list[int] = attrs.field(factory=list)  # kept only to explore (candidate indices)


    def likeliest(self, count: int) -> list[int]:
        """The ``count`` kept candidates (ids in the candidates' tree) likeliest to be
        visited, likeliest first (a node is never likelier than its parent, so they
        hold the likeliest paths)."""
        kept = sorted(zip(self.keep[1:], self.chance[1:]), key=lambda pair: (-pair[1], pair[0]))
        return [candidate for candidate, _ in kept[:count]]

    def likely_path(self, candidates: DraftTree, *, at_least: float = 0.25, longest: int = 3) -> list[int]:
        """Candidate nodes (ids in ``candidates``, all kept) of the likeliest path below
        the root, as long as each step of it is at least ``at_least`` likely (whose
        logits are worth computing with the root's, in one product)."""
        chance = dict(zip(self.keep, self.chance))
        path, node = [], 0
        while len(path) < longest:
            children = [c for c in candidates.children(node).values() if c in chance]
            if not children:
                break
            best = max(children, key=lambda c: chance[c])
            if chance[best] < at_least:
                break
            path.append(best)
            node = best
        return path


def chances(tree: DraftTree, tracker: AcceptanceTracker) -> list[float]:
    """Each node's chance of being accepted (1 for the root): corrected confidences
    multiplied along its path."""
    chance = [1.0] * len(tree)
    for node in range(1, len(tree)):  # parents come before their children
        q = tracker.corrected(tree.sources[node], tree.depths[node], tree.confidence[node])
        chance[node] = chance[tree.parents[node]] * q
    return chance


def choose(
    tree: DraftTree, tracker: AcceptanceTracker, costs: CostModel, context: int, max_nodes: int, *, explore: tuple[int, ...] = ()
) -> Choice:
    """The subtree of ``tree`` with the most expected tokens per predicted second of
    verifying it over ``context`` committed positions (at most ``max_nodes`` nodes
    below the root). For every source in ``explore``, its likeliest depth-1 candidate
    is verified whatever it costs: the only way to learn that a proposer the tracker
    doubts has become right. So is, at every step, the likeliest depth-1 candidate of
    a source that gives no confidences while the tracker has not tried one yet."""
    best_seconds = costs.forward_seconds(1, context) + costs.scoring_seconds(1.0)
    if len(tree) == 1:
        return Choice(keep=[0], chance=[1.0], expected_tokens=1.0, seconds=best_seconds)
    chance = chances(tree, tracker)
    order = sorted(range(1, len(tree)), key=lambda node: (-chance[node], node))[:max_nodes]
    best_k, expected = 0, 1.0
    best_rate = expected / best_seconds
    seconds = best_seconds
    for k, node in enumerate(order, start=1):
        expected += chance[node]
        seconds = max(seconds, costs.forward_seconds(k + 1, context) + costs.scoring_seconds(expected))
        if expected / seconds > best_rate:
            best_k, best_rate, best_seconds = k, expected / seconds, seconds
        # Every later node is at most as likely as this one and seconds never fall: once
        # even all of them at this node's chance cannot beat the best rate, none can
        # (the same choice, without pricing the ~60 candidates of a wide proposal).
        if (expected + (len(order) - k) * chance[node]) / seconds <= best_rate:
            break
    kept, explored = set(order[:best_k]), []
    for source in {tree.sources[node] for node in tree.children(0).values()}:
        firsts = [node for node in tree.children(0).values() if tree.sources[node] == source]
        unknown = all(tree.confidence[node] is None for node in firsts) and not tracker.tried_by_depth[(source, 1)]
        if (source in explore or unknown) and not kept.intersection(firsts):
            explored.append(max(firsts, key=lambda node: (chance[node], -node)))
    kept.update(explored)
    keep = [0, *sorted(kept)]
    if len(keep) - 1 != best_k:
        best_seconds = costs.forward_seconds(len(keep), context) + costs.scoring_seconds(1 + sum(chance[n] for n in keep[1:]))
    return Choice(
        keep=keep,
        chance=[chance[node] for node in keep],
        expected_tokens=1.0 + sum(chance[node] for node in keep[1:]),
        seconds=best_seconds,
        explored=explored,
    )


class DraftGate:
    """Whether a proposer (the drafter, the retriever) runs this step. Once open, it
    runs for at least ``trial`` steps and stays open while what its candidates earned
    over the last ``trial`` steps (the forwards their accepted tokens saved, less the
    verify time their nodes added and the time proposing took) is positive; otherwise
    it waits 1, then 2, 4, ... up to ``longest`` steps before a new trial, so that
    proposing what does not pay costs next to nothing. Judging a trial rather than one
    step keeps one unlucky step (a draft is accepted half the time at best) from
    shutting out a proposer that pays on average."""

    def __init__(self, *, longest: int = 128, trial: int = 4) -> None:
        self.longest = longest
        self.trial = trial
        self.recent: collections.deque[float] = collections.deque(maxlen=trial)  # seconds earned per step
        self.wait = 0
        self.backoff = 1

    @property
    def exploring(self) -> bool:
        """The proposer has not paid for as long as the gate waits: its next trial
        verifies its likeliest candidate anyway (see :func:`choose`), so that a proposer
        whose confidences undersell it is found out, at most once every ``longest`` steps."""
        return self.backoff >= self.longest

    def draft(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def observe(self, earned_seconds: float) -> None:
        """What the proposer's candidates earned this step (negative: they cost)."""
        self.recent.append(earned_seconds)
        if len(self.recent) < self.trial:
            return
        if sum(self.recent) > 0:
            self.backoff = 1
        else:
            self.wait = self.backoff
            self.backoff = min(2 * self.backoff, self.longest)
            self.recent.clear()


@attrs.define
class ArmRate:
    """One arm's steps, each weighted by ``2 ** -(age / half_life)`` (its age in seconds
    of the run): running weighted sums of what :meth:`RateChooser.rate` and
    :meth:`RateChooser.error` need."""

    count: int = 0  # steps observed
    weight: float = 0.0  # the sum of their weights: the steps' worth of evidence, fading with age
    tokens: float = 0.0
    seconds: float = 0.0
    tokens_squares: float = 0.0
    tokens_seconds: float = 0.0
    seconds_squares: float = 0.0

    def decay(self, factor: float) -> None:
        if not self.count:
            return
        factor = max(factor, 1e-12 / self.weight)  # at most next to nothing left to know, never 0 / 0
        self.weight *= factor
        self.tokens *= factor
        self.seconds *= factor
        self.tokens_squares *= factor
        self.tokens_seconds *= factor
        self.seconds_squares *= factor

    def add(self, tokens: float, seconds: float) -> None:
        self.count += 1
        self.weight += 1.0
        self.tokens += tokens
        self.seconds += seconds
        self.tokens_squares += tokens * tokens
        self.tokens_seconds += tokens * seconds
        self.seconds_squares += seconds * seconds


class RateChooser:
    """Which of two arms (True / False: speculate or not, a drafting pass or not) realises
    more tokens per second.

    An arm's *rate* is its tokens over its seconds, each step weighted by its age in
    seconds of the run (halved every ``half_life``), with a standard error from how its
    steps spread about it (shrunk towards ``spread``, the relative spread of one step's
    rate, while an arm has few recent steps: an arm not run for a while grows uncertain).
    Arms run in bursts of ``burst`` steps, ``first`` measured first, then the other. At
    the end of each burst the next is drawn by Thompson sampling: a rate is drawn for each
    arm from a normal of its estimate and standard error, and the higher runs.

    A burst of the worse arm ends early once it is ``z`` standard errors behind (from its
    second step), or after ``futile`` of its steps that could not have earned anything
    (``observe(..., futile=True)``; one, after a burst of the arm that ended so). Arms too
    close to tell apart alternate, which costs little, until they are told apart; an arm
    far behind is drawn again when its estimate has aged into doubt, for two steps about
    once a half-life, so that a change of regime (a longer context, other text) is noticed.

    Why not the bursts judged by running means that came before: on a 2-core AMD EPYC
    Zen 4 (2K prompt, compiled, greedy), ``eagle``'s speculative steps realised 6% more
    tokens per second than plain ones, but one step's rate spreads by ~35%; judged on an
    exponential average of ~9 steps, an unlucky burst sent the next try twice as far, and
    the guard speculated in 64 of 487 steps (1.02x ``ar`` against 1.06x without it)."""

    def __init__(
        self, *, first: bool = True, half_life: float = 20.0, burst: int = 4, z: float = 2.0, spread: float = 0.35,
        futile: int = 2, seed: int = 0,
    ) -> None:
        self.first = first
        self.half_life = half_life
        self.burst = burst
        self.z = z
        self.spread = spread
        self.futile = futile
        self.arms = {True: ArmRate(), False: ArmRate()}
        self.random = random.Random(seed)  # the draws: timings vary from run to run anyway, never the tokens
        self.tried: bool | None = None  # the arm of the running burst
        self.left = 0  # steps of the running burst still to run
        self.futile_steps = 0  # steps of the running burst that could not have earned
        self.last_futile = {True: False, False: False}  # each arm's last burst ended for its futile steps

    @property
    def samples(self) -> dict[bool, int]:
        """Steps observed of each arm."""
        return {arm: rate.count for arm, rate in self.arms.items()}

    def rate(self, arm: bool) -> float | None:
        """The arm's realised tokens per second (None: never run)."""
        sums = self.arms[arm]
        return sums.tokens / sums.seconds if sums.count else None

    def error(self, arm: bool) -> float:
        """The standard error of :meth:`rate` (tokens per second; the arm has run)."""
        sums, rate = self.arms[arm], self.rate(arm)
        steps = sums.weight  # each step's worth halves every half-life: an old estimate is in doubt
        residual = max(0.0, sums.tokens_squares - 2 * rate * sums.tokens_seconds + rate * rate * sums.seconds_squares)
        # The prior spread counts as this many steps' worth of residuals, relative to the
        # tokens of the arm that earns more a step (an arm's own unlucky first steps would
        # make its spread look small).
        prior_steps = 4
        typical = max(other.tokens / other.weight for other in self.arms.values() if other.count)
        variance = (residual + prior_steps * (self.spread * typical) ** 2) / (steps + prior_steps)
        return (variance / steps) ** 0.5 / (sums.seconds / sums.weight)

    def _start(self, arm: bool) -> bool:
        self.tried, self.left, self.futile_steps = arm, self.burst, 0
        return arm

    def pick(self) -> bool:
        """The arm this step runs."""
        if self.left > 0:
            return self.tried
        for arm in (self.first, not self.first):  # each arm measured first, for a burst
            if not self.arms[arm].count:
                return self._start(arm)
        draws = {arm: self.random.gauss(self.rate(arm), self.error(arm)) for arm in (True, False)}
        return self._start(draws[True] >= draws[False])

    def observe(self, arm: bool, tokens: float, seconds: float, *, futile: bool = False) -> None:
        """A step of ``arm`` emitted ``tokens`` in ``seconds`` (``futile``: it could not
        have earned more than a step of the other arm)."""
        if seconds <= 0:
            return
        factor = 2.0 ** (-seconds / self.half_life)
        for sums in self.arms.values():
            sums.decay(factor)
        self.arms[arm].add(tokens, seconds)
        if self.tried is None or arm != self.tried or self.left == 0:
            return
        self.left -= 1
        self.futile_steps += futile
        ended_futile = self.futile_steps >= (1 if self.last_futile[arm] else self.futile)
        if ended_futile or (self.burst - self.left >= 2 and self._behind(arm)):
            self.left = 0
        if self.left == 0:
            self.last_futile[arm], self.tried = ended_futile, None

    def _behind(self, arm: bool) -> bool:
        """``arm`` is ``z`` standard errors behind the other."""
        if not self.arms[not arm].count:
            return False
        gap = self.rate(not arm) - self.rate(arm)
        return gap > self.z * (self.error(arm) ** 2 + self.error(not arm) ** 2) ** 0.5


# -- the policy the decoding loop asks -------------------------------------------------


@attrs.frozen(kw_only=True, eq=False)
class Selection:
    """What a step verifies: ``tree`` (the root and the kept candidates, every parent
    before its children); ``likely``: nodes of ``tree`` likely to be visited, whose
    LM-head rows are computed with the root's; ``choice``: the cost model's choice
    (None with fixed trees)."""

    tree: DraftTree
    likely: tuple[int, ...] = ()
    choice: Choice | None = None


@attrs.frozen(kw_only=True, eq=False)
class StepFacts:
    """What one committed step tells the speculation policy.

    tree and verdict: what was verified and accepted; context: committed positions the
    verify forward attended over; forward_seconds: what it took; step_seconds: the
    whole step; proposing_seconds: what each source that proposed took (the sources
    that proposed are its keys); drafting_pass: whether a pass of the root over a
    partial view ran (None: none was considered); view_seconds: what keeping the
    drafting view took (left out of what a pass and a speculative step cost); emitted: tokens emitted;
    catch_up_seconds: what the drafter's proposal spent on the text of earlier plain
    steps (part of proposing and step seconds: a cost of switching, not of speculating)."""

    tree: DraftTree
    verdict: Verdict
    context: int
    forward_seconds: float
    step_seconds: float
    proposing_seconds: Mapping[int, float]
    drafting_pass: bool | None
    view_seconds: float
    emitted: int
    compile_seconds: float = 0.0
    catch_up_seconds: float = 0.0  # the drafter's catch-up on plain steps' text (Drafter.catch_up_seconds)


class Speculator:
    """Fixed trees: every proposer proposes every step, every candidate is verified (the
    first ``max_nodes`` of them, in the order proposed: the drafter's best first), a
    drafter that asks for a pass of the root gets it over any view (the whole context
    included), and nothing is learnt. The base of :class:`AutoSpeculator`, which
    chooses each step's tree (``speculation.tree = "auto"``)."""

    costs: CostModel | None = None

    def __init__(self, max_nodes: int | None = None) -> None:
        self.max_nodes = max_nodes

    def proposers(self) -> tuple[int, ...]:
        """The sources (:data:`~tokenswift.tree.DRAFTER`, :data:`~tokenswift.tree.RETRIEVER`)
        that propose this step."""
        return (DRAFTER, RETRIEVER)

    def run_pass(self, partial_view: bool, *, view: int | None = None, context: int | None = None) -> bool:
        """Whether the drafter's pass of the root runs this step over its drafting view
        (``partial_view``: the view holds less than the whole context; ``view``: the
        positions it holds and ``context`` the committed ones, where known)."""
        return True

    def select(self, candidates: DraftTree, proposers: tuple[int, ...], context: int) -> Selection:
        """The tree to verify over ``context`` committed positions."""
        if self.max_nodes is not None and len(candidates) - 1 > self.max_nodes:
            # Nodes are numbered as added, every parent before its children: a prefix is a subtree.
            return Selection(tree=candidates.subtree(range(self.max_nodes + 1)))
        return Selection(tree=candidates)

    def learn(self, facts: StepFacts) -> None:
        """What a committed step teaches the policy."""


GUARD_STEPS = 64  # the speculative steps whose drawn / expected tokens scale the guard's count
GUARD_PRIOR = 32.0  # tokens counted as both drawn and expected in that scale
# The first steps whose proposers ran are not judged by the guard: the drafter drafts
# its configured depth until it has seen what the choice verifies (eagle's LevelEconomy:
# 8 proposals), and the trees' graphs run their first calls. On a 2-core AMD EPYC Zen 3
# (eagle, greedy, 2K prompt, compiled) those proposals took 8.8-13.9 ms against 2-4
# later, their trees' forwards 30-42 ms against ~27. Judged, they can set the speculative
# arm's rate under the plain one's for the rest of a run: the guard draws an arm far
# behind again about once a half-life (20 s), and with its first 8 speculative steps at
# 1.5x the time, a simulated guard kept plain steps to the end of every one of 60 runs of
# 600 steps whose speculative steps earned 8% or 15% more tokens a second after them.
# One of those runs (eagle, the Zen 3) speculated in 80 of 512 steps, another in 269.
GUARD_WARM_UP = 8


class AutoSpeculator(Speculator):
    """Each step's tree chosen by expected tokens per predicted second: the
    :class:`AcceptanceTracker` corrects the proposers' confidences, the
    :class:`CostModel` predicts the forward, a :class:`DraftGate` per proposer skips
    one whose candidates have not paid, and two :class:`RateChooser` s decide by
    tokens per second whether to speculate at all (the tokens a speculative step's tree
    was expected to emit; only with ``plain_guard``) and whether a drafting pass over a
    partial view pays (the tokens realised). At most
    ``max_nodes`` nodes below the root (0: plain steps only).

    The first chooser is the guard of "never slower than plain steps" (judging no step
    of its first ``warm_up`` whose proposers ran: :data:`GUARD_WARM_UP`): the gates and the
    cost model price what they see (forwards, proposals), not the scoring of more
    nodes, the drafter's bookkeeping or the loop's. On a 2-core AMD EPYC Zen 4 (2K
    prompt, compiled, greedy) ``eagle`` steps took 34.1 ms for 1.67 tokens where the
    cost model predicted 25.4, and the preset ran at 0.95-0.99x compiled ``ar``."""

    def __init__(
        self, costs: CostModel, max_nodes: int, *, plain_guard: bool = True, pass_gain: float = PASS_GAIN,
        warm_up: int = GUARD_WARM_UP,
    ) -> None:
        super().__init__(max_nodes)
        self.costs = costs
        self.pass_gain = pass_gain
        self.tracker = AcceptanceTracker()
        self.speculating = RateChooser(first=False) if plain_guard else None
        self.passes = RateChooser()
        self.gates = {DRAFTER: DraftGate(), RETRIEVER: DraftGate()}
        self._speculates: bool | None = None  # this step's arm of ``speculating``
        self._warm_up = warm_up  # steps whose proposers ran still to pass unjudged (GUARD_WARM_UP)
        # (emitted, expected) tokens of the last speculative steps the guard judged
        self._guard_window: collections.deque[tuple[float, float]] = collections.deque(maxlen=GUARD_STEPS)

    def proposers(self) -> tuple[int, ...]:
        if not self.max_nodes:
            return ()
        self._speculates = self.speculating.pick() if self.speculating is not None else None
        if self._speculates is False:
            return ()
        return tuple(source for source in (DRAFTER, RETRIEVER) if self.gates[source].draft())

    def run_pass(self, partial_view: bool, *, view: int | None = None, context: int | None = None) -> bool:
        # Over the whole context the pass computes what the verify forward computes for
        # the root: it is run only over a partial view that pays.
        if not partial_view:
            return False
        if view is not None and context is not None and not self.pass_can_pay(view, context):
            return False
        return self.passes.pick()

    def pass_can_pay(self, view: int, context: int) -> bool:
        """Whether a pass over ``view`` positions can pay at ``context``: it costs a
        one-token forward over the view, and it can only pay if it costs less than
        what ``pass_gain`` tokens (``spec.PASS_GAIN`` by default) cost at the context,
        priced as plain one-token forwards there (a step that pays undercuts them: the
        bound errs toward trying). Where it cannot, the pass chooser never tries one:
        on a 2-core AMD EPYC Zen 4 at 8K positions a pass over the 4,096-position view
        took ~20 ms, a whole ``ar`` step; its trials and the view's first refresh
        (0.2-0.3 s) left the default preset ~10% behind ``eagle`` over 256 tokens, and
        no pass paid."""
        return self.costs.forward_seconds(1, view) < self.pass_gain * self.costs.forward_seconds(1, context)

    def select(self, candidates: DraftTree, proposers: tuple[int, ...], context: int) -> Selection:
        explore = tuple(source for source in proposers if self.gates[source].exploring) if self.max_nodes else ()
        choice = choose(candidates, self.tracker, self.costs, context, self.max_nodes, explore=explore)
        node_of = {candidate: node for node, candidate in enumerate(choice.keep)}  # subtree(keep)'s numbering
        rows = self.costs.one_product_rows
        likely_candidates = choice.likeliest(rows - 1) if rows else choice.likely_path(candidates)
        likely = tuple(node_of[candidate] for candidate in likely_candidates)
        return Selection(tree=candidates.subtree(choice.keep), likely=likely, choice=choice)

    def _guard_tokens(self, expected: float | None, emitted: int) -> float:
        """The tokens the plain guard counts for a step: a plain step's own (``expected``
        None); a speculative step's expected tokens (its tree's chances), scaled by what the last
        :data:`GUARD_STEPS` speculative steps emitted against what they were expected to.

        Which nodes are accepted is a draw that spreads one step's rate by ~35% (1 to 4
        tokens): judged by drawn tokens, the guard, telling a 10-20% gain from that
        spread, kept plain steps for 30-60% of a run (``eagle``, 2K prompt, greedy,
        compiled, in turns on a 2-core AMD EPYC Zen 4: 1.00-1.06x ``ar`` against 1.10x
        without the guard). The expectation alone is not honest everywhere: with the
        paper's sampling the tracker's rates expected 1.84 tokens a step where 1.63
        came (greedy 1.78 against 1.84), and the guard speculated where plain steps
        paid more. Scaled, the count keeps the drawn tokens' mean over the window (less
        :data:`GUARD_PRIOR` tokens taken as foreseen: the first steps' few draws do not
        set the scale) and the expectation's step-to-step shape. Scaled by the drawn
        tokens from the first step, the guard read a run's first three unlucky steps as
        the arm's rate and kept plain steps to its end (a simulated run, 14% gain)."""
        if expected is None:  # a plain step
            return float(emitted)
        self._guard_window.append((float(emitted), expected))
        drawn = sum(e for e, _ in self._guard_window) + GUARD_PRIOR
        foreseen = sum(x for _, x in self._guard_window) + GUARD_PRIOR
        return expected * drawn / foreseen

    def learn(self, facts: StepFacts) -> None:
        tree, verdict = facts.tree, facts.verdict
        # what the verified tree was expected to emit, before its own outcome is counted (the guard's count)
        expected = sum(chances(tree, self.tracker)) if self.speculating is not None and len(tree) > 1 else None
        self.tracker.observe(tree, verdict.accepted)
        if facts.compile_seconds > 0:  # a graph compiled in this step: its times teach nothing
            self._speculates = None
            return
        # Each accepted token saves a one-token forward; the tree's extra forward time is
        # shared among the proposers by their verified nodes; proposing cost what it took.
        one_token = self.costs.forward_seconds(1, facts.context)
        extra = max(0.0, facts.forward_seconds - one_token) / max(len(tree) - 1, 1)
        for source, proposing in facts.proposing_seconds.items():
            verified = sum(1 for node in tree.sources[1:] if node == source)
            accepted = sum(1 for node in verdict.accepted if tree.sources[node] == source)
            if source == DRAFTER:
                proposing -= facts.catch_up_seconds
            self.gates[source].observe(accepted * one_token - verified * extra - proposing)
        self.costs.observe_forward(len(tree), facts.context, facts.forward_seconds)
        if facts.drafting_pass is not None:
            self.passes.observe(facts.drafting_pass, facts.emitted, facts.step_seconds - facts.view_seconds)
        if self._speculates is not None:
            # proposers ran and the tree choice kept none of their nodes: nothing to earn
            futile = bool(self._speculates and facts.proposing_seconds and len(tree) == 1)
            # Catching up on the plain steps' text is paid once per switch to speculating:
            # the steps that speculate are judged without it. Held against them, it made
            # the first step of each of the guard's trials of 4 steps 2-17 ms dearer than
            # a steady ~2 ms (3-129 pairs; ``eagle``, 2K prompt, greedy, a 2-core AMD
            # EPYC Zen 4, whose speculative steps take ~27-30 ms). So is keeping the
            # drafting view, as the pass chooser judges passes: its first refresh at 32K
            # positions (~0.43 s on that CPU) made the first speculative step of a
            # ``tokenswift`` run take 506 ms against ~43 for a plain one, and the guard
            # kept plain steps for the rest of a 256-token run (0.965x ``ar``).
            seconds = facts.step_seconds - facts.catch_up_seconds - facts.view_seconds
            tokens = self._guard_tokens(expected, facts.emitted)
            if self._speculates and facts.proposing_seconds and self._warm_up > 0:
                self._warm_up -= 1  # a step of the warm-up (GUARD_WARM_UP): not judged
            else:
                self.speculating.observe(self._speculates, tokens, seconds, futile=futile)
            self._speculates = None
