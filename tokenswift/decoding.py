"""One generation: the prompt's prefill, then the decoding loop, one step at a time.

A step (``Generation.steps``; gpt-fast's ``generate.py`` is the model):

1. propose  the drafter gives branches below the root (the last committed token) from
            the previous forward's hidden state, or from a pass of the root over the
            cache policy's drafting view that it asks for through its inputs; the
            retriever adds branches from the text; all are merged into one
            :class:`~tokenswift.tree.DraftTree`, and the speculation policy
            (:mod:`tokenswift.speculation`) selects the candidates worth verifying
            here and now (all of them with ``speculation.tree = "fixed"``);
2. forward  one forward of the tree over the full KV; a node's processed scores
            (penalty, then warpers, with the node's own context) are computed when the
            verifier first asks for them (:class:`~tokenswift.scoring.NodeScores`);
3. verify   the verifier walks the tree from the root: the accepted path + a bonus token;
4. commit   the KV keeps the root and the accepted path; the tokens are appended, every
            component observes the step, and the speculation policy learns from it.

Each step yields a :class:`~tokenswift.stats.StepRecord`; streaming, checkpoints,
progress bars, plugin hooks and statistics are consumers of those records.

A :class:`Generation` decodes with a :class:`DecodingSetup`, everything prepared
before it starts (:meth:`tokenswift.pipeline.Pipeline.start`: costs measured or loaded,
the linear backend and the compile decision applied, the KV store sized); it never
reaches back into the pipeline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping

import attrs
import torch

from tokenswift.checkpoint import Checkpoint
from tokenswift.errors import NonFiniteScoresError
from tokenswift.health import LOOP_THRESHOLD, TextHealthMonitor
from tokenswift.interfaces import (
    CachePolicy, Component, DecodeState, Drafter, DraftInputs, Retriever, RootPass, StepOutcome, Verdict, Verifier,
)
from tokenswift.model.compiled import compiling_seconds
from tokenswift.model.kv import FullView
from tokenswift.model.runner import PrefilledPrompt, Runner, select_features
from tokenswift.sampling import STREAM_DRAFTS, make_sampler
from tokenswift.scoring import NodeScores, Scorer
from tokenswift.spec import SamplingSpec
from tokenswift.speculation import Speculator, StepFacts
from tokenswift.stats import StageClock, StepRecord
from tokenswift.tree import DRAFTER, RETRIEVER, DraftTree

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True, eq=False)
class DecodingSetup:
    """What a generation decodes with, all of it prepared.

    runner: the model's runner, its KV store allocated for the run; the five
    components and ``components`` (all of them, in build order); scorer: penalty and
    warpers; speculator: the speculation policy (fixed or chosen trees); sampling: how
    tokens are drawn (greedy, the sampler); eos: the tokens that end the run (empty with ``ignore_eos``);
    spec: the pipeline's spec as a dict (what a checkpoint records); compiled: one-token
    forwards were set to run compiled; sampled_drafts: the verifier wants drafts drawn
    from q (:attr:`~tokenswift.interfaces.Verifier.wants_sampled_drafts`)."""

    runner: Runner
    drafter: Drafter
    retriever: Retriever
    cache_policy: CachePolicy
    verifier: Verifier
    components: tuple[Component, ...]
    scorer: Scorer
    speculator: Speculator
    sampling: SamplingSpec
    eos: frozenset[int]
    spec: Mapping
    compiled: bool = False
    sampled_drafts: bool = False  # the verifier tests drafts against the q they were drawn from


class _RootPassRequest:
    """A drafter's way to ask for a pass of the root over the cache policy's drafting
    view (``DraftInputs.root_pass``): runs the pass unless the speculation policy judges
    it does not pay this step, over the view brought up to date first. Where the policy
    can say whether its view is partial without keeping it (:meth:`CachePolicy.partial`),
    the view is only kept for steps whose pass runs: the ``dynamic`` policy's refresh
    forwards the root over the whole context with attention recorded (~0.5 s at 32K
    positions on a 2-core AMD EPYC Zen 4), and it ran every ``recent`` positions while
    the pass chooser ran a pass in 2-3% of the steps. Asked once a step at most;
    remembers what it did for the step's facts."""

    def __init__(self, setup: DecodingSetup, state: DecodeState) -> None:
        self.setup, self.state = setup, state
        self.asked = False
        self.ran: bool | None = None  # None: no pass was considered
        self.view_seconds = 0.0
        self.result: RootPass | None = None

    def __call__(self) -> RootPass | None:
        if self.asked:
            return self.result
        self.asked = True
        setup = self.setup
        partial = setup.cache_policy.partial(setup.runner.committed_length)
        kept, view = partial is None, None
        if kept:  # only keeping the view tells: kept at every step
            view = self._keep_view()
            partial = view is not None
        committed = setup.runner.committed_length
        positions = setup.cache_policy.view_positions(committed) or None  # None: the policy does not say
        self.ran = setup.speculator.run_pass(partial_view=partial, view=positions, context=committed)
        if self.ran and partial and not kept:
            view = self._keep_view()
        if self.ran:
            runner = setup.runner
            output = runner.forward(
                torch.tensor([self.state.tokens[-1]]), view=view if view is not None else FullView(runner.store),
                layers=setup.drafter.feature_layers,  # a drafter on fused features reads them of the root too
            )
            self.result = RootPass(output=output, exact=view is None)
        return self.result

    def _keep_view(self):
        """The policy's view brought up to date (None: the whole context). What that
        takes (a refresh now and then) is no part of what a pass costs: the pass
        chooser judges passes without it, as the guard judges speculation without a
        drafter's catch-up."""
        started = time.perf_counter()
        view = self.setup.cache_policy.update_view(self.state)
        self.view_seconds = time.perf_counter() - started
        return view


