"""The pipeline: one decoding loop, five swappable components.

One step (see DESIGN.md):

1. propose   the drafter (over the cache policy's view) and the retriever give
             branches; they are merged into one :class:`~tokenswift.tree.DraftTree`;
2. score     one forward of the tree over the full KV gives every node's logits;
3. transform penalty and warpers, per node, with that node's own context (on demand:
             only for the nodes the verifier visits);
4. verify    the verifier walks the tree: accepted path + bonus token;
5. commit    the full KV keeps the root and the accepted path;
6. observe   components and hooks see the new tokens.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from tokenswift import distributed
from tokenswift.checkpoint import Checkpoint
from tokenswift.detok import IncrementalDecoder
from tokenswift.errors import NonFiniteScoresError, SpecError
from tokenswift.interfaces import BuildContext, DecodeState
from tokenswift.memory import WORKING_SLACK, MemoryEstimate, available_bytes, gib
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.registry import PluginManager, Registry, build_registry, get_plugin_manager
from tokenswift.sampling import Sampler
from tokenswift.scoring import NodeScores
from tokenswift.spec import COMPONENT_KINDS, PipelineSpec, load_toml, merge_overrides
from tokenswift.tree import RETRIEVER, DraftTree

logger = logging.getLogger(__name__)

STAGES = ("propose", "score", "verify", "commit")


@attrs.frozen(kw_only=True)
class GenerationStats:
    """What one generation did and how long it took."""

    prompt_tokens: int
    new_tokens: int
    steps: int
    seconds: float  # prefill + decode
    prefill_seconds: float
    proposed_tokens: int  # tree nodes below the root, summed over steps
    accepted_tokens: int  # proposed tokens that were accepted
    retrieved_accepted_tokens: int  # of those, the ones from retriever branches
    draft_depth: int  # sum over steps of the tree depth (the paper's "steps x k")
    tokens_per_step_histogram: dict[int, int]
    stage_seconds: dict[str, float]
    finish_reason: str  # "length", "eos", or "non-finite scores" (stopped, text so far kept)

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.prefill_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / (steps x tree depth), as the paper defines it."""
        return self.accepted_tokens / self.draft_depth if self.draft_depth else 0.0

    @property
    def retriever_share(self) -> float:
        return self.retrieved_accepted_tokens / self.accepted_tokens if self.accepted_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
            "tokens_per_step": round(self.tokens_per_step, 3),
            "acceptance_rate": round(self.acceptance_rate, 3),
            "retriever_share": round(self.retriever_share, 3),
            "finish_reason": self.finish_reason,
        }


@attrs.frozen(kw_only=True, eq=False)
class StepRecord:
    """One committed step, as observers see it."""

    step: int
    tree_size: int  # nodes below the root
    depth: int  # the tree's depth (0: nothing drafted)
    accepted: int  # drafted tokens accepted
    emitted: list[int]  # accepted tokens + bonus (cut at max_new_tokens / EOS)
    generated: int  # new tokens so far, these included
    seconds: float  # since generation start
    stage_seconds: dict[str, float] = attrs.field(factory=dict)  # per stage (STAGES), since generation start


@attrs.frozen(kw_only=True, eq=False)
class StreamChunk:
    tokens: list[int]
    text: str | None


@attrs.frozen(kw_only=True, eq=False)
class GenerationResult:
    """tokens: the new token ids; text: their decoding (None without a tokenizer)."""

    tokens: list[int]
    text: str | None
    stats: GenerationStats
    seed: int
    prompt_tokens: list[int]


@attrs.define(kw_only=True, eq=False)
class _Run:
    """What the decoding loop of one generation works with."""

    state: DecodeState
    sampler: Sampler
    eos: set[int]
    max_new_tokens: int
    counter: _StatsCounter
    started: float
    stream: Callable[[StreamChunk], None] | None
    decoder: IncrementalDecoder | None
    save_checkpoint: Callable[[], None] | None
    checkpoint_every: int


class _StatsCounter:
    def __init__(self) -> None:
        self.steps = self.proposed = self.accepted = self.retrieved = self.depth = 0
        self.histogram: dict[int, int] = {}
        self.stage = dict.fromkeys(STAGES, 0.0)

    def add(self, tree: DraftTree, accepted: list[int], emitted: int) -> None:
        self.steps += 1
        self.proposed += len(tree) - 1
        self.accepted += len(accepted)
        self.retrieved += sum(1 for i in accepted if tree.sources[i] == RETRIEVER)
        self.depth += tree.depth
        self.histogram[emitted] = self.histogram.get(emitted, 0) + 1


