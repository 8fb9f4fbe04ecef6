"""The long-context benchmark: the presets against ``ar`` as the prompt grows.

    tokenswift bench --contexts 2048 8192 16384 --new-tokens 256

For every context length, one held-out prompt of that many tokens is prefilled once;
every preset starts from a copy of that prefill (:class:`PrefilledPrompt`), so a 16K
context costs one long prefill, not one per method. The presets then decode in turns
(:func:`tokenswift.tools.interleaved.run_interleaved`), once per decoding (the
paper's sampling, greedy) and seed, and each gets its decode tokens/s, its ratio to
``ar`` in the same turns, its tokens per step, and a roofline beside it: the tokens/s
its memory traffic allows (weights + the KV read by each forward, per step, over the
machine's measured bandwidth, divided among the tokens a step earns). ``ar+compiled``
(compiled one-token forwards: the fastest plain decoding) decodes in the same turns
unless the sweep's own ``ar`` is compiled, and every row also has its ratio to it.

A context past the model's trained length needs RoPE scaling; :func:`auto_rope`
chooses YaRN with the smallest factor (in steps of 0.5) that covers the longest run, once
for the whole sweep (one model for every context, so ratios compare like with like).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import attrs
import torch

from tokenswift.memory import parameter_bytes
from tokenswift.tools.bench import preset_pipeline
from tokenswift.tools.interleaved import COMPILED_AR, compile_model_once, prefill_once, run_interleaved

logger = logging.getLogger(__name__)

DECODINGS = {"sampling": {}, "greedy": {"sampling": {"greedy": True}}}
TREE_SLACK = 256  # room past prompt + new tokens for a step's staged tree


def auto_rope(trained: int, needed: int) -> dict | None:
    """YaRN scaling that covers ``needed`` positions of a model trained on ``trained``
    (the smallest factor in steps of 0.5), or None when none is needed."""
    if needed <= trained:
        return None
    return {"type": "yarn", "factor": math.ceil(2 * needed / trained) / 2}


def measure_bandwidth(device: torch.device | str = "cpu", mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of reading a ``mib`` MiB tensor (the best of ``repeats``)."""
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    best = math.inf
    for _ in range(repeats):
        if data.device.type == "cuda":
            torch.cuda.synchronize(data.device)
        started = time.perf_counter()
        data.sum().item()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


@attrs.frozen(kw_only=True)
class Roofline:
    """What memory traffic allows: ``weights`` bytes read by every forward, ``kv_per_position``
    bytes of KV per cached position, over ``bandwidth`` bytes per second."""

    weights: int
    kv_per_position: int
    bandwidth: float

    def forward_seconds(self, positions: float) -> float:
        return (self.weights + self.kv_per_position * positions) / self.bandwidth

    def tokens_per_second(self, context: int, new_tokens: int, tokens_per_step: float,
                          drafting_passes_per_step: float = 0.0, view_positions: int = 0) -> float:
        """The roofline tokens/s of a run: each step reads the weights and the whole KV
        (mean context over the run) once, plus the weights and a drafting view's KV per
        drafting pass; ``tokens_per_step`` share it."""
        mean_context = context + new_tokens / 2
        step = self.forward_seconds(mean_context) + drafting_passes_per_step * self.forward_seconds(min(view_positions, mean_context))
        return tokens_per_step / step


