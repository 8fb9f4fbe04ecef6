"""Speed ratios that a noisy machine cannot fake: pipelines decoding in turns.

On a shared machine the speed of a core drifts by tens of percent within a minute, so
two methods timed one after the other can differ by more than any effect of the
methods themselves. Here every pipeline decodes the same prompt with the same seed,
in turns of ``turn_tokens`` tokens, all in one process on one model: drift falls on
every method alike, and the ratio of their decode speeds is what the methods do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import attrs

from tokenswift.stats import StatsCollector


@attrs.frozen(kw_only=True)
class InterleavedResult:
    name: str
    new_tokens: int
    decode_seconds: float
    prefill_seconds: float
    tokens_per_second: float  # decoding only: every method prefills the same prompt alike
    tokens_per_step: float
    decisions: dict
    tokens: list[int] = attrs.field(repr=False)

    def ratio_to(self, other: InterleavedResult) -> float:
        return self.tokens_per_second / other.tokens_per_second if other.tokens_per_second else 0.0


def run_interleaved(
    pipelines: Mapping[str, object],
    prompt: list[int],
    new_tokens: int,
    *,
    seed: int = 0,
    turn_tokens: int = 32,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, InterleavedResult]:
    """Decode ``new_tokens`` after ``prompt`` with every pipeline, in turns."""
    runs, steps, collectors, seconds = {}, {}, {}, {}
    for name, pipe in pipelines.items():
        run = pipe.start(prompt, new_tokens, seed=seed, ignore_eos=True)
        run.prefill()
        runs[name], steps[name], collectors[name], seconds[name] = run, run.steps(), StatsCollector(), 0.0
    active = list(runs)
    while active:
        for name in list(active):
            run, target = runs[name], min(new_tokens, len(runs[name].new_tokens) + turn_tokens)
            started = time.perf_counter()
            while len(run.new_tokens) < target:
                record = next(steps[name], None)
                if record is None:
                    break
                collectors[name](record)
                if progress is not None:
                    progress(name, len(record.emitted))
            seconds[name] += time.perf_counter() - started
            if len(run.new_tokens) >= new_tokens or run.finish_reason != "length":
                active.remove(name)
    results = {}
    for name, run in runs.items():
        stats = collectors[name].stats(
            prompt_tokens=len(prompt), new_tokens=len(run.new_tokens), seconds=seconds[name] + run.prefill_seconds,
            prefill_seconds=run.prefill_seconds, finish_reason=run.finish_reason,
        )
        results[name] = InterleavedResult(
            name=name,
            new_tokens=len(run.new_tokens),
            decode_seconds=round(seconds[name], 3),
            prefill_seconds=round(run.prefill_seconds, 3),
            tokens_per_second=round(len(run.new_tokens) / seconds[name], 3) if seconds[name] else 0.0,
            tokens_per_step=round(stats.tokens_per_step, 3),
            decisions=stats.decisions(),
            tokens=list(run.new_tokens),
        )
    return results
