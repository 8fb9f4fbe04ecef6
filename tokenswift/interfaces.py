"""The five component interfaces. One role each:

* :class:`Drafter` proposes branches below the root (from heads, from a drafting pass);
* :class:`Retriever` proposes branches from the text so far (n-grams, lookups);
* :class:`CachePolicy` chooses the KV view a drafting pass attends over;
* :class:`Penalty` transforms each tree node's logits with that node's own context;
* :class:`Verifier` walks the scored tree and decides the accepted path and bonus token.

Every component class has an ``Options`` attrs class (its validated options, with
defaults) and is built as ``Component(options, context)``. What a component needs
from a step it receives through its methods (:class:`DraftInputs`, which also lets a
drafter ask for a pass of the root over the drafting view, and :class:`StepOutcome`);
the model it reaches only through ``context.runner``. Components may change speed, never the output distribution: the
property tests in :mod:`tokenswift.testing` hold every one of them to that.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

if TYPE_CHECKING:
    from tokenswift.model.kv import KVView
    from tokenswift.model.runner import ForwardOutput, Runner
    from tokenswift.sampling import Sampler
    from tokenswift.scoring import NodeScores, Scorer
    from tokenswift.spec import PipelineSpec
    from tokenswift.tree import Branch, DraftTree


@attrs.frozen(kw_only=True)
class NoOptions:
    """A component without options."""


@attrs.define(kw_only=True, eq=False)
class BuildContext:
    """What a component may look at when it is built: the spec, the model's runner, the
    tokenizer, and the pipeline's :class:`~tokenswift.scoring.Scorer` (penalty and
    warpers; built first, so it is None only while the penalty itself is built)."""

    spec: PipelineSpec
    runner: Runner
    tokenizer: object | None = None
    scorer: Scorer | None = None

    @property
    def penalty(self) -> Penalty | None:
        return None if self.scorer is None else self.scorer.penalty


@attrs.define(kw_only=True, eq=False, repr=False)
class DecodeState:
    """The text of one generation, as components see it.

    tokens: every committed token id (prompt, then generated); the last one is the
    root of the next tree and has no KV yet.
    """

    tokens: list[int]
    prompt_length: int
    step: int = 0

    def __repr__(self) -> str:
        return f"DecodeState(tokens={len(self.tokens)}, prompt={self.prompt_length}, step={self.step})"

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length


@attrs.frozen(kw_only=True, eq=False)
class RootPass:
    """A forward of the root (the last committed token) over the cache policy's
    drafting view: ``output`` has logits [1, vocab], hidden [1, hidden_size] and the
    drafter's features [1, F] (:attr:`Drafter.feature_layers`);
    ``exact``: the view was the whole context, so its logits are the ones verification
    will draw the root's token from."""

    output: ForwardOutput
    exact: bool


def _no_root_pass() -> RootPass | None:
    return None


def _no_noise(depth: int) -> torch.Tensor | None:
    return None


def _no_noise_at(depth: int, ids: torch.Tensor) -> torch.Tensor | None:
    return None


def _no_draws(q: torch.Tensor, k: int, depth: int) -> list[int] | None:
    return None


@attrs.frozen(kw_only=True, eq=False)
class DraftInputs:
    """What a drafter may draft from.

    parent_hidden: [hidden_size], the final-norm hidden state of the position whose
    logits gave the root token (from the previous forward), or None.
    root_pass: call it to ask for a :class:`RootPass` (at most one forward a step,
    however often it is called): the cache policy's view is brought up to date, and the
    pass runs unless the speculation policy judges it does not pay this step (then it
    returns None; with fixed trees it always runs).
    noise: ``noise(depth)`` is the Gumbel noise [vocab] (float64) that the target's draw
    of the token at ``depth`` below the root (depth 1: right after it) adds to its
    scores, or None (greedy decoding, or a sampler without noise). A drafter that ranks
    that depth's candidates by ``log q + noise`` proposes the token the target's own
    draw lands on whenever its q agrees with the target's distribution near the top.
    noise_at: ``noise_at(depth, ids)``, that noise at token ``ids`` alone ([n] long ->
    [n] float64, or None): the keyed sampler computes just those entries, for a drafter
    that ranks its own vocabulary (:meth:`noise_of` falls back on ``noise``).
    draw_drafts: ``draw_drafts(q, k, depth)`` draws k distinct tokens from ``q`` ([vocab],
    summing to 1) without replacement, in order, for the children at ``depth`` of the
    node being expanded (siblings' draws at one depth may share numbers: only one node
    per depth is ever visited), or returns None (greedy decoding). A drafter returns
    what it drew as :class:`~tokenswift.tree.SampledChildren` with ``q``, for the
    ``rejection`` verifier; ``sampled`` says whether that verifier is the pipeline's
    (otherwise coupled top-k picks, ranked with ``noise``, are what gets accepted).
    """

    parent_hidden: torch.Tensor | None = None
    root_pass: Callable[[], RootPass | None] = _no_root_pass
    noise: Callable[[int], torch.Tensor | None] = _no_noise
    noise_at: Callable[[int, torch.Tensor], torch.Tensor | None] = _no_noise_at
    draw_drafts: Callable[[torch.Tensor, int, int], list[int] | None] = _no_draws
    sampled: bool = False

    def noise_of(self, depth: int, ids: torch.Tensor) -> torch.Tensor | None:
        """The noise at ``depth`` for token ``ids`` ([n] long) alone: ``noise_at``'s, or
        where it gives none, the entries of ``noise``'s vector."""
        at = self.noise_at(depth, ids)
        if at is not None:
            return at
        full = self.noise(depth)
        return None if full is None else full.to(ids.device)[ids]