def run_contexts(
    model,
    tokenizer,
    prompt_for: Callable[[int], list[int]],
    *,
    contexts: list[int],
    new_tokens: int,
    presets: list[str],
    decodings: list[str],
    seeds: list[int],
    heads: str = "auto",
    overrides: dict | None = None,
    bandwidth: float | None = None,
    compiled_baseline: bool = True,
    references: dict | None = None,
    progress: Callable[[str, int], None] | None = None,
    on_context: Callable[[dict], None] | None = None,
) -> dict:
    """Every context: one prefill, then each decoding's presets in turns (``ar`` first,
    the reference), once per seed; ``overrides`` (spec sections) go to every preset.
    With ``compiled_baseline``, ``ar+compiled`` joins the turns (compiled once, before
    any), unless the sweep's ``ar`` is compiled already. Returns a JSON-ready report;
    ``on_context`` gets it after each context (a long sweep interrupted keeps what it
    measured). ``references``: name -> a loaded :class:`tokenswift.tools.llamacpp.LlamaCpp`,
    each decoding every context's prompt on its own after the presets' turns."""
    # label -> (preset, its compile choice; None: as ``overrides`` say)
    variants = {name: (name, None) for name in ["ar", *[p for p in presets if p != "ar"]]}
    ar_compiled = (overrides or {}).get("model", {}).get("compile") is True
    if compiled_baseline and not ar_compiled:
        variants = {"ar": ("ar", None), COMPILED_AR: ("ar", True), **variants}
    names = list(variants)
    baseline = "ar" if ar_compiled else COMPILED_AR if compiled_baseline else None
    bandwidth = bandwidth or measure_bandwidth(next(model.parameters()).device)
    report = {"bandwidth_gb_s": round(bandwidth / 1e9, 2), "rows": [], "prefill_seconds": {}}
    if COMPILED_AR in names or ar_compiled:
        # The tree sizes a speculative preset would compile too, before any timed turn: a
        # cold compile met mid-turn (minutes on two cores) was once counted as decoding.
        speculative = any(preset != "ar" for preset, _ in variants.values())
        report["compile_seconds"] = round(compile_model_once(model, tokenizer, trees=speculative), 1)
    for context in contexts:
        prompt = prompt_for(context)
        pipelines = {decoding: {} for decoding in decodings}
        for decoding in decodings:
            for name, (preset, compile) in variants.items():
                spec = {**(overrides or {}), **DECODINGS[decoding]}
                if compile is not None:
                    spec["model"] = {**spec.get("model", {}), "compile": compile}
                pipelines[decoding][name] = preset_pipeline(preset, model, tokenizer, heads=heads, overrides=spec)
        every = [pipe for by_name in pipelines.values() for pipe in by_name.values()]
        if "compile_seconds" in report:  # the drafters' compiled levels too, before any timed turn
            report["compile_seconds"] = round(report["compile_seconds"] + sum(pipe.drafter.compile_now() for pipe in every), 1)
        capacity = max(pipe.kv_capacity(context, new_tokens) for pipe in every)
        prefilled = prefill_once({i: p for i, p in enumerate(every)}, prompt, capacity)
        report["prefill_seconds"][str(context)] = round(prefilled.seconds, 2)
        logger.info("context %d: prefilled once in %.1f s", context, prefilled.seconds)
        runner = every[0].runner
        roofline = Roofline(
            weights=parameter_bytes(model), kv_per_position=runner.kv_bytes(1), bandwidth=bandwidth,
        )
        for decoding in decodings:
            totals = {name: {"tokens": 0, "seconds": 0.0, "steps": 0.0, "passes": 0, "same": True} for name in names}
            for seed in seeds:
                results = run_interleaved(pipelines[decoding], prompt, new_tokens, seed=seed, progress=progress,
                                          prefilled=prefilled)
                for name, result in results.items():
                    total = totals[name]
                    total["tokens"] += result.new_tokens
                    total["seconds"] += result.decode_seconds
                    total["steps"] += result.new_tokens / result.tokens_per_step if result.tokens_per_step else 0
                    total["passes"] += result.decisions.get("drafting_passes", 0)
                    total["same"] &= result.tokens == results["ar"].tokens
            ar_speed = totals["ar"]["tokens"] / totals["ar"]["seconds"]
            baseline_speed = totals[baseline]["tokens"] / totals[baseline]["seconds"] if baseline else None
            for name in names:
                total = totals[name]
                speed = total["tokens"] / total["seconds"]
                per_step = total["tokens"] / total["steps"] if total["steps"] else 1.0
                passes = total["passes"] / total["steps"] if total["steps"] else 0.0
                view = _view_positions(pipelines[decoding][name], context + new_tokens)
                report["rows"].append({
                    "context": context, "decoding": decoding, "method": name,
                    "tokens_per_second": round(speed, 3), "ratio_to_ar": round(speed / ar_speed, 3),
                    "ratio_to_ar_compiled": round(speed / baseline_speed, 3) if baseline_speed else None,
                    "tokens_per_step": round(per_step, 3), "drafting_passes_per_step": round(passes, 3),
                    "roofline_tokens_per_second": round(
                        roofline.tokens_per_second(context, new_tokens, per_step, passes, view), 2),
                    "same_tokens_as_ar": total["same"],
                })
            for name, reference in (references or {}).items():
                report["rows"].append(_reference_row(
                    name, reference, pipelines[decoding]["ar"], prompt, new_tokens, seeds, progress,
                    context=context, decoding=decoding, ar_speed=ar_speed, baseline_speed=baseline_speed,
                ))
        del pipelines, every, prefilled
        if on_context is not None:
            on_context(report)
    return report


