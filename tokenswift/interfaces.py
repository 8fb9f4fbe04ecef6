"""The five component interfaces. One role each:

* :class:`Drafter` proposes branches below the root (heads, extra forwards);
* :class:`Retriever` proposes branches from the text so far (n-grams, lookups);
* :class:`CachePolicy` chooses the KV view drafting forwards attend over;
* :class:`Penalty` transforms each tree node's logits with that node's own context;
* :class:`Verifier` walks the scored tree and decides the accepted path and bonus token.

Every component class has an ``Options`` attrs class (its validated options, with
defaults) and is built as ``Component(options, context)``. Components may change
speed, never the output distribution: the property tests in ``tokenswift.testing``
hold every one of them to that.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

if TYPE_CHECKING:
    from tokenswift.model.kv import KVView
    from tokenswift.model.runner import ForwardOutput, Runner
    from tokenswift.sampling import Sampler
    from tokenswift.scoring import NodeScores
    from tokenswift.spec import PipelineSpec
    from tokenswift.tree import DraftTree


@attrs.frozen(kw_only=True)
class NoOptions:
    """A component without options."""


@attrs.define(kw_only=True, eq=False)
class BuildContext:
    """What a component may look at when it is built. ``penalty`` is the pipeline's
    penalty component (built first, so the others may rank candidates with it)."""

    spec: PipelineSpec
    runner: Runner
    tokenizer: object | None = None
    penalty: Penalty | None = None


@attrs.define(kw_only=True, eq=False, repr=False)
class DecodeState:
    """The state of one generation, shared by the components.

    tokens: every committed token id (prompt, then generated); the last one is the
    root of the next tree and has no KV yet.
    last_output: the latest verify forward; last_accepted: the tree node whose
    logits produced the bonus token (its hidden state is ``last_output.hidden[i]``).
    """

    tokens: list[int]
    prompt_length: int
    runner: Runner
    step: int = 0
    last_tree: DraftTree | None = None
    last_output: ForwardOutput | None = None
    last_accepted: int = 0

    def __repr__(self) -> str:
        return f"DecodeState(tokens={len(self.tokens)}, prompt={self.prompt_length}, step={self.step})"

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length


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

    def observe(self, state: DecodeState, new_tokens: list[int]) -> None:
        """Tokens were committed (already appended to ``state.tokens``)."""

    @property
    def max_tree_nodes(self) -> int:
        """The most tree nodes (root excluded) this component may add in one step."""
        return 0


class Drafter(Component):
    @abc.abstractmethod
    def propose(self, state: DecodeState, view: KVView | None) -> list[list[int]]:
        """Branches (token sequences) below the root, best first."""


class Retriever(Component):
    @abc.abstractmethod
    def retrieve(self, state: DecodeState, first_tokens: list[int]) -> list[list[int]]:
        """Branches below the root; ``first_tokens`` are the drafter's depth-1 candidates."""


class CachePolicy(Component):
    @abc.abstractmethod
    def drafting_view(self, state: DecodeState) -> KVView | None:
        """The KV view a drafting forward attends over (None: the full store)."""


class Penalty(Component):
    @property
    def window(self) -> int:
        """How many recent context tokens :meth:`apply` needs (0: none)."""
        return 0

    @abc.abstractmethod
    def apply(self, contexts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """contexts: [n, W] long, each node's last W context tokens (committed tokens,
        then its ancestors, then itself), rows shorter than W padded with a repeat of a
        token already in the row; scores: [n, vocab]. Returns the penalised scores."""


class Verifier(Component):
    @abc.abstractmethod
    def verify(self, tree: DraftTree, scores: NodeScores, sampler: Sampler) -> Verdict:
        """``scores[node]`` gives a node's processed logits ([vocab]: penalty and warpers
        applied with that node's own context), computed on first use."""