class Pipeline:
    """A model plus its five components, ready to generate."""

    def __init__(
        self,
        spec: PipelineSpec,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        registry: Registry,
        plugin_manager: PluginManager,
    ) -> None:
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.registry = registry
        self.plugin_manager = plugin_manager
        self.runner = Runner(model)
        context = BuildContext(spec=spec, runner=self.runner, tokenizer=tokenizer)
        # Built in dependency order: a drafter may look at the others through the context.
        self.penalty = context.penalty = registry.build("penalty", spec.penalty, context)
        self.verifier = registry.build("verifier", spec.verifier, context)
        self.cache_policy = registry.build("cache", spec.cache, context)
        self.retriever = registry.build("retriever", spec.retriever, context)
        self.drafter = registry.build("drafter", spec.drafter, context)
        self._components = (self.penalty, self.verifier, self.cache_policy, self.retriever, self.drafter)

    def __repr__(self) -> str:
        parts = ", ".join(f"{kind}={self.spec.component(kind).name!r}" for kind in COMPONENT_KINDS)
        return f"Pipeline({parts})"

    # -- construction --------------------------------------------------------------

    @classmethod
    def from_spec(
        cls,
        spec: PipelineSpec | Mapping[str, Any] | str | os.PathLike,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        *,
        overrides: Mapping[str, Any] | None = None,
        plugin_manager: PluginManager | None = None,
    ) -> Pipeline:
        """Build a pipeline from a spec dict, a TOML file, a preset name, or a
        :class:`PipelineSpec`; ``overrides`` (a dict of the same shape) go on top.
        ``model`` may be an already-loaded transformers causal LM."""
        pm = plugin_manager or get_plugin_manager()
        registry = build_registry(pm)
        data = cls._spec_dict(spec, registry)
        if overrides:
            data = merge_overrides(data, overrides)
        spec_obj = PipelineSpec.from_dict(data, registry.presets)
        for kind in COMPONENT_KINDS:  # fail on bad names/options before a slow model load
            registry.make_options(kind, spec_obj.component(kind))
        if model is None:
            if spec_obj.model is None:
                raise SpecError("no model: pass model= or give a [model] section with 'path' or 'tiny'")
            model, loaded_tokenizer = load_model(spec_obj.model)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        return cls(spec_obj, model, tokenizer, registry=registry, plugin_manager=pm)

    @staticmethod
    def _spec_dict(spec, registry: Registry) -> dict[str, Any]:
        if isinstance(spec, PipelineSpec):
            return spec.to_dict()
        if isinstance(spec, Mapping):
            return dict(spec)
        if isinstance(spec, str) and spec in registry.presets:
            return {"preset": spec}
        if isinstance(spec, (str, os.PathLike)):
            path = Path(spec)
            if path.suffix == ".toml" or path.is_file():
                return load_toml(path)
            raise SpecError(f"unknown preset {str(spec)!r}; valid presets: {sorted(registry.presets)} (or a .toml spec file)")
        raise SpecError(f"a spec must be a dict, a preset name or a TOML path, got {type(spec).__name__}")

    # -- generation ----------------------------------------------------------------

    def encode(self, prompt: str | list[int] | torch.Tensor) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this pipeline has no tokenizer: pass the prompt as a list of token ids")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.flatten().tolist()
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if value is None:
                continue
            ids.update([value] if isinstance(value, int) else list(value))
        return ids

    def check(self, prompt: str | list[int] | torch.Tensor, max_new_tokens: int) -> list[int]:
        """Validate a run before it starts (prompt, length, context, memory) and return
        the prompt's token ids; raises ValueError with the reason otherwise."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        prompt_ids = self.encode(prompt)
        self._check_context(len(prompt_ids), max_new_tokens)
        self._check_memory(len(prompt_ids), max_new_tokens)
        return prompt_ids

    def _check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        context = getattr(self.runner.config, "max_position_embeddings", None)
        if context is None:
            return
        if prompt_tokens >= context:
            raise ValueError(
                f"the prompt has {prompt_tokens} tokens, more than the model's context of {context} positions"
            )
        if prompt_tokens + max_new_tokens > context:
            logger.warning(
                "prompt (%d) + max_new_tokens (%d) exceed the model's trained context (%d positions); "
                "quality past it depends on the model's RoPE scaling",
                prompt_tokens,
                max_new_tokens,
                context,
            )

    def estimate_memory(self, prompt_tokens: int, max_new_tokens: int) -> MemoryEstimate:
        """What a run of this size will allocate: KV store, drafting view, working set."""
        runner = self.runner
        positions = prompt_tokens + max_new_tokens + self.max_tree_nodes()
        reusable = runner.store is not None and runner.store.capacity >= positions
        budget = getattr(getattr(self.cache_policy, "options", None), "budget", None)
        view_positions = budget + 8 if budget is not None and positions > budget else 0
        return MemoryEstimate(
            positions=positions,
            kv_bytes=0 if reusable else runner.kv_bytes(positions),
            view_bytes=runner.kv_bytes(view_positions),
            working_bytes=WORKING_SLACK + 2 * self.max_tree_nodes() * runner.vocab_size * 4,
        )

    def _check_memory(self, prompt_tokens: int, max_new_tokens: int) -> None:
        estimate = self.estimate_memory(prompt_tokens, max_new_tokens)
        free = available_bytes(self.runner.device)
        if distributed.launched():  # every rank must take the same decision
            free = distributed.min_over_ranks(-1 if free is None else free)
            free = None if free < 0 else free
        if free is not None and estimate.total_bytes > free:
            raise ValueError(
                f"this run needs about {gib(estimate.total_bytes)} (KV store for {estimate.positions} positions "
                f"{gib(estimate.kv_bytes)}, drafting view {gib(estimate.view_bytes)}), but only {gib(free)} is "
                f"available; lower max_new_tokens ({max_new_tokens}) or the cache budget"
            )

    def max_tree_nodes(self) -> int:
        return 1 + sum(component.max_tree_nodes for component in self._components)

    def generate(
        self,
        prompt: str | list[int] | torch.Tensor,
        max_new_tokens: int,
        seed: int | None = None,
        ignore_eos: bool = False,
        stream: Callable[[StreamChunk], None] | None = None,
        *,
        checkpoint: str | os.PathLike | None = None,
        checkpoint_every: int = 256,
        resume: Checkpoint | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` new tokens after ``prompt`` (text or ids).

        The same seed gives the same output; ``stream`` is called after every step
        with the new tokens (and their text, with a tokenizer). With ``checkpoint``, a
        :class:`~tokenswift.checkpoint.Checkpoint` is written there atomically every
        ``checkpoint_every`` new tokens and when the run ends, also on KeyboardInterrupt
        (the result then has ``finish_reason == "interrupted"``). ``resume`` continues
        such a checkpoint exactly (``prompt``, ``max_new_tokens``, ``seed`` and
        ``ignore_eos`` then come from it); the result holds all new tokens, the stats
        this run's part.
        """
        if resume is not None:
            prompt, max_new_tokens, seed, ignore_eos = (
                resume.prompt_tokens, resume.max_new_tokens, resume.seed, resume.ignore_eos
            )
        prompt_ids = self.check(prompt, max_new_tokens)
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every <= 0:
            raise ValueError(f"checkpoint_every must be a positive integer, got {checkpoint_every!r}")
        seed = distributed.broadcast_int(secrets.randbits(63)) if seed is None else int(seed)
        if not distributed.is_primary():  # under torchrun, rank 0 alone streams and writes
            stream, checkpoint = None, None
        done_before = list(resume.tokens) if resume is not None else []
        hook = self.plugin_manager.hook
        hook.tokenswift_generation_start(pipeline=self, prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens)

        started = time.perf_counter()
        runner = self.runner
        context = list(prompt_ids) + done_before
        runner.allocate(len(prompt_ids) + max_new_tokens + self.max_tree_nodes())
        runner.prefill(torch.tensor(context[:-1], dtype=torch.long))
        prefill_seconds = time.perf_counter() - started

        generator = resume.generator() if resume is not None else torch.Generator(device="cpu").manual_seed(seed)
        sampler = Sampler(self.spec.sampling, generator)
        state = DecodeState(tokens=context, prompt_length=len(prompt_ids), runner=runner)
        for component in self._components:
            component.start(state)
        eos = set() if ignore_eos else self.eos_token_ids()
        decoder = IncrementalDecoder(self.tokenizer) if (stream and self.tokenizer is not None) else None
        if decoder is not None and done_before:
            decoder.prime(done_before)  # stream deltas continue the resumed text seamlessly
        counter = _StatsCounter()
        finish_reason = "length"
        if resume is not None and resume.done:
            finish_reason = resume.finish_reason

        def save_checkpoint(reason: str | None) -> None:
            Checkpoint(
                spec=self.spec.to_dict(),
                prompt_tokens=list(prompt_ids),
                tokens=state.tokens[len(prompt_ids) :],
                seed=seed,
                rng_state=bytes(generator.get_state().tolist()),
                max_new_tokens=max_new_tokens,
                ignore_eos=ignore_eos,
                finish_reason=reason,
            ).save(checkpoint)

        run = _Run(
            state=state,
            sampler=sampler,
            eos=eos,
            max_new_tokens=max_new_tokens,
            counter=counter,
            started=started,
            stream=stream,
            decoder=decoder,
            save_checkpoint=(lambda: save_checkpoint(None)) if checkpoint is not None else None,
            checkpoint_every=checkpoint_every,
        )
        try:
            if resume is None or not resume.done:
                finish_reason = self._decode(run)
        except KeyboardInterrupt:
            logger.warning("interrupted after %d new tokens", state.generated)
            finish_reason = "interrupted"
        if checkpoint is not None:
            save_checkpoint(finish_reason)

        new_tokens = state.tokens[len(prompt_ids) :]
        stats = GenerationStats(
            prompt_tokens=len(prompt_ids),
            new_tokens=len(new_tokens),
            steps=counter.steps,
            seconds=time.perf_counter() - started,
            prefill_seconds=prefill_seconds,
            proposed_tokens=counter.proposed,
            accepted_tokens=counter.accepted,
            retrieved_accepted_tokens=counter.retrieved,
            draft_depth=counter.depth,
            tokens_per_step_histogram=dict(sorted(counter.histogram.items())),
            stage_seconds=counter.stage,
            finish_reason=finish_reason,
        )
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(new_tokens, skip_special_tokens=True)
        result = GenerationResult(tokens=new_tokens, text=text, stats=stats, seed=seed, prompt_tokens=prompt_ids)
        hook.tokenswift_generation_end(pipeline=self, result=result)
        return result

    def _decode(self, run: _Run) -> str:
        """The decoding loop; returns why it stopped ("length", "eos", "non-finite scores")."""
        runner, hook = self.runner, self.plugin_manager.hook
        state, sampler, counter, max_new_tokens = run.state, run.sampler, run.counter, run.max_new_tokens
        finish_reason = "length"
        next_checkpoint = (state.generated // run.checkpoint_every + 1) * run.checkpoint_every
        while state.generated < max_new_tokens:
            clock = time.perf_counter()
            tree = self._propose(state)
            now = time.perf_counter()
            counter.stage["propose"] += now - clock
            clock = now

            output = runner.forward(
                tree.token_tensor(), tree_mask=tree.mask(), depths=tree.depth_tensor(), logits_rows=None
            )
            scores = NodeScores(
                tree, output.hidden, runner.lm_head, self.penalty, sampler, state.tokens, runner.logits_dtype
            )
            now = time.perf_counter()
            counter.stage["score"] += now - clock
            clock = now

            try:
                verdict = self.verifier.verify(tree, scores, sampler)
            except NonFiniteScoresError as exc:
                # Keep what was generated so far; the caller sees why it stopped.
                logger.warning("stopping after %d new tokens: %s", state.generated, exc)
                finish_reason = "non-finite scores"
                return finish_reason
            now = time.perf_counter()
            counter.stage["verify"] += now - clock
            clock = now

            runner.commit([0, *verdict.accepted])
            emitted = [tree.tokens[i] for i in verdict.accepted] + [verdict.bonus]
            emitted = emitted[: max_new_tokens - state.generated]
            for i, token in enumerate(emitted):
                if token in run.eos:
                    emitted = emitted[: i + 1]
                    finish_reason = "eos"
                    break
            state.tokens.extend(emitted)
            state.step += 1
            state.last_tree, state.last_output = tree, output
            state.last_accepted = verdict.accepted[-1] if verdict.accepted else 0
            for component in self._components:
                component.observe(state, emitted)
            counter.add(tree, verdict.accepted[: len(emitted)], len(emitted))
            counter.stage["commit"] += time.perf_counter() - clock

            hook.tokenswift_step_end(
                pipeline=self,
                step=StepRecord(
                    step=state.step,
                    tree_size=len(tree) - 1,
                    depth=tree.depth,
                    accepted=len(verdict.accepted),
                    emitted=emitted,
                    generated=state.generated,
                    seconds=time.perf_counter() - run.started,
                    stage_seconds=dict(counter.stage),
                ),
            )
            if run.stream is not None:
                run.stream(StreamChunk(tokens=emitted, text=run.decoder.push(emitted) if run.decoder else None))
            if run.save_checkpoint and next_checkpoint <= state.generated < max_new_tokens:
                run.save_checkpoint()
                next_checkpoint = (state.generated // run.checkpoint_every + 1) * run.checkpoint_every
            if finish_reason == "eos":
                return finish_reason

        return finish_reason

    def _propose(self, state: DecodeState) -> DraftTree:
        tree = DraftTree.root_only(state.tokens[-1])
        view = self.cache_policy.drafting_view(state)
        tree.add_branches(self.drafter.propose(state, view))
        first_tokens = [tree.tokens[child] for child in tree.children(0).values()]
        tree.add_branches(self.retriever.retrieve(state, first_tokens), source=RETRIEVER)
        return tree