def _reference_row(name, reference, ar_pipeline, prompt, new_tokens, seeds, progress, *, context, decoding,
                   ar_speed, baseline_speed) -> dict:
    """A reference method's row: the same prompt and settings as ``ar``'s, once per seed,
    decoded on its own (not in the turns; its ratios are to the turns' speeds)."""
    from tokenswift.tools.llamacpp import Sampling

    sampling = Sampling.of(ar_pipeline)
    results = [reference.decode(name, prompt, new_tokens, sampling, seed=seed, progress=progress) for seed in seeds]
    seconds = sum(r.decode_seconds for r in results)
    speed = sum(r.new_tokens - 1 for r in results) / seconds if seconds else 0.0
    return {
        "context": context, "decoding": decoding, "method": name, "tokens_per_second": round(speed, 3),
        "ratio_to_ar": round(speed / ar_speed, 3),
        "ratio_to_ar_compiled": round(speed / baseline_speed, 3) if baseline_speed else None,
        "tokens_per_step": None, "drafting_passes_per_step": None, "roofline_tokens_per_second": None,
        "same_tokens_as_ar": None, "in_turns": False, "prefill_seconds": results[0].prefill_seconds,
        "threads": results[0].threads,
    }


def _view_positions(pipeline, positions: int) -> int:
    """Positions a drafting pass reads: the cache policy's view, else the whole context."""
    kept = pipeline.cache_policy.view_positions(positions)
    return kept if kept else positions


def markdown(report: dict) -> str:
    lines = [
        "| context | decoding | method | decode tok/s | vs ar | vs ar compiled | tok/step | drafting passes/step "
        "| roofline tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    def cell(value):
        return "–" if value is None else value

    for row in report["rows"]:
        lines.append(
            f"| {row['context']} | {row['decoding']} | {row['method']} | {row['tokens_per_second']} | "
            f"{row['ratio_to_ar']} | {cell(row.get('ratio_to_ar_compiled'))} | "
            f"{cell(row['tokens_per_step'])} | {cell(row['drafting_passes_per_step'])} | "
            f"{cell(row['roofline_tokens_per_second'])} |"
        )
    notes, noted = [], set()
    for row in report["rows"]:  # the first run per prompt prefills it; later ones reuse llama.cpp's cache
        if row.get("in_turns") is False and (row["method"], row["context"]) not in noted:
            noted.add((row["method"], row["context"]))
            notes.append(f"{row['method']} at {row['context']:,}: prefill {row['prefill_seconds']} s")
    if notes:
        lines.append("")
        lines.append("Reference methods decode on their own after the turns (their ratios are to the turns' speeds); "
                     + "; ".join(notes) + ".")
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """Speedup over ar vs context, one line per method and decoding (the paper's figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in report["rows"]:
        if row["method"] != "ar":
            series.setdefault((row["method"], row["decoding"]), []).append((row["context"], row["ratio_to_ar"]))
    alone = {row["method"] for row in report["rows"] if row.get("in_turns") is False}
    for (method, decoding), points in sorted(series.items()):
        xs, ys = zip(*sorted(points))
        if method in alone:  # not in the turns: open markers, and the legend says so
            ax.plot(xs, ys, marker="o", markerfacecolor="none", linestyle=":", label=f"{method} ({decoding}, run alone)")
        else:
            ax.plot(xs, ys, marker="o", linestyle="-" if decoding == "greedy" else "--", label=f"{method} ({decoding})")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    contexts = sorted({row["context"] for row in report["rows"]})
    ax.set_xticks(contexts, [f"{c:,}" for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens (context)")
    ax.set_ylabel("decode tokens/s vs ar (same run)")
    ax.set_title(report.get("title", "speedup vs context"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
