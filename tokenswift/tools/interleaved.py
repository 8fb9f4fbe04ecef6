"""Speed ratios that a noisy machine cannot fake: pipelines decoding in turns.

On a shared machine the speed of a core drifts by tens of percent within a minute, so
two methods timed one after the other can differ by more than any effect of the
methods themselves. Here every pipeline decodes the same prompt with the same seed,
in turns of ``turn_tokens`` tokens, all in one process on one model: drift falls on
every method alike, and the ratio of their decode speeds is what the methods do. The
order of the turns is reversed every round, so no method always follows another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import torch

from tokenswift.compiling import compile_calibration_for_trees, compile_trees_now
from tokenswift.model.runner import PrefilledPrompt
from tokenswift.stats import StatsCollector
from tokenswift.tools.bench import preset_pipeline

logger = logging.getLogger(__name__)


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


def prefill_once(pipelines: dict, prompt: list[int], capacity: int, saved: Path | None = None) -> PrefilledPrompt:
    """Prefill ``prompt`` once, in the first pipeline's runner (sized for the runs), with
    the prompt features the most demanding drafter wants (of every layer any reads).
    With ``saved`` (a safetensors file): the prefill read from there when it holds this
    prompt's, for this model (weights, dtype and RoPE) and these features, else computed
    and written there (a 32K-token prefill takes ~8 minutes on a 2-core AVX2 machine,
    reading it back seconds)."""
    first = next(iter(pipelines.values()))
    wanted = max(max(1, pipe.drafter.prompt_features) for pipe in pipelines.values())
    layers = tuple(sorted({k for pipe in pipelines.values() for k in pipe.drafter.feature_layers}))
    first.runner.allocate(capacity)
    identity = _prefill_identity(first.runner.model, prompt, wanted, layers)
    if saved is not None and Path(saved).exists():
        loaded = _read_prefill(Path(saved), first.runner.model, identity)
        if loaded is not None:
            return loaded
        logger.warning("%s holds another prefill (prompt, model or features differ): computing it again", saved)
    prefilled = first.runner.prefill_prompt(prompt, keep_hidden=wanted, layers=layers)
    if saved is not None:
        _write_prefill(Path(saved), prefilled, identity)
    return prefilled


def _prefill_identity(model, prompt: list[int], wanted: int, layers: tuple[int, ...]) -> str:
    """What a saved prefill must match: the model's weights (fingerprint), dtype and RoPE
    scaling, the prompt's ids, the features kept."""
    from tokenswift.drafters.draft_heads import model_fingerprint

    config = model.config
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    text = json.dumps({"model": model_fingerprint(model), "dtype": str(next(model.parameters()).dtype),
                       "rope": rope, "layers": list(layers), "hidden": wanted}, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode())
    digest.update(torch.tensor(prompt, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()


def _write_prefill(path: Path, prefilled: PrefilledPrompt, identity: str) -> None:
    from safetensors.torch import save_file

    tensors = {f"keys.{i}": k.contiguous() for i, k in enumerate(prefilled.keys)}
    tensors.update({f"values.{i}": v.contiguous() for i, v in enumerate(prefilled.values)})
    if prefilled.hidden is not None:
        tensors["hidden"] = prefilled.hidden.contiguous()
    tensors["tokens"] = torch.tensor(prefilled.tokens, dtype=torch.int64)
    metadata = {"identity": identity, "seconds": repr(prefilled.seconds), "layers": json.dumps(list(prefilled.layers))}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)
    logger.info("prefill saved to %s", path)


def _read_prefill(path: Path, model, identity: str) -> PrefilledPrompt | None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("identity") != identity:
        return None
    tensors = load_file(str(path))
    count = sum(1 for name in tensors if name.startswith("keys."))
    logger.info("prefill read from %s", path)
    return PrefilledPrompt(
        tokens=tuple(tensors["tokens"].tolist()), keys=[tensors[f"keys.{i}"] for i in range(count)],
        values=[tensors[f"values.{i}"] for i in range(count)], hidden=tensors.get("hidden"), model=model,
        seconds=float(metadata["seconds"]), layers=tuple(json.loads(metadata["layers"])),
    )


def run_interleaved(
    pipelines: Mapping[str, object],
    prompt: list[int],
    new_tokens: int,
    *,
    seed: int = 0,
    turn_tokens: int = 8,
    progress: Callable[[str, int], None] | None = None,
    prefilled: PrefilledPrompt | None = None,
) -> dict[str, InterleavedResult]:
    """Decode ``new_tokens`` after ``prompt`` with every pipeline, in turns; with
    ``prefilled`` (the prompt prefilled once), every run starts from a copy of it."""
    runs, steps, collectors, seconds = {}, {}, {}, {}
    for name, pipe in pipelines.items():
        run = pipe.start(prompt, new_tokens, seed=seed, ignore_eos=True)
        run.prefill(prefilled)
        runs[name], steps[name], collectors[name], seconds[name] = run, run.steps(), StatsCollector(), 0.0
    active, rounds = list(runs), 0
    while active:
        rounds += 1
        for name in list(active if rounds % 2 else reversed(active)):
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


# bench --compile: which [model] compile choices each preset runs with, and their labels.
COMPILE_MODES = {"off": (False,), "on": (True,), "both": (False, True), "all": (False, True, "auto")}
SUFFIXES = {False: "", True: "+compiled", "auto": "+auto"}
# The fastest plain decoding, which every preset is also reported against.
COMPILED_AR = "ar+compiled"


def variant_names(presets: list[str], compile: str, compiled_baseline: bool = True) -> dict[str, tuple[str, bool | str]]:
    """The pipelines a comparison runs, by label: each preset eager (``PRESET``),
    compiled (``PRESET+compiled``) and/or as ``compile = "auto"`` decides
    (``PRESET+auto``), ``ar`` first (the reference); with ``compiled_baseline``,
    ``ar+compiled`` too, whatever ``compile`` says."""
    names = ["ar", *[p for p in presets if p != "ar"]]
    choices = COMPILE_MODES[compile]
    ar_choices = (*choices, True) if compiled_baseline and True not in choices else choices
    return {
        f"{name}{SUFFIXES[choice]}": (name, choice)
        for name in names for choice in (ar_choices if name == "ar" else choices)
    }


def same_compile_ar(label: str, variants: dict[str, tuple[str, bool | str]]) -> str:
    """The ``ar`` variant with the compile choice of ``label``'s."""
    return f"ar{SUFFIXES[variants[label][1]]}"


def compile_model_once(model, tokenizer, trees: bool = False) -> float:
    """Compile ``model``'s one-token forward now (outside any timed turn), and with
    ``trees`` the tree sizes compiled runs use (:func:`~tokenswift.compiling.compile_trees_now`),
    having measured the compile calibration their prices come from where none is cached
    (:func:`~tokenswift.compiling.compile_calibration_for_trees`); the seconds."""
    pipe = preset_pipeline("ar", model, tokenizer, overrides={"model": {"compile": True}})
    seconds = pipe.generate([0, 1, 2, 3], 2, seed=0, ignore_eos=True).stats.compile_seconds
    if not trees:
        return seconds
    compile_calibration_for_trees(pipe.runner)
    return seconds + compile_trees_now(pipe.runner)


def compare_presets(
    model,
    tokenizer,
    presets: list[str],
    prompt: list[int],
    new_tokens: int,
    *,
    seeds: list[int],
    greedy: bool = False,
    heads: str = "auto",
    compile: str = "off",
    compiled_baseline: bool = True,
    progress: Callable[[str, int], None] | None = None,
) -> dict:
    """Every preset (``ar`` first, the reference) in turns with the others, once per
    seed, eager and/or compiled (``compile``: a key of :data:`COMPILE_MODES`); returns a JSON-ready
    report with each one's decode tokens/s summed over the seeds, its ratio to ``ar``
    with the same compile choice (``ratio_to_ar``) and, with ``compiled_baseline`` (the
    fastest plain decoding in the turns whatever ``compile`` says), to ``ar+compiled``
    (``ratio_to_ar_compiled``), and what compiling took."""
    variants = variant_names(presets, compile, compiled_baseline)
    compiles = any(choice is not False for _, choice in variants.values())
    speculative = any(choice is not False and preset != "ar" for preset, choice in variants.values())
    compile_seconds = compile_model_once(model, tokenizer, trees=speculative) if compiles else None
    overrides = {"sampling": {"greedy": True}} if greedy else {}
    totals = {name: {"tokens": 0, "seconds": 0.0, "steps_tokens": []} for name in variants}
    per_seed = []
    reference = next(iter(variants))
    prefilled = None
    for seed in seeds:
        pipes = {
            label: preset_pipeline(name, model, tokenizer, heads=heads, overrides={**overrides, "model": {"compile": choice}})
            for label, (name, choice) in variants.items()
        }
        if compile_seconds is not None:  # the drafters' compiled levels too, before any timed turn
            compile_seconds += sum(pipes[label].drafter.compile_now() for label, (_, choice) in variants.items()
                                   if choice is not False)
        if prefilled is None:  # one prefill of the prompt, copied into every run
            prefilled = prefill_once(pipes, prompt, max(p.kv_capacity(len(prompt), new_tokens) for p in pipes.values()))
        results = run_interleaved(pipes, prompt, new_tokens, seed=seed, progress=progress, prefilled=prefilled)
        per_seed.append({
            "seed": seed,
            **{name: {**attrs.asdict(r, filter=lambda a, _: a.name != "tokens"),
                      "ratio_to_ar": round(r.ratio_to(results[same_compile_ar(name, variants)]), 3),
                      "same_tokens_as_ar": r.tokens == results[reference].tokens} for name, r in results.items()},
        })
        for name, r in results.items():
            totals[name]["tokens"] += r.new_tokens
            totals[name]["seconds"] += r.decode_seconds
            totals[name]["steps_tokens"].append(r.tokens_per_step)
    speed = {name: t["tokens"] / t["seconds"] if t["seconds"] else 0.0 for name, t in totals.items()}

    def ratio(name, to):
        return round(speed[name] / speed[to], 3) if to in speed and speed[to] else None

    summary = {
        name: {
            "tokens_per_second": round(speed[name], 3),
            "ratio_to_ar": ratio(name, same_compile_ar(name, variants)),
            "ratio_to_ar_compiled": ratio(name, COMPILED_AR),
            "tokens_per_step": round(sum(t["steps_tokens"]) / len(t["steps_tokens"]), 3),
        }
        for name, t in totals.items()
    }
    return {"summary": summary, "per_seed": per_seed, "reference": reference, "compile_seconds": compile_seconds}


def markdown(report: dict) -> str:
    lines = ["| preset | decode tok/s | vs ar (same compile) | vs ar compiled | tok/step | "
             "verified / proposed nodes per step | predicted / realised tok/step |",
             "|---|---|---|---|---|---|---|"]
    for name, row in report["summary"].items():
        decisions = [seed[name]["decisions"] for seed in report["per_seed"]]
        verified = sum(d["verified_per_step"] for d in decisions) / len(decisions)
        proposed = sum(d["candidates_per_step"] for d in decisions) / len(decisions)
        predicted = [d["predicted_tokens_per_step"] for d in decisions if d["predicted_tokens_per_step"] is not None]
        realised = [d["realised_tokens_per_step"] for d in decisions if d["realised_tokens_per_step"] is not None]
        guess = f"{sum(predicted) / len(predicted):.3f} / {sum(realised) / len(realised):.3f}" if predicted else "– (fixed trees)"
        versus_compiled = row.get("ratio_to_ar_compiled")
        lines.append(f"| {name} | {row['tokens_per_second']} | {row['ratio_to_ar']} | "
                     f"{'–' if versus_compiled is None else versus_compiled} | {row['tokens_per_step']} | "
                     f"{verified:.2f} / {proposed:.2f} | {guess} |")
    notes = []
    if report.get("compile_seconds") is not None:
        notes.append(
            f"Compiling the one-token forward (and the tree sizes compiled presets use) took "
            f"{report['compile_seconds']:.1f} s (once per process, before the timed turns)."
        )
    if report.get("roofline") is not None:
        roof = report["roofline"]
        speeds = ", ".join(f"`{name}` {row['ms_per_token']:.1f} ms ({row['fraction']:.0%} of the floor)" for name, row in roof["ar"].items())
        notes.append(f"Per token: {speeds}; the memory floor (weights + mean context's KV over "
                     f"{roof['bandwidth_gb_s']} GB/s) is {roof['floor_ms']:.1f} ms.")
    return "\n".join(lines) + "\n" + "".join(f"\n{note}\n" for note in notes)
