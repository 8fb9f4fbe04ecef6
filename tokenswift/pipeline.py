"""The pipeline: a model, its five components, and generation.

:meth:`Pipeline.start` validates a run, prepares everything it decodes with (the
machine's costs, the linear backend, the compile decision, the KV store) and returns a
:class:`~tokenswift.decoding.Generation`, whose ``steps()`` is the decoding loop (see
:mod:`tokenswift.decoding`); :meth:`Pipeline.generate` consumes those steps for the
caller: streaming, checkpoints, plugin hooks and statistics. The design, with the
data flow of one step, is written down in ``docs/design.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from tokenswift import compiling, distributed, kernels
from tokenswift.checkpoint import Checkpoint
from tokenswift.calibration import calibration_for
from tokenswift.costs import CostModel
from tokenswift.decoding import DecodingSetup, Generation
from tokenswift.detok import IncrementalDecoder
from tokenswift.errors import PromptError, SpecError
from tokenswift.interfaces import BuildContext
from tokenswift.memory import WORKING_SLACK, MemoryEstimate, available_bytes, gib
from tokenswift.model.dtypes import prefill_dtype, prefill_min_tokens
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.prompts import COUNT_CHUNK_CHARS, chat_template_text, check_text, run_end_ids, tokens_at_least
from tokenswift.registry import PluginManager, Registry, build_registry, get_plugin_manager
from tokenswift.scoring import Scorer
from tokenswift.speculation import AutoSpeculator, Speculator
from tokenswift.spec import COMPONENT_KINDS, PipelineSpec, load_toml, merge_overrides
from tokenswift.health import LOOP_THRESHOLD, check_loop_threshold
from tokenswift.stats import GenerationStats, StatsCollector, StepRecord
from tokenswift.validation import check_seed

logger = logging.getLogger(__name__)

__all__ = ["GenerationResult", "GenerationStats", "Pipeline", "StepRecord", "StreamChunk"]


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


@contextlib.contextmanager
def deferred_interrupts():
    """While a generation runs in the main thread, a Ctrl-C (SIGINT, and SIGTERM where
    it is handled as one, as ``tokenswift generate`` does), whose handler is Python's
    default one, ends it after the current step instead of inside it; a second one
    interrupts at once. Yields a function that says whether one came. Inside a compiled
    forward the interrupt reached Python within the ``tokenswift::attend`` operator,
    called from inductor's C++ wrapper, and came back as a RuntimeError: a 100K run
    crashed instead of stopping cleanly (``docs/long-runs.md``)."""
    came = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    deferred = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is signal.default_int_handler]

    def note(signum, frame):
        if came:
            raise KeyboardInterrupt
        came.append(signum)
        logger.warning("interrupted: stopping after this step (again to stop at once)")

    for signum in deferred:
        signal.signal(signum, note)
    try:
        yield lambda: bool(came)
    finally:
        for signum in deferred:
            signal.signal(signum, signal.default_int_handler)


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
        prefill_choice = spec.model.prefill_dtype if spec.model is not None else "auto"
        self.runner.use_prefill_dtype(
            prefill_dtype(prefill_choice, self.runner.dtype, self.runner.device),
            prefill_min_tokens(prefill_choice, self.runner.dtype, self.runner.device),
        )
        context = BuildContext(spec=spec, runner=self.runner, tokenizer=tokenizer)
        # Built in dependency order: the others score positions with the penalty.
        self.penalty = registry.build("penalty", spec.penalty, context)
        self.scorer = context.scorer = Scorer(self.penalty, spec.sampling, exempt=self.eos_token_ids())
        self.verifier = registry.build("verifier", spec.verifier, context)
        self.cache_policy = registry.build("cache", spec.cache, context)
        self.retriever = registry.build("retriever", spec.retriever, context)
        self.drafter = registry.build("drafter", spec.drafter, context)
        self.components = (self.penalty, self.verifier, self.cache_policy, self.retriever, self.drafter)
        self._costs: CostModel | None = None

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
            if spec_obj.model is None or spec_obj.model.compile_only:
                raise SpecError("no model: pass model= or give a [model] section with 'path' or 'tiny'")
            model, loaded_tokenizer = load_model(spec_obj.model)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
            source = spec_obj.model if spec_obj.model.path is not None else None  # a fresh process loads it again
        else:
            source = None
        pipe = cls(spec_obj, model, tokenizer, registry=registry, plugin_manager=pm)
        if source is not None:
            pipe.runner.source = {**source.to_dict(), "dtype": str(pipe.runner.dtype).removeprefix("torch.")}
        return pipe

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
            ids = self.tokenizer(check_text(prompt), add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.flatten().tolist()
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError("the prompt is empty: give at least one token")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def eos_token_ids(self) -> set[int]:
        """The ids that end a run (unless it ignores EOS): the model's and tokenizer's
        EOS, and the token its chat template closes an assistant turn with."""
        return run_end_ids(self.model, self.tokenizer)

    def chat_prompt(self, messages: list[dict]) -> str:
        """The text a chat (``[{"role": "system" | "user" | "assistant", "content": ...}]``)
        is continued from: the tokenizer's own chat template with the assistant's turn
        opened. A model without a tokenizer or template is a clear error."""
        if self.tokenizer is None:
            raise ValueError("this pipeline has no tokenizer, so it has no chat template: pass a prompt instead")
        return chat_template_text(self.tokenizer, messages)

    def check(
        self, prompt: str | list[int] | torch.Tensor, max_new_tokens: int, *, name: str = "max_new_tokens"
    ) -> list[int]:
        """Validate a run before it starts (prompt, length, context, memory) and return
        the prompt's token ids; raises ValueError with the reason otherwise (a
        :class:`~tokenswift.errors.PromptError` where the prompt is at fault).
        ``name``: what messages call ``max_new_tokens`` (a flag, a request field). A
        long text is counted in pieces and refused as soon as the context is exceeded,
        never tokenized whole; warnings (past the trained context) come only once the
        run is accepted."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"{name} must be a positive integer, got {max_new_tokens!r}")
        context = getattr(self.runner.config, "max_position_embeddings", None)
        if isinstance(prompt, str) and context is not None and self.tokenizer is not None and len(prompt) > COUNT_CHUNK_CHARS:
            found = tokens_at_least(self.tokenizer, check_text(prompt), context)
            if found is not None:
                raise PromptError(
                    f"the prompt has at least {found[0]} tokens (counted in its first {found[1]} of {len(prompt)} "
                    f"characters), more than the model's context of {context} positions"
                )
        prompt_ids = self.encode(prompt)
        self._check_context(len(prompt_ids), max_new_tokens, warn=False)
        self._check_memory(len(prompt_ids), max_new_tokens, name=name)
        self._check_context(len(prompt_ids), max_new_tokens, warn=True)
        return prompt_ids

    def check_resume(self, checkpoint: Checkpoint) -> list[int]:
        """Validate a checkpoint before it is continued, as :meth:`check` validates a
        run (its prompt, context and memory), and its generated tokens: ids of this
        model's vocabulary. Returns the prompt's ids; raises ValueError otherwise."""
        prompt_ids = self.check(checkpoint.prompt_tokens, checkpoint.max_new_tokens)
        vocab = self.runner.vocab_size
        bad = [t for t in checkpoint.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"the checkpoint's generated token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return prompt_ids

    def _check_context(self, prompt_tokens: int, max_new_tokens: int, *, warn: bool = True) -> None:
        context = getattr(self.runner.config, "max_position_embeddings", None)
        if context is None:
            return
        if prompt_tokens >= context:
            raise PromptError(
                f"the prompt has {prompt_tokens} tokens, more than the model's context of {context} positions"
            )
        if warn and prompt_tokens + max_new_tokens > context:
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
        positions = self.kv_capacity(prompt_tokens, max_new_tokens)
        reusable = runner.store is not None and runner.store.capacity >= positions
        view_positions = self.cache_policy.view_positions(positions)
        return MemoryEstimate(
            positions=positions,
            kv_bytes=0 if reusable else runner.kv_bytes(positions),
            view_bytes=runner.kv_bytes(view_positions),
            working_bytes=WORKING_SLACK + 2 * self.max_tree_nodes() * runner.vocab_size * 4,
            packed_bytes=runner.packed_bytes(),
            prefill_copy_bytes=runner.prefill_copy_bytes(prompt_tokens),
        )

    def _check_memory(self, prompt_tokens: int, max_new_tokens: int, *, name: str = "max_new_tokens") -> None:
        estimate = self.estimate_memory(prompt_tokens, max_new_tokens)
        free = available_bytes(self.runner.device)
        if distributed.launched():  # every rank must take the same decision
            free = distributed.min_over_ranks(-1 if free is None else free)
            free = None if free < 0 else free
        if free is not None and estimate.total_bytes > free:
            raise ValueError(
                f"this run needs about {gib(estimate.total_bytes)} (KV store for {estimate.positions} positions "
                f"{gib(estimate.kv_bytes)}, drafting view {gib(estimate.view_bytes)}, packed weights "
                f"{gib(estimate.packed_bytes)}, the prefill's copy of the model {gib(estimate.prefill_copy_bytes)}), "
                f"but only {gib(free)} is "
                f"available; lower {name} ({max_new_tokens}) or the cache budget"
                + ("" if not estimate.packed_bytes else
                   f", or set {kernels.LINEARS_ENV}=torch to multiply by the weights as stored")
            )

    def kv_capacity(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """KV positions a run needs: its whole context plus the largest tree's staging."""
        return prompt_tokens + max_new_tokens + self.max_tree_nodes()

    def max_tree_nodes(self) -> int:
        return 1 + sum(component.max_tree_nodes for component in self.components)

    def costs(self) -> CostModel | None:
        """This machine's costs for the model (measured on first use, then cached per
        machine; see :mod:`tokenswift.calibration`), with the runner's linear backend set
        to the one they found faster. None under torchrun, where every rank must choose
        the same trees, so timings may not steer them."""
        if distributed.launched():
            return None
        if self._costs is None:
            sections = {kind: section for kind, section in self.spec.to_dict().items() if kind in ("penalty", "sampling")}
            calibration = calibration_for(self.runner, self.scorer, sections=sections)
            calibration.apply_linears(self.runner)
            runner = self.runner
            self._costs = CostModel(calibration, compiled_size=runner.compiled_size)
        return self._costs

    def prepare(self, prompt_tokens: int, max_new_tokens: int, *, done_tokens: int = 0, ignore_eos: bool = False) -> DecodingSetup:
        """Everything a run decodes with, prepared in the open: the costs (loaded, or
        measured once per machine: 10-25 s), the linear backend they chose, the compile
        decision (:mod:`tokenswift.compiling`) for the tokens still to generate (a
        resumed run has ``done_tokens`` of them already), the speculation policy, and
        the KV store sized for the run (last: measuring reallocates it)."""
        speculation = self.spec.speculation
        costs = self.costs() if speculation.tree == "auto" else None
        choice = self.spec.model.compile if self.spec.model is not None else "auto"
        decision = compiling.decide(
            self.runner, choice, prompt_tokens=prompt_tokens + done_tokens, new_tokens=max_new_tokens - done_tokens,
            prices_trees=costs is not None and self.max_tree_nodes() > 1,
        )
        if costs is not None:
            costs.use_compile_calibration(decision.calibration)
        self.runner.allocate(self.kv_capacity(prompt_tokens, max_new_tokens))
        speculator = (AutoSpeculator(costs, speculation.max_nodes, plain_guard=speculation.plain_guard,
                                      pass_gain=speculation.pass_gain) if costs is not None
                      else Speculator(speculation.max_nodes))
        return self._setup(speculator, ignore_eos=ignore_eos, compiled=decision.compiled)

    def _setup(self, speculator: Speculator, *, ignore_eos: bool, compiled: bool = False) -> DecodingSetup:
        return DecodingSetup(
            runner=self.runner,
            drafter=self.drafter,
            retriever=self.retriever,
            cache_policy=self.cache_policy,
            verifier=self.verifier,
            components=self.components,
            scorer=self.scorer,
            speculator=speculator,
            sampling=self.spec.sampling,
            eos=frozenset() if ignore_eos else frozenset(self.eos_token_ids()),
            spec=self.spec.to_dict(),
            compiled=compiled,
            sampled_drafts=self.verifier.wants_sampled_drafts,
        )

    def start(
        self,
        prompt: str | list[int] | torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        *,
        messages: list[dict] | None = None,
        resume: Checkpoint | None = None,
        loop_threshold: float = LOOP_THRESHOLD,
    ) -> Generation:
        """Validate a run and prepare it (:meth:`prepare`: the first run on a machine
        measures its costs); decoding starts when its ``steps()`` are iterated.
        ``messages`` (instead of ``prompt``): a chat, continued as the model's
        assistant (:meth:`chat_prompt`). ``resume`` continues a checkpoint (``prompt``,
        ``max_new_tokens``, ``seed`` and ``ignore_eos`` then come from it).
        ``loop_threshold``: a warning is logged when distinct-4 over the last 1,024
        tokens falls below it (:mod:`tokenswift.health`; 0: never)."""
        check_loop_threshold(loop_threshold)
        if messages is not None:
            if prompt is not None:
                raise ValueError("give a prompt or messages, not both")
            prompt = self.chat_prompt(messages)
        elif prompt is None and resume is None:
            raise ValueError("nothing to continue: give a prompt (text or token ids) or messages")
        if resume is not None:
            prompt, max_new_tokens, seed, ignore_eos = (
                resume.prompt_tokens, resume.max_new_tokens, resume.seed, resume.ignore_eos
            )
        if seed is not None:
            seed = check_seed(seed)
        prompt_ids = self.check(prompt, max_new_tokens) if resume is None else self.check_resume(resume)
        seed = distributed.broadcast_int(secrets.randbits(63)) if seed is None else seed
        generator = resume.generator() if resume is not None else torch.Generator(device="cpu").manual_seed(seed)
        done = list(resume.tokens) if resume is not None else []
        if resume is not None and resume.done:  # nothing left to decode: nothing to prepare
            setup = self._setup(Speculator(), ignore_eos=ignore_eos)
        else:
            setup = self.prepare(len(prompt_ids), max_new_tokens, done_tokens=len(done), ignore_eos=ignore_eos)
        return Generation(
            setup,
            prompt_ids,
            max_new_tokens,
            seed=seed,
            generator=generator,
            ignore_eos=ignore_eos,
            done_tokens=done,
            finish_reason=resume.finish_reason if resume is not None and resume.done else None,
            loop_threshold=loop_threshold,
        )

    def steps(
        self, prompt: str | list[int] | torch.Tensor, max_new_tokens: int, seed: int | None = None, ignore_eos: bool = False
    ) -> Iterator[StepRecord]:
        """The decoding loop itself: one :class:`StepRecord` per committed step."""
        return self.start(prompt, max_new_tokens, seed, ignore_eos).steps()

    def generate(
        self,
        prompt: str | list[int] | torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        stream: Callable[[StreamChunk], None] | None = None,
        *,
        messages: list[dict] | None = None,
        cancel: Callable[[], bool] | None = None,
        checkpoint: str | os.PathLike | None = None,
        checkpoint_every: int = 256,
        resume: Checkpoint | None = None,
        loop_threshold: float = LOOP_THRESHOLD,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` new tokens after ``prompt`` (text or ids),
        or, given ``messages`` (``[{"role": "system" | "user" | "assistant", "content":
        ...}]``), as the assistant's reply through the tokenizer's chat template (the
        reply ends at the template's end-of-turn token).

        The same seed gives the same output; ``stream`` is called after every step
        with the new tokens (and their text, with a tokenizer); ``cancel`` too, after
        it: where it returns True the run ends there (``finish_reason ==
        "cancelled"``; a server stops a generation whose client went away). With ``checkpoint``, a
        :class:`~tokenswift.checkpoint.Checkpoint` is written there atomically every
        ``checkpoint_every`` new tokens and when the run ends, also on KeyboardInterrupt
        (the result then has ``finish_reason == "interrupted"``). ``resume`` continues
        such a checkpoint exactly (``prompt``, ``max_new_tokens``, ``seed`` and
        ``ignore_eos`` then come from it); the result holds all new tokens, the stats
        this run's part.

        The stats say what the text has become (``result.stats.health``: distinct-n
        over the last 1,024 tokens and the model's own NLL of what it emitted); a
        warning is logged when distinct-4 falls below ``loop_threshold`` (a loop; 0:
        never).
        """
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every <= 0:
            raise ValueError(f"checkpoint_every must be a positive integer, got {checkpoint_every!r}")
        run = self.start(
            prompt, max_new_tokens, seed, ignore_eos, messages=messages, resume=resume, loop_threshold=loop_threshold
        )
        if not distributed.is_primary():  # under torchrun, rank 0 alone streams and writes
            stream, checkpoint = None, None
        hook = self.plugin_manager.hook
        hook.tokenswift_generation_start(pipeline=self, prompt_ids=list(run.prompt_ids), max_new_tokens=max_new_tokens)

        stats = StatsCollector()
        consumers: list[Callable[[StepRecord], None]] = [stats, lambda record: hook.tokenswift_step_end(pipeline=self, step=record)]
        if stream is not None:
            decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
            if decoder is not None and resume is not None:
                decoder.prime(list(resume.tokens))  # stream deltas continue the resumed text seamlessly
            consumers.append(lambda record: stream(
                StreamChunk(tokens=record.emitted, text=decoder.push(record.emitted) if decoder else None)
            ))
        if checkpoint is not None:
            consumers.append(_PeriodicCheckpoint(run, checkpoint, checkpoint_every))
        try:
            with deferred_interrupts() as interrupted:
                for record in run.steps():
                    for consume in consumers:
                        consume(record)
                    if interrupted():
                        raise KeyboardInterrupt
                    if cancel is not None and cancel():
                        run.finish_reason = "cancelled"
                        break
        except KeyboardInterrupt:
            logger.warning("interrupted after %d new tokens", len(run.new_tokens))
            run.finish_reason = "interrupted"
        if checkpoint is not None:
            run.checkpoint(run.finish_reason).save(checkpoint)

        new_tokens = list(run.new_tokens)
        text = self.tokenizer.decode(new_tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        result = GenerationResult(
            tokens=new_tokens,
            text=text,
            stats=stats.stats(
                prompt_tokens=len(run.prompt_ids),
                new_tokens=len(new_tokens),
                resumed_tokens=len(resume.tokens) if resume is not None else 0,
                seconds=time.perf_counter() - run.started,
                prefill_seconds=run.prefill_seconds,
                finish_reason=run.finish_reason,
                dtype=str(self.runner.dtype).removeprefix("torch."),
                compiled=run.compiled,
                compile_seconds=run.compile_seconds,
            ),
            seed=run.seed,
            prompt_tokens=run.prompt_ids,
        )
        hook.tokenswift_generation_end(pipeline=self, result=result)
        return result


class _PeriodicCheckpoint:
    """A step consumer that saves the generation's checkpoint every ``every`` new tokens."""

    def __init__(self, run: Generation, path: str | os.PathLike, every: int) -> None:
        self.run, self.path, self.every = run, path, every
        self.next = (len(run.new_tokens) // every + 1) * every

    def __call__(self, record: StepRecord) -> None:
        if self.next <= record.generated < self.run.max_new_tokens:
            self.run.checkpoint().save(self.path)
            self.next = (record.generated // self.every + 1) * self.every
