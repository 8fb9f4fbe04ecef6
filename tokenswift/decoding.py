"""One generation: the prompt's prefill, then the decoding loop, one step at a time.

A step (``Generation.steps``; gpt-fast's ``generate.py`` is the model):

1. propose  the drafter gives branches below the root (the last committed token) from
            the previous forward's hidden state or from a pass of the root over the
            cache policy's drafting view; the retriever adds branches from the text;
            all are merged into one :class:`~tokenswift.tree.DraftTree`, and the
            candidates worth verifying here and now are kept (:mod:`tokenswift.speculation`;
            all of them with ``speculation.tree = "fixed"``);
2. score    one forward of the tree over the full KV; a node's processed scores
            (penalty, then warpers, with the node's own context) are computed when the
            verifier first asks for them (:class:`~tokenswift.scoring.NodeScores`);
3. verify   the verifier walks the tree from the root: the accepted path + a bonus token;
4. commit   the KV keeps the root and the accepted path; the tokens are appended and
            every component observes the step.

Each step yields a :class:`~tokenswift.stats.StepRecord`; streaming, checkpoints,
progress bars, plugin hooks and statistics are consumers of those records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from tokenswift.checkpoint import Checkpoint
from tokenswift.errors import NonFiniteScoresError
from tokenswift.interfaces import DecodeState, DraftInputs, StepOutcome, Verdict
from tokenswift.model.kv import FullView
from tokenswift.model.runner import PrefilledPrompt
from tokenswift.sampling import Sampler
from tokenswift.scoring import NodeScores
from tokenswift.speculation import AcceptanceTracker, Choice, DraftGate, PassChooser, choose
from tokenswift.stats import StageClock, StepRecord
from tokenswift.tree import DRAFTER, RETRIEVER, DraftTree

if TYPE_CHECKING:
    from tokenswift.pipeline import Pipeline

logger = logging.getLogger(__name__)


class Generation:
    """The state and loop of one generation with a pipeline's model and components.

    ``done_tokens`` are new tokens already generated (a resumed checkpoint); the
    ``generator`` must then be in the state the checkpoint saved.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        seed: int,
        generator: torch.Generator,
        ignore_eos: bool,
        done_tokens: list[int] | None = None,
        finish_reason: str | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.generator = generator
        self.ignore_eos = ignore_eos
        self.eos = set() if ignore_eos else pipeline.eos_token_ids()
        self.sampler = Sampler(pipeline.spec.sampling.greedy, generator)
        self.state = DecodeState(tokens=self.prompt_ids + list(done_tokens or []), prompt_length=len(self.prompt_ids))
        self.finish_reason = finish_reason or "length"
        self.started = time.perf_counter()
        self.prefill_seconds = 0.0
        self.parent_hidden: torch.Tensor | None = None  # [hidden_size], gave the current root token
        # Each step's tree chosen by expected tokens per predicted second, unless the spec
        # fixes it (or ranks must agree on trees without timings: under torchrun).
        self.costs = pipeline.costs() if pipeline.spec.speculation.tree == "auto" else None
        auto = self.costs is not None
        self.tracker = AcceptanceTracker() if auto else None
        self.passes = PassChooser() if auto else None
        self.gates = {DRAFTER: DraftGate(), RETRIEVER: DraftGate()} if auto else None
        self.proposing_seconds = {DRAFTER: 0.0, RETRIEVER: 0.0}  # what each proposer took this step
        self.proposers: list[int] = []  # the sources that proposed this step
        self.view_seconds = 0.0  # what keeping the drafting view took this step
        # What a checkpoint resumes from: committed tokens and the generator after their draws.
        self._committed = (len(self.state.tokens), generator.get_state())
        self._prefilled = finish_reason is not None  # a finished checkpoint needs no forward
        self.compiled = False  # one-token forwards compiled (decided at the prefill)
        self._compile_seconds_before = 0.0

    # -- results --------------------------------------------------------------------

    @property
    def compile_seconds(self) -> float:
        """What compiling took during this run (the first compiled forwards)."""
        compiled = self.pipeline.runner.compiled
        return compiled.compile_seconds - self._compile_seconds_before if self.compiled and compiled is not None else 0.0

    @property
    def new_tokens(self) -> list[int]:
        """The tokens generated so far (committed steps only)."""
        return self.state.tokens[len(self.prompt_ids) : self._committed[0]]

    def checkpoint(self, finish_reason: str | None = None) -> Checkpoint:
        """Everything needed to continue this generation exactly, as of its last committed step."""
        length, rng_state = self._committed
        return Checkpoint(
            spec=self.pipeline.spec.to_dict(),
            prompt_tokens=list(self.prompt_ids),
            tokens=self.state.tokens[len(self.prompt_ids) : length],
            seed=self.seed,
            rng_state=bytes(rng_state.tolist()),
            max_new_tokens=self.max_new_tokens,
            ignore_eos=self.ignore_eos,
            finish_reason=finish_reason,
        )

    # -- the loop -------------------------------------------------------------------

    def prefill(self, prefilled: PrefilledPrompt | None = None) -> None:
        """Allocate the KV store and forward the context except its last token (the
        first root), or copy it from ``prefilled`` (the same prompt, prefilled once for
        several runs); start the components."""
        pipeline, runner = self.pipeline, self.pipeline.runner
        self.compiled = pipeline.prepare_compiled(len(self.prompt_ids) + self.max_new_tokens // 2, self.max_new_tokens - self.state.generated)
        self._compile_seconds_before = runner.compiled.compile_seconds if runner.compiled is not None else 0.0
        started = time.perf_counter()
        runner.allocate(len(self.prompt_ids) + self.max_new_tokens + pipeline.max_tree_nodes())
        wanted = pipeline.drafter.prompt_features
        if prefilled is None:
            hidden = runner.prefill(torch.tensor(self.state.tokens[:-1], dtype=torch.long), keep_hidden=max(1, wanted))
        else:
            if list(prefilled.tokens) != self.state.tokens:
                raise ValueError("prefill: the prefilled prompt is not this run's context")
            runner.restore(prefilled)
            hidden = prefilled.hidden
            kept = 0 if hidden is None else hidden.shape[0]
            if hidden is not None and kept < min(max(1, wanted), prefilled.positions):
                raise ValueError(f"prefill: the drafter wants {wanted} prompt features, the prefilled prompt kept {kept}")
            hidden = None if hidden is None else hidden[-max(1, wanted):]
        self.parent_hidden = None if hidden is None else hidden[-1]
        for component in pipeline.components:
            component.start(self.state)
        if wanted:
            pipeline.drafter.prime(self.state, hidden)
        self.prefill_seconds = time.perf_counter() - started
        self._prefilled = True

    def steps(self) -> Iterator[StepRecord]:
        """Decode until ``max_new_tokens`` or EOS, yielding each committed step.
        Afterwards :attr:`finish_reason` says why it stopped."""
        if not self._prefilled:
            self.prefill()
        pipeline, state = self.pipeline, self.state
        runner, verifier, sampler = pipeline.runner, pipeline.verifier, self.sampler
        clock = StageClock(runner.device)
        while state.generated < self.max_new_tokens and self.finish_reason == "length":
            clock.start()
            candidates, proposers, drafting_pass = self.propose()
            tree, choice = self.select(candidates, proposers)
            clock.lap("propose")
            output = runner.forward(tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor(), logits_rows=None)
            likely = choice.likely_path(candidates) if choice is not None else ()
            scores = NodeScores(tree, output.hidden, runner, pipeline.scorer, state.tokens, with_root=likely)
            clock.lap("score")
            try:
                verdict = verifier.verify(tree, scores, sampler)
            except NonFiniteScoresError as exc:  # keep the text so far; the caller sees why it stopped
                logger.warning("stopping after %d new tokens: %s", state.generated, exc)
                self.finish_reason = "non-finite scores"
                return
            clock.lap("verify")
            context = runner.committed_length
            emitted, kept = self.commit(tree, verdict, output.hidden)
            clock.lap("commit")
            self.learn(tree, verdict, context, clock.seconds, drafting_pass, len(emitted))
            yield StepRecord(
                step=state.step,
                candidates=len(candidates) - 1,
                tree_size=len(tree) - 1,
                depth=tree.depth,
                accepted=len(kept),
                retrieved=sum(1 for node in kept if tree.sources[node] == RETRIEVER),
                emitted=emitted,
                generated=state.generated,
                seconds=time.perf_counter() - self.started,
                stage_seconds=dict(clock.seconds),
                drafting_pass=bool(drafting_pass),
                predicted_tokens=None if choice is None else choice.expected_tokens,
                predicted_seconds=None if choice is None else choice.seconds,
                forward_seconds=clock.seconds["score"],
            )

    def propose(self) -> tuple[DraftTree, list[int], bool | None]:
        """The candidates of the next step: drafter branches, then retriever branches
        (each unless its gate is closed: its drafts have been going unverified). Also
        says which of the two proposed, and whether a drafting pass ran (None: none
        was considered)."""
        pipeline, state = self.pipeline, self.state
        tree = DraftTree.root_only(state.tokens[-1])
        proposers = [source for source in (DRAFTER, RETRIEVER) if self.gates is None or self.gates[source].draft()]
        started = time.perf_counter()
        drafting_pass = self.draft(tree) if DRAFTER in proposers else None
        drafted = time.perf_counter()
        if RETRIEVER in proposers:
            first_tokens = [tree.tokens[child] for child in tree.children(0).values()]
            tree.add_branches(pipeline.retriever.retrieve(state, first_tokens), source=RETRIEVER)
        self.proposing_seconds = {DRAFTER: drafted - started, RETRIEVER: time.perf_counter() - drafted}
        return tree, proposers, drafting_pass

    def draft(self, tree: DraftTree) -> bool | None:
        """Add the drafter's branches to ``tree``; says whether a drafting pass ran."""
        pipeline, state, runner = self.pipeline, self.state, self.pipeline.runner
        root_token = state.tokens[-1]
        inputs = DraftInputs(parent_hidden=self.parent_hidden)
        drafting_pass = None
        if pipeline.drafter.needs_root_pass:
            started = time.perf_counter()
            view = pipeline.cache_policy.drafting_view(state)
            # Keeping the view (and refreshing it, a full forward now and then) is paid
            # whether or not a pass runs: it is no part of what a pass costs.
            self.view_seconds = time.perf_counter() - started
            # Over the whole context the pass computes what the verify forward computes
            # for the root: with chosen trees it is run only over a partial view that pays.
            drafting_pass = self.passes is None or (view is not None and self.passes.run_pass())
            if drafting_pass:
                root = runner.forward(torch.tensor([root_token]), view=view if view is not None else FullView(runner.store))
                inputs = DraftInputs(parent_hidden=self.parent_hidden, root=root, root_exact=view is None)
        tree.add_branches(pipeline.drafter.propose(state, inputs))
        return drafting_pass

    def select(self, candidates: DraftTree, proposers: list[int]) -> tuple[DraftTree, Choice | None]:
        """The tree to verify: the candidates worth it here and now (all of them, and no
        choice, with fixed trees)."""
        if self.tracker is None:
            return candidates, None
        max_nodes = self.pipeline.spec.speculation.max_nodes
        explore = tuple(source for source in proposers if self.gates[source].exploring) if max_nodes else ()
        choice = choose(candidates, self.tracker, self.costs, self.pipeline.runner.committed_length, max_nodes, explore=explore)
        self.proposers = proposers
        return candidates.subtree(choice.keep), choice

    def learn(self, tree: DraftTree, verdict: Verdict, context: int, seconds: dict, drafting_pass: bool | None, emitted: int) -> None:
        """What a step teaches the tree choice (with fixed trees: nothing): which nodes
        were accepted, what the forward cost, what each proposer earned, and what a
        drafting pass did."""
        if self.tracker is None:
            return
        self.tracker.observe(tree, verdict.accepted)
        # Each accepted token saves a one-token forward; the tree's extra forward time is
        # shared among the proposers by their verified nodes; proposing cost what it took.
        one_token = self.costs.forward_seconds(1, context)
        extra = max(0.0, seconds["score"] - one_token) / max(len(tree) - 1, 1)
        for source in self.proposers:
            verified = sum(1 for node in tree.sources[1:] if node == source)
            accepted = sum(1 for node in verdict.accepted if tree.sources[node] == source)
            self.gates[source].observe(accepted * one_token - verified * extra - self.proposing_seconds[source])
        self.costs.observe_forward(len(tree), context, seconds["score"])
        if drafting_pass is not None:
            self.passes.observe(drafting_pass, emitted, sum(seconds.values()) - self.view_seconds)

    def commit(self, tree: DraftTree, verdict: Verdict, hidden: torch.Tensor) -> tuple[list[int], list[int]]:
        """Keep the root and the accepted path in the KV, append the emitted tokens (cut
        at ``max_new_tokens`` and EOS) and let the components observe the step.
        hidden: [len(tree), hidden_size]. Returns (emitted tokens, accepted nodes kept)."""
        pipeline, state = self.pipeline, self.state
        pipeline.runner.commit([0, *verdict.accepted])
        emitted = [tree.tokens[node] for node in verdict.accepted] + [verdict.bonus]
        emitted = emitted[: self.max_new_tokens - state.generated]
        for i, token in enumerate(emitted):
            if token in self.eos:
                emitted = emitted[: i + 1]
                self.finish_reason = "eos"
                break
        outcome = StepOutcome(emitted=emitted, tree=tree, accepted=list(verdict.accepted), hidden=hidden)
        state.tokens.extend(emitted)
        state.step += 1
        self._committed = (len(state.tokens), self.generator.get_state())
        self.parent_hidden = hidden[outcome.bonus_parent]
        for component in pipeline.components:
            component.observe(state, outcome)
        return emitted, verdict.accepted[: len(emitted)]
