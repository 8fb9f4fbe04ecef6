"""Variants of presets in turns from one prefill: an ablation's speed, within one process.

    python benchmarks/variant_turns.py --context 8192 --new-tokens 256 --seeds 0 1 [--greedy] \
        --variant ar=ar --variant eagle=eagle --variant tokenswift=tokenswift \
        --variant 'gate-off=tokenswift:{"speculation": {"pass_gain": 1000}}' [--out DIR]

Each ``--variant LABEL=PRESET[:JSON]`` is a preset with spec overrides (a JSON table of
spec sections, merged into the preset's); a ``calibration`` table in it replaces fields
of the cached calibration its cost model prices with (what its trees would be had the
machine measured so: ``'warm=eagle:{"calibration": {"head_ms": 0.727}}'``). Every variant runs compiled, bfloat16, from
one shared prefill of the held-out prompt, in turns of 8 tokens (as ``bench
--interleaved``), alternating the order each round, so that the machine's drift hits all
alike. The first variant is the baseline of the ratios (give ``ar`` first). Prints a
markdown table (tokens/s, ratio, tokens per step, steps that speculated, drafting passes
per step, and the health of what each variant wrote: distinct-4 and recent self-NLL over
its seeds); ``--out DIR`` writes it with the per-variant figures, each seed's text and
health included, as ``turns.md`` and ``turns.json``; ``--saved-prefill FILE`` keeps the
prompt's prefill in FILE for the next run (checked against the prompt, the model and its
RoPE). Past the model's trained length the prompt's RoPE is scaled as ``bench
--contexts`` scales it.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import time
from pathlib import Path

import attrs

from tokenswift.calibration import Calibration
from tokenswift.errors import SpecError
from tokenswift.machine import machine_name
from tokenswift.model.loading import load_model
from tokenswift.presets import PRESETS
from tokenswift.spec import ModelSpec
from tokenswift.tools.bench import preset_pipeline, prompt_tokens_for
from tokenswift.tools.contexts import auto_rope
from tokenswift.tools.interleaved import compile_model_once, prefill_once

logger = logging.getLogger("variant_turns")

TURN = 8  # tokens a variant decodes before the next one's turn
CALIBRATION = "calibration"  # the overrides' table of calibration fields, not a spec section


def parse_variant(text: str) -> tuple[str, str, dict]:
    """``LABEL=PRESET[:JSON]`` -> (label, preset, overrides); a clear error otherwise."""
    label, sep, rest = text.partition("=")
    if not sep or not label.strip():
        raise ValueError(f"--variant {text!r}: expected LABEL=PRESET[:JSON overrides]")
    preset, _, overrides = rest.partition(":")
    if preset not in PRESETS:
        raise ValueError(f"--variant {text!r}: unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    try:
        table = json.loads(overrides) if overrides.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"--variant {text!r}: the overrides are not JSON ({exc})") from None
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError(f"--variant {text!r}: overrides must be a JSON table of spec sections, e.g. "
                         '{"speculation": {"plain_guard": false}}')
    fields = {field.name for field in attrs.fields(Calibration)}
    unknown = sorted(set(table.get(CALIBRATION, {})) - fields)
    if unknown:
        raise ValueError(f"--variant {text!r}: unknown calibration fields {unknown}; valid: {', '.join(sorted(fields))}")
    return label.strip(), preset, table


def run(variants: list[tuple[str, str, dict]], context: int, new_tokens: int, greedy: bool, seeds: list[int],
        trained: int = 8192, saved_prefill: Path | None = None) -> dict:
    rope = auto_rope(trained, context + new_tokens + 64) if context + new_tokens + 64 > trained else None
    model, tokenizer = load_model(ModelSpec(path="smollm2", dtype="bfloat16", rope=rope))
    prompt = prompt_tokens_for(tokenizer, context, None)
    compile_model_once(model, tokenizer, trees=True)
    pipes = {}
    for label, preset, table in variants:
        overrides = {"model": {"compile": True}, **({"sampling": {"greedy": True}} if greedy else {})}
        for section, options in table.items():
            if section != CALIBRATION:
                overrides[section] = {**overrides.get(section, {}), **options}
        pipes[label] = preset_pipeline(preset, model, tokenizer, overrides=overrides)
        pipes[label].drafter.compile_now()
        if table.get(CALIBRATION):
            costs = pipes[label].costs()
            costs.calibration = attrs.evolve(costs.calibration, **table[CALIBRATION])
    capacity = max(p.kv_capacity(len(prompt), new_tokens) for p in pipes.values())
    prefilled = prefill_once(pipes, prompt, capacity, saved=saved_prefill)
    totals = {label: collections.Counter() for label in pipes}
    texts = {label: [] for label in pipes}  # per seed, what each variant wrote, and its health
    healths = {label: [] for label in pipes}
    for seed in seeds:
        runs = {label: pipe.start(prompt, new_tokens, seed=seed, ignore_eos=True) for label, pipe in pipes.items()}
        steps = {}
        for label, generation in runs.items():
            generation.prefill(prefilled)
            steps[label] = generation.steps()
        active, rounds = list(runs), 0
        while active:
            rounds += 1
            for label in list(active if rounds % 2 else reversed(active)):
                generation, total = runs[label], totals[label]
                target = min(new_tokens, len(generation.new_tokens) + TURN)
                while len(generation.new_tokens) < target:
                    started = time.perf_counter()
                    record = next(steps[label], None)
                    if record is None:
                        break
                    total["seconds"] += time.perf_counter() - started
                    total["tokens"] += len(record.emitted)
                    total["steps"] += 1
                    total["speculated"] += record.candidates > 0
                    total["passes"] += bool(record.drafting_pass)
                if len(generation.new_tokens) >= new_tokens or generation.finish_reason != "length":
                    active.remove(label)
        for label, generation in runs.items():
            texts[label].append(tokenizer.decode(generation.new_tokens))
            healths[label].append(generation.health.health().summary())
    base = variants[0][0]
    base_rate = totals[base]["tokens"] / totals[base]["seconds"]
    rows = []
    for label, preset, table in variants:
        t = totals[label]
        rate = t["tokens"] / t["seconds"]
        rows.append({"variant": label, "preset": preset, "overrides": table, "tokens_per_second": round(rate, 3),
                     "ratio": round(rate / base_rate, 3), "tokens_per_step": round(t["tokens"] / t["steps"], 3),
                     "speculated_steps": t["speculated"], "steps": t["steps"],
                     "passes_per_step": round(t["passes"] / t["steps"], 3),
                     "health": healths[label], "texts": texts[label]})
    return {"machine": machine_name(next(model.parameters()).device), "context": context, "new_tokens": new_tokens,
            "greedy": greedy, "seeds": seeds, "rope": rope, "rows": rows}


def table(report: dict) -> str:
    base = report["rows"][0]["variant"]
    lines = [f"{report['machine']}, bfloat16, compiled, {report['context']}-token prompt, {report['new_tokens']} new "
             f"tokens, seeds {' '.join(map(str, report['seeds']))}, "
             f"{'greedy' if report['greedy'] else 'the paper sampling'}", "",
             f"| variant | preset, overrides | tok/s | vs {base} | tok/step | steps that speculated | passes/step | "
             "distinct-4 | recent self-NLL |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        spec = r["preset"] + (f" {json.dumps(r['overrides'])}" if r["overrides"] else "")
        lines.append(f"| {r['variant']} | {spec} | {r['tokens_per_second']} | {r['ratio']}x | {r['tokens_per_step']} | "
                     f"{r['speculated_steps']} / {r['steps']} | {r['passes_per_step']} | "
                     f"{_mean(r, 'distinct_4')} | {_mean(r, 'recent_self_nll')} |")
    return "\n".join(lines) + "\n"


def _mean(row: dict, figure: str) -> str:
    """A health figure of the row's texts, averaged over its seeds ("-" where none was measured)."""
    values = [h[figure] for h in row.get("health", []) if h.get(figure) is not None]
    return f"{sum(values) / len(values):.3f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=PRESET[:JSON]",
                        help="a preset with spec overrides; repeat; the first is the baseline")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="directory for turns.md and turns.json")
    parser.add_argument("--saved-prefill", type=Path, default=None, metavar="FILE",
                        help="a safetensors file: the prompt's prefill read from there when it holds this one's, "
                             "else computed and written there (a 32K prefill: minutes saved in every later run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(args.variant) < 2:
        parser.error("give at least two --variant LABEL=PRESET[:JSON] (the first is the baseline, e.g. ar=ar)")
    if args.context < 2 or args.new_tokens < 1:
        parser.error(f"--context {args.context} / --new-tokens {args.new_tokens}: need a prompt of 2+ tokens and 1+ new")
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as exc:
        parser.error(str(exc))
    labels = [label for label, _, _ in variants]
    if len(set(labels)) != len(labels):
        parser.error(f"--variant labels must differ, got {labels}")
    try:
        report = run(variants, args.context, args.new_tokens, args.greedy, args.seeds, saved_prefill=args.saved_prefill)
    except SpecError as exc:
        parser.error(f"a variant's spec is invalid: {exc}")
    text = table(report)
    logger.info("%s", text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "turns.md").write_text(text)
        (args.out / "turns.json").write_text(json.dumps(report, indent=1) + "\n")
        logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
