"""What a generation did: one record per step, the stage clock, and the totals."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import attrs
import torch

from tokenswift.health import EMPTY_SUMMARY, TextHealth

# propose: drafter and retriever, the tree chosen; forward: the verify forward;
# verify: scoring the nodes the verifier visits and walking the tree; commit: the KV
# keeps the accepted path, the tokens are appended, the components observe.
STAGES = ("propose", "forward", "verify", "commit")


class ModelTime(threading.local):
    """Seconds a thread spent in the models' own computation: the target's forwards
    and LM-head products, a drafter's network (its layer, its heads). Code that runs a
    model wraps it in :meth:`measure`; a :class:`StageClock` charges each stage the part
    of its time that was the model's, so that a profile tells the model from what
    surrounds it (ranking, penalties, draws, trees, bookkeeping). Nested measures count
    once; each thread counts its own (a server's generation thread beside the tests' or a
    client's). Wall time of the calling thread: on a GPU the kernels a measure launched may
    run after it (the clock's laps wait for them, the measures do not)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    @contextlib.contextmanager
    def measure(self):
        self._depth += 1
        started = time.perf_counter() if self._depth == 1 else None
        try:
            yield
        finally:
            self._depth -= 1
            if started is not None:
                self.seconds += time.perf_counter() - started


MODEL_TIME = ModelTime()


def model_time(function):
    """Decorate a method that runs a model: its time counts as the model's (:class:`ModelTime`)."""

    @functools.wraps(function)
    def measured(*args, **kwargs):
        with MODEL_TIME.measure():
            return function(*args, **kwargs)

    return measured


class StageClock:
    """Seconds per stage of one step. :meth:`lap` charges the time since the previous
    lap to a stage; on a GPU it first waits for the device, so a stage is charged for
    the kernels it launched rather than the next stage."""

    def __init__(self, device: torch.device) -> None:
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None
        self._last = time.perf_counter()
        self._model_last = MODEL_TIME.seconds
        self.seconds: dict[str, float] = {}
        self.model_seconds: dict[str, float] = {}  # per stage, the part of it that was the model's

    def start(self) -> None:
        if self._sync is not None:
            self._sync()
        self._last = time.perf_counter()
        self._model_last = MODEL_TIME.seconds
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.model_seconds = dict.fromkeys(STAGES, 0.0)

    def lap(self, stage: str) -> None:
        if self._sync is not None:
            self._sync()
        now, model = time.perf_counter(), MODEL_TIME.seconds
        self.seconds[stage] += now - self._last
        self.model_seconds[stage] += model - self._model_last
        self._last, self._model_last = now, model


@attrs.frozen(kw_only=True, eq=False)
class StepRecord:
    """One committed step, as observers see it."""

    step: int
    verified: int  # nodes below the root that were verified
    depth: int  # the verified tree's depth (0: nothing drafted)
    accepted: int  # drafted tokens accepted and emitted
    retrieved: int  # of those, the ones from retriever branches
    emitted: list[int]  # accepted tokens + bonus (cut at max_new_tokens / EOS)
    generated: int  # new tokens so far, these included
    seconds: float  # since generation start
    stage_seconds: dict[str, float] = attrs.field(factory=dict)  # this step's, per stage (STAGES)
    model_seconds: dict[str, float] = attrs.field(factory=dict)  # the part of each stage that was the models' (ModelTime)
    candidates: int = 0  # nodes proposed below the root (`verified` of them were verified)
    drafting_pass: bool = False  # a drafting pass of the root ran
    predicted_tokens: float | None = None  # expected tokens of the chosen tree (None: a fixed tree)
    predicted_seconds: float | None = None  # its predicted forward + scoring time
    forward_seconds: float = 0.0  # the verify forward's measured time
    nll: list[float] = attrs.field(factory=list)  # the model's own NLL of each emitted token (raw logits, nats)
    health: TextHealth | None = None  # the text's health after this step (tokenswift.health)


@attrs.frozen(kw_only=True)
class GenerationStats:
    """What one generation did and how long it took."""

    prompt_tokens: int
    new_tokens: int
    steps: int
    seconds: float  # prefill + decode
    prefill_seconds: float
    verified_tokens: int  # verified tree nodes below the root, summed over steps
    accepted_tokens: int  # verified tokens that were accepted
    retrieved_accepted_tokens: int  # of those, the ones from retriever branches
    draft_depth: int  # sum over steps of the tree depth (the paper's "steps x k")
    tokens_per_step_histogram: dict[int, int]
    stage_seconds: dict[str, float]
    finish_reason: str  # "length", "eos", "interrupted" or "non-finite scores" (text so far kept)
    dtype: str = ""  # the model's dtype
    candidate_tokens: int = 0  # nodes proposed below the root, summed over steps (verified_tokens of them verified)
    drafting_passes: int = 0  # steps that ran a drafting pass
    predicted_tokens: float = 0.0  # expected tokens of the chosen trees, summed over the steps that chose one
    predicted_seconds: float = 0.0  # their predicted forward + scoring seconds
    chosen_steps: int = 0  # steps whose tree was chosen by the cost model
    chosen_tokens: int = 0  # tokens those steps emitted
    forward_seconds: float = 0.0  # measured verify-forward seconds of those steps
    compiled: bool = False  # one-token forwards ran compiled (tokenswift.model.compiled)
    compile_seconds: float = 0.0  # what compiling took during this run (in `seconds`)
    health: TextHealth | None = None  # the text's health at the end (None: no step ran)
    model_stage_seconds: dict[str, float] = attrs.field(factory=dict)  # per stage, the models' part of stage_seconds
    # per kind of step ("speculated": it verified candidates; "plain": the root alone), its
    # totals: steps, tokens, seconds (wall, step to step), per-stage seconds and the models'
    # part of them (StatsCollector)
    step_kinds: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    resumed_tokens: int = 0  # of new_tokens, the ones a checkpoint brought (no step of this run emitted them)

    @property
    def decoded_tokens(self) -> int:
        """The new tokens this run's steps emitted: what its rates count. A resumed run
        counted the checkpoint's as well, so a 100K run resumed at 41K reported 1.7
        tokens a step where its steps emitted 1.003."""
        return self.new_tokens - self.resumed_tokens

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.prefill_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.decoded_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.decoded_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / (steps x tree depth), as the paper defines it."""
        return self.accepted_tokens / self.draft_depth if self.draft_depth else 0.0

    @property
    def retriever_share(self) -> float:
        return self.retrieved_accepted_tokens / self.accepted_tokens if self.accepted_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "resumed_tokens": self.resumed_tokens,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
            "tokens_per_step": round(self.tokens_per_step, 3),
            "acceptance_rate": round(self.acceptance_rate, 3),
            "retriever_share": round(self.retriever_share, 3),
            **(self.health.summary() if self.health is not None else EMPTY_SUMMARY),
            "compiled": self.compiled,
            "compile_seconds": round(self.compile_seconds, 2),
            "finish_reason": self.finish_reason,
        }

    def stage_profile(self) -> dict[str, Any]:
        """Where a step's time went, per kind of step (``speculated`` steps verified
        candidates, ``plain`` ones the root alone, whatever was proposed): steps, tokens per
        step, wall ms per step, and per stage (:data:`STAGES`) its ms per step and the
        models' part of it (``model_ms``: forwards, LM-head rows, a drafter's network);
        ``other_ms``: the wall time outside the stages (observers, streaming, checkpoints).
        A graph loaded or compiled at a step counts in its forward."""
        profile = {}
        for kind, totals in self.step_kinds.items():
            steps = totals["steps"]
            if not steps:
                continue
            ms = {stage: round(1000 * seconds / steps, 2) for stage, seconds in totals["stages"].items()}
            profile[kind] = {
                "steps": steps,
                "tokens_per_step": round(totals["tokens"] / steps, 3),
                "ms_per_step": round(1000 * totals["seconds"] / steps, 2),
                "stage_ms": ms,
                "model_ms": {stage: round(1000 * seconds / steps, 2) for stage, seconds in totals["model"].items()},
                "other_ms": round(1000 * totals["seconds"] / steps - sum(ms.values()), 2),
            }
        return profile

    def decisions(self) -> dict[str, Any]:
        """How the chosen trees did: verified vs proposed nodes, predicted vs realised
        tokens per step, predicted vs measured forward seconds per step."""
        chosen = self.chosen_steps
        return {
            "candidates_per_step": round(self.candidate_tokens / self.steps, 2) if self.steps else 0.0,
            "verified_per_step": round(self.verified_tokens / self.steps, 2) if self.steps else 0.0,
            "drafting_passes": self.drafting_passes,
            "predicted_tokens_per_step": round(self.predicted_tokens / chosen, 3) if chosen else None,
            "realised_tokens_per_step": round(self.chosen_tokens / chosen, 3) if chosen else None,
            "predicted_ms_per_step": round(1000 * self.predicted_seconds / chosen, 2) if chosen else None,
            "forward_ms_per_step": round(1000 * self.forward_seconds / chosen, 2) if chosen else None,
        }


class StatsCollector:
    """Totals over a generation's step records (a consumer of ``Generation.steps()``)."""

    def __init__(self) -> None:
        self.steps = self.verified = self.accepted = self.retrieved = self.depth = 0
        self.candidates = self.passes = self.chosen_steps = self.chosen_tokens = 0
        self.predicted_tokens = self.predicted_seconds = self.forward_seconds = 0.0
        self.histogram: dict[int, int] = {}
        self.health: TextHealth | None = None
        self.kinds = {kind: {"steps": 0, "tokens": 0, "seconds": 0.0, "stages": dict.fromkeys(STAGES, 0.0),
                             "model": dict.fromkeys(STAGES, 0.0)} for kind in ("speculated", "plain")}
        self._last_seconds: float | None = None

    def _count_kind(self, record: StepRecord) -> None:
        kind = self.kinds["speculated" if record.verified > 0 else "plain"]
        kind["steps"] += 1
        kind["tokens"] += len(record.emitted)
        # wall time since the previous step (the first step's: its stages, the prefill before them not counted)
        previous, self._last_seconds = self._last_seconds, record.seconds
        kind["seconds"] += record.seconds - previous if previous is not None else sum(record.stage_seconds.values())
        for stage, seconds in record.stage_seconds.items():
            kind["stages"][stage] = kind["stages"].get(stage, 0.0) + seconds
        for stage, seconds in record.model_seconds.items():
            kind["model"][stage] = kind["model"].get(stage, 0.0) + seconds

    def _total(self, part: str) -> dict[str, float]:
        """Per stage, the seconds of both kinds of step (``part``: "stages" or "model")."""
        return {stage: sum(kind[part].get(stage, 0.0) for kind in self.kinds.values()) for stage in STAGES}

    def __call__(self, record: StepRecord) -> None:
        self._count_kind(record)
        self.steps += 1
        self.health = record.health
        self.candidates += record.candidates
        self.passes += record.drafting_pass
        if record.predicted_tokens is not None:
            self.chosen_steps += 1
            self.chosen_tokens += len(record.emitted)
            self.predicted_tokens += record.predicted_tokens
            self.predicted_seconds += record.predicted_seconds
            self.forward_seconds += record.forward_seconds
        self.verified += record.verified
        self.accepted += record.accepted
        self.retrieved += record.retrieved
        self.depth += record.depth
        emitted = len(record.emitted)
        self.histogram[emitted] = self.histogram.get(emitted, 0) + 1

    def stats(
        self, *, prompt_tokens: int, new_tokens: int, seconds: float, prefill_seconds: float, finish_reason: str, dtype: str = "",
        compiled: bool = False, compile_seconds: float = 0.0, resumed_tokens: int = 0,
    ) -> GenerationStats:
        return GenerationStats(
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            resumed_tokens=resumed_tokens,
            steps=self.steps,
            seconds=seconds,
            prefill_seconds=prefill_seconds,
            verified_tokens=self.verified,
            accepted_tokens=self.accepted,
            retrieved_accepted_tokens=self.retrieved,
            draft_depth=self.depth,
            tokens_per_step_histogram=dict(sorted(self.histogram.items())),
            stage_seconds=self._total("stages"),
            finish_reason=finish_reason,
            dtype=dtype,
            candidate_tokens=self.candidates,
            drafting_passes=self.passes,
            predicted_tokens=self.predicted_tokens,
            predicted_seconds=self.predicted_seconds,
            chosen_steps=self.chosen_steps,
            chosen_tokens=self.chosen_tokens,
            forward_seconds=self.forward_seconds,
            compiled=compiled,
            compile_seconds=compile_seconds,
            health=self.health,
            model_stage_seconds=self._total("model"),
            step_kinds={kind: {**totals, "stages": dict(totals["stages"]), "model": dict(totals["model"])}
                        for kind, totals in self.kinds.items()},
        )