class Generation:
    """The state and loop of one generation.

    ``done_tokens`` are new tokens already generated (a resumed checkpoint); the
    ``generator`` must then be in the state the checkpoint saved.
    """

    def __init__(
        self,
        setup: DecodingSetup,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        seed: int,
        generator: torch.Generator,
        ignore_eos: bool,
        done_tokens: list[int] | None = None,
        finish_reason: str | None = None,
        loop_threshold: float = LOOP_THRESHOLD,
    ) -> None:
        self.setup = setup
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.generator = generator
        self.ignore_eos = ignore_eos
        self.sampler = make_sampler(setup.sampling, seed=seed, generator=generator)
        self.state = DecodeState(tokens=self.prompt_ids + list(done_tokens or []), prompt_length=len(self.prompt_ids))
        self.finish_reason = finish_reason or "length"
        # what the text has become: distinct-n and the model's own NLL of what it emitted
        self.health = TextHealthMonitor(loop_threshold=loop_threshold)
        self.health.prime(done_tokens or [])
        self.started = time.perf_counter()
        self.prefill_seconds = 0.0
        self.parent_hidden: torch.Tensor | None = None  # [hidden_size], gave the current root token
        # Where a checkpoint resumes from: the committed tokens and the generator after their draws.
        self._resume_point = (len(self.state.tokens), generator.get_state())
        self._prefilled = finish_reason is not None  # a finished checkpoint needs no forward
        self._compile_clock_before = compiling_seconds()

    # -- results --------------------------------------------------------------------

    @property
    def compiled(self) -> bool:
        """One-token forwards ran compiled (set so, and no compile failed)."""
        return self.setup.compiled and self.setup.runner.compiled is not None

    @property
    def compile_seconds(self) -> float:
        """What compiling took during this run: every graph's first call, the target's
        and the drafter's (the ``eagle`` draft level's ~1 s on a 2-core AMD EPYC Zen 4
        was missing from the summary)."""
        return compiling_seconds() - self._compile_clock_before

    @property
    def new_tokens(self) -> list[int]:
        """The tokens generated so far (committed steps only)."""
        return self.state.tokens[len(self.prompt_ids) : self._resume_point[0]]

    def checkpoint(self, finish_reason: str | None = None) -> Checkpoint:
        """Everything needed to continue this generation exactly, as of its last committed step."""
        length, rng_state = self._resume_point
        return Checkpoint(
            spec=dict(self.setup.spec),
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
        """Forward the context except its last token (the first root) into the KV store,
        or copy it from ``prefilled`` (the same prompt, prefilled once for several
        runs); start the components."""
        setup, runner = self.setup, self.setup.runner
        started = time.perf_counter()
        runner.store.reset()
        wanted, layers = setup.drafter.prompt_features, setup.drafter.feature_layers
        if prefilled is None:
            hidden = runner.prefill(
                torch.tensor(self.state.tokens[:-1], dtype=torch.long), keep_hidden=max(1, wanted), layers=layers
            )
        else:
            if list(prefilled.tokens) != self.state.tokens:
                raise ValueError("prefill: the prefilled prompt is not this run's context")
            runner.restore(prefilled)
            hidden = prefilled.hidden
            kept = 0 if hidden is None else hidden.shape[0]
            if hidden is not None and kept < min(max(1, wanted), prefilled.positions):
                raise ValueError(f"prefill: the drafter wants {wanted} prompt features, the prefilled prompt kept {kept}")
            hidden = None if hidden is None else select_features(hidden[-max(1, wanted):], prefilled.layers, layers)
        self.parent_hidden = None if hidden is None else select_features(hidden[-1], layers, ())  # the final-norm state
        for component in setup.components:
            component.start(self.state)
        if wanted:
            setup.drafter.prime(self.state, hidden)
        self.prefill_seconds = time.perf_counter() - started
        self._prefilled = True

    def steps(self) -> Iterator[StepRecord]:
        """Decode until ``max_new_tokens`` or EOS, yielding each committed step.
        Afterwards :attr:`finish_reason` says why it stopped."""
        if not self._prefilled:
            self.prefill()
        setup, state = self.setup, self.state
        runner, speculator = setup.runner, setup.speculator
        clock = StageClock(runner.device)
        while state.generated < self.max_new_tokens and self.finish_reason == "length":
            clock.start()
            compiling_before = compiling_seconds()
            candidates, proposing, root_pass = self.propose()
            context = runner.committed_length
            selection = speculator.select(candidates, tuple(proposing), context)
            tree = selection.tree
            clock.lap("propose")
            output = runner.forward(
                tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor(), logits_rows=None,
                layers=setup.drafter.feature_layers,
            )
            scores = NodeScores(tree, output.hidden, runner, setup.scorer, state.tokens, with_root=selection.likely)
            clock.lap("forward")
            try:
                verdict = setup.verifier.verify(tree, scores, self.sampler)
            except NonFiniteScoresError as exc:  # keep the text so far; the caller sees why it stopped
                logger.warning("stopping after %d new tokens: %s", state.generated, exc)
                self.finish_reason = "non-finite scores"
                return
            clock.lap("verify")
            emitted, kept = self.commit(tree, verdict, output.hidden, output.features)
            # each emitted token was drawn at the root or at the accepted node above it
            nll = scores.nll([0, *verdict.accepted][: len(emitted)], emitted)
            self.health.push(emitted, nll)
            clock.lap("commit")
            forward_seconds, step_seconds = self._as_compiled(tree, context, clock.seconds["forward"], sum(clock.seconds.values()))
            compiled_now = compiling_seconds() - compiling_before
            catch_up = setup.drafter.catch_up_seconds if DRAFTER in proposing else 0.0
            if not compiled_now:  # a step that compiled a graph says nothing of what steps cost
                # judged as the plain guard judges steps: without the cost of switching to speculating
                self._judge_trial(len(emitted), step_seconds - catch_up - root_pass.view_seconds, speculative=len(tree) > 1)
            speculator.learn(StepFacts(
                tree=tree, verdict=verdict, context=context, forward_seconds=forward_seconds,
                step_seconds=step_seconds, proposing_seconds=proposing,
                drafting_pass=root_pass.ran, view_seconds=root_pass.view_seconds, emitted=len(emitted),
                compile_seconds=compiled_now,
                catch_up_seconds=catch_up,
            ))
            choice = selection.choice
            yield StepRecord(
                step=state.step,
                candidates=len(candidates) - 1,
                verified=len(tree) - 1,
                depth=tree.depth,
                accepted=len(kept),
                retrieved=sum(1 for node in kept if tree.sources[node] == RETRIEVER),
                emitted=emitted,
                generated=state.generated,
                seconds=time.perf_counter() - self.started,
                stage_seconds=dict(clock.seconds),
                model_seconds=dict(clock.model_seconds),
                drafting_pass=bool(root_pass.ran),
                predicted_tokens=None if choice is None else choice.expected_tokens,
                predicted_seconds=None if choice is None else choice.seconds,
                forward_seconds=clock.seconds["forward"],
                nll=nll,
                health=self.health.health(),
            )

    def _as_compiled(self, tree: DraftTree, context: int, forward: float, step: float) -> tuple[float, float]:
        """A step's forward and whole seconds as the speculation policy is to learn them:
        while the run's trees are on trial (:class:`~tokenswift.compiling.TreeTrial`) a
        tree verified eagerly counts at the cost model's price of its compiled forward
        (the policy chose it at that price; learnt eager, its rates and the cost model's
        size factors would say what no compiled step costs)."""
        costs = getattr(self.setup.speculator, "costs", None)
        if self.setup.runner.tree_trial is None or len(tree) == 1 or costs is None:
            return forward, step
        compiled = costs.forward_seconds(len(tree), context)
        return compiled, step - forward + compiled

    def _judge_trial(self, emitted: int, seconds: float, *, speculative: bool) -> None:
        """Count a step toward the run's tree trial; once it has judged, compile the
        trees (at their next forward) or verify none eagerly from now on."""
        runner = self.setup.runner
        trial = runner.tree_trial
        if trial is None:
            return
        verdict = trial.observe(emitted, seconds, speculative=speculative)
        if verdict is None:
            return
        runner.tree_trial = None
        speedup, saving = trial.speedup(), trial.saving_seconds()
        logger.info(
            "tree trial: %d speculative steps at %s the plain steps' rate as compiled: compiling the trees "
            "(~%.1f s) %s (saving ~%.1f s over the %d tokens left)", len(trial.speculative),
            "?" if speedup is None else f"{speedup:.2f}x", trial.compile_seconds,
            "pays: compiled at the next tree" if verdict else "does not pay: plain steps", saving,
            max(trial.tokens - trial.generated, 0),
        )
        if not verdict:
            runner.use_compiled_trees(())

    def propose(self) -> tuple[DraftTree, dict[int, float], _RootPassRequest]:
        """The candidates of the next step: drafter branches, then retriever branches,
        from the proposers the speculation policy lets propose. Also what each of them
        took (its keys: the sources that proposed) and the drafter's root-pass request."""
        setup, state = self.setup, self.state
        tree = DraftTree.root_only(state.tokens[-1])
        proposers = setup.speculator.proposers()
        root_pass = _RootPassRequest(setup, state)
        proposing: dict[int, float] = {}
        if DRAFTER in proposers:
            started = time.perf_counter()
            inputs = DraftInputs(
                parent_hidden=self.parent_hidden, root_pass=root_pass, noise=self._noise_at_depth, noise_at=self._noise_of_ids,
                draw_drafts=self._draw_drafts, sampled=setup.sampled_drafts,
            )
            tree.add_branches(setup.drafter.propose(state, inputs))
            proposing[DRAFTER] = time.perf_counter() - started
        if RETRIEVER in proposers:
            started = time.perf_counter()
            first_tokens = [tree.tokens[child] for child in tree.children(0).values()]
            tree.add_branches(setup.retriever.retrieve(state, first_tokens), source=RETRIEVER)
            proposing[RETRIEVER] = time.perf_counter() - started
        return tree, proposing, root_pass

    def _noise_at_depth(self, depth: int) -> torch.Tensor | None:
        """The sampler's noise for the token a node at ``depth`` below the root holds
        (depth 1: the token after the root), on the model's device; None without any."""
        noise = self.sampler.noise(len(self.state.tokens) - 1 + depth, self.setup.runner.vocab_size)
        return None if noise is None else noise.to(self.setup.runner.device)

    def _noise_of_ids(self, depth: int, ids: torch.Tensor) -> torch.Tensor | None:
        """:meth:`_noise_at_depth` at token ``ids`` only ([n] long, on the model's device)."""
        return self.sampler.noise_at(len(self.state.tokens) - 1 + depth, ids, self.setup.runner.vocab_size)

    def _draw_drafts(self, q: torch.Tensor, k: int, depth: int) -> list[int] | None:
        """``k`` tokens from ``q`` without replacement for children at ``depth``
        (their own stream of the sampler's numbers); None when greedy."""
        if self.sampler.greedy:
            return None
        return self.sampler.without_replacement(q, k, len(self.state.tokens) - 1 + depth, STREAM_DRAFTS)

    def commit(
        self, tree: DraftTree, verdict: Verdict, hidden: torch.Tensor, features: torch.Tensor | None = None
    ) -> tuple[list[int], list[int]]:
        """Make the step permanent: the KV keeps the root and the accepted path, the
        emitted tokens (cut at ``max_new_tokens`` and EOS) are appended, and the
        components observe the step. hidden: [len(tree), hidden_size]; features: the
        drafter's (:func:`~tokenswift.model.runner.features`; default ``hidden``). Returns
        (emitted tokens, accepted nodes kept)."""
        setup, state = self.setup, self.state
        setup.runner.commit([0, *verdict.accepted])
        emitted = [tree.tokens[node] for node in verdict.accepted] + [verdict.bonus]
        emitted = emitted[: self.max_new_tokens - state.generated]
        for i, token in enumerate(emitted):
            if token in setup.eos:
                emitted = emitted[: i + 1]
                self.finish_reason = "eos"
                break
        outcome = StepOutcome(
            emitted=emitted, tree=tree, accepted=list(verdict.accepted), hidden=hidden,
            features=hidden if features is None else features,
        )
        state.tokens.extend(emitted)
        state.step += 1
        self._resume_point = (len(state.tokens), self.generator.get_state())
        self.parent_hidden = hidden[outcome.bonus_parent]
        for component in setup.components:
            component.observe(state, outcome)
        return emitted, verdict.accepted[: len(emitted)]