@attrs.frozen(kw_only=True, eq=False)
class StepOutcome:
    """One committed step, as components observe it.

    emitted: the new tokens (accepted, then the bonus; cut at EOS / max_new_tokens);
    tree and accepted: the verified tree and its accepted nodes (root excluded);
    hidden: [len(tree), hidden_size], the verify forward's final-norm hidden states;
    features: [len(tree), F], what the drafter reads of the same rows
    (:func:`~tokenswift.model.runner.features` of its :attr:`Drafter.feature_layers`;
    ``hidden`` when it names none).
    """

    emitted: list[int]
    tree: DraftTree
    accepted: list[int]
    hidden: torch.Tensor
    features: torch.Tensor | None = None

    @property
    def bonus_parent(self) -> int:
        """The tree node whose logits gave the bonus token (the last accepted, or the root)."""
        return self.accepted[-1] if self.accepted else 0


@attrs.frozen(kw_only=True, eq=False)
class Verdict:
    """accepted: tree nodes (root excluded) on the agreeing path, in order;
    bonus: the token sampled after the last of them (from the root when none)."""

    accepted: list[int]
    bonus: int


class Component(abc.ABC):
    Options: ClassVar[type] = NoOptions

    def __init__(self, options, context: BuildContext) -> None:
        self.options = options
        self.context = context

    def start(self, state: DecodeState) -> None:
        """A generation starts: prompt prefilled, ``state.tokens`` is the prompt."""

    def observe(self, state: DecodeState, outcome: StepOutcome) -> None:
        """A step was committed (its tokens already appended to ``state.tokens``)."""

    @property
    def max_tree_nodes(self) -> int:
        """The most tree nodes (root excluded) this component may add in one step."""
        return 0


class Drafter(Component):
    @property
    def prompt_features(self) -> int:
        """How many of the prompt's last positions' features the drafter wants at
        :meth:`prime` (0: none; the prefill then keeps only the last)."""
        return 0

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Decoder layers whose outputs the drafter reads beside the final-norm state
        (transformers' ``hidden_states`` numbering); () for the final-norm state only.
        Forwards that read inner layers run eagerly."""
        return ()

    def prime(self, state: DecodeState, hidden: torch.Tensor | None) -> None:
        """After :meth:`start`, for a drafter with :attr:`prompt_features`: ``hidden`` is
        [m, F], the features of the m positions before the root (position p's gave
        token p+1; :func:`~tokenswift.model.runner.features`: the final-norm hidden
        state, preceded by the outputs of :attr:`feature_layers`), m <= prompt_features;
        None for a one-token context."""

    @abc.abstractmethod
    def propose(self, state: DecodeState, inputs: DraftInputs) -> list[list[int] | Branch]:
        """Branches (token lists, or :class:`~tokenswift.tree.Branch` with confidences)
        below the root, best first."""

    @property
    def catch_up_seconds(self) -> float:
        """What the last :meth:`propose` spent catching up on text committed by steps
        that asked for no proposal (plain steps): a cost of switching to speculation,
        paid once per switch, which the speculation policy does not hold against the
        steps that speculate (0.0: none, or a drafter that never falls behind)."""
        return 0.0

    def compile_now(self) -> float:
        """Compile now what this drafter's proposals run compiled (a benchmark does,
        before its timed turns); the seconds it took (0.0: nothing to compile)."""
        return 0.0


class Retriever(Component):
    @abc.abstractmethod
    def retrieve(self, state: DecodeState, first_tokens: list[int]) -> list[list[int] | Branch]:
        """Branches below the root; ``first_tokens`` are the drafter's depth-1 candidates."""


class CachePolicy(Component):
    @abc.abstractmethod
    def update_view(self, state: DecodeState) -> KVView | None:
        """Bring the KV view a drafting pass attends over up to date with the committed
        positions and return it (None: the whole context). Called once a step, before
        the pass, by a drafter asking for one; keeping the view may cost forwards of its
        own (a refresh)."""

    def view_positions(self, context_positions: int) -> int:
        """Positions of KV the policy keeps in buffers of its own, for a run of
        ``context_positions`` positions (0: it reads the store in place)."""
        return 0

    def partial(self, committed_positions: int) -> bool | None:
        """Whether the view over ``committed_positions`` holds less than all of them,
        answered without bringing it up to date (None: the policy cannot say so; its
        view is then kept at every step that asks for a pass, whether the pass runs or
        not). With an answer, :meth:`update_view` is only called at steps whose pass runs."""
        return None


class Penalty(Component):
    @property
    def window(self) -> int:
        """How many recent context tokens :meth:`apply` needs (0: none)."""
        return 0

    @abc.abstractmethod
    def apply(self, contexts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """contexts: [n, W] long, each row the last W tokens of that position's context
        (W = min(window, context length); committed tokens, then the node's ancestors,
        then the node itself); scores: [n, vocab]. Returns the penalised scores."""


class Verifier(Component):
    #: True: drafters should draw their candidates from their q and say so
    #: (:class:`~tokenswift.tree.SampledChildren`; ``DraftInputs.sampled``).
    wants_sampled_drafts: ClassVar[bool] = False

    @abc.abstractmethod
    def verify(self, tree: DraftTree, scores: NodeScores, sampler: Sampler) -> Verdict:
        """``scores[node]`` gives a node's processed scores ([vocab]: penalty and warpers
        applied with that node's own context), computed on first use."""
