"""Where a speculative preset's steps go, against compiled ``ar``, step by step.

    python benchmarks/step_stages.py --presets eagle,tokenswift [--greedy] [--context 2048] [--new-tokens 512]

Runs ``ar`` and each preset compiled (tree sizes and draft levels compiled before the
turns), from one shared prefill of the held-out prompt, in turns of 8 tokens as
``bench --interleaved`` does, and records every step: whether it speculated (proposed
candidates), what it verified and emitted, its wall time and its stages (propose,
forward, verify, commit). Prints, per method, the tokens per second, the steps that
speculated and what they cost against plain steps, and each stage's milliseconds per
step for both kinds, with the part of a stage that was the models' own computation (the
target's forward and LM-head products, the drafter's network:
:class:`~tokenswift.stats.ModelTime`) where it is not all of it; ``--out FILE`` writes
every step as JSON. Past the model's trained
length the prompt's RoPE is scaled as ``bench --contexts`` scales it.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import time
from pathlib import Path

from tokenswift.machine import machine_name
from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
from tokenswift.tools.bench import preset_pipeline, prompt_tokens_for
from tokenswift.tools.contexts import auto_rope
from tokenswift.tools.interleaved import compile_model_once, prefill_once

logger = logging.getLogger("step_stages")


def run(presets: list[str], context: int, new_tokens: int, greedy: bool, seed: int, trained: int = 8192) -> dict:
    rope = auto_rope(trained, context + new_tokens + 64) if context + new_tokens + 64 > trained else None
    model, tokenizer = load_model(ModelSpec(path="smollm2", dtype="bfloat16", rope=rope))
    prompt = prompt_tokens_for(tokenizer, context, None)
    compile_model_once(model, tokenizer, trees=True)
    overrides = {"model": {"compile": True}, **({"sampling": {"greedy": True}} if greedy else {})}
    pipes = {"ar": preset_pipeline("ar", model, tokenizer, overrides=overrides)}
    for preset in presets:
        pipes[preset] = preset_pipeline(preset, model, tokenizer, heads="auto", overrides=overrides)
        pipes[preset].drafter.compile_now()
    prefilled = prefill_once(pipes, prompt, max(p.kv_capacity(len(prompt), new_tokens) for p in pipes.values()))
    runs, steps, records = {}, {}, {}
    for name, pipe in pipes.items():
        generation = pipe.start(prompt, new_tokens, seed=seed, ignore_eos=True)
        generation.prefill(prefilled)
        runs[name], steps[name], records[name] = generation, generation.steps(), []
    active, rounds = list(runs), 0
    while active:
        rounds += 1
        for name in list(active if rounds % 2 else reversed(active)):
            generation, target = runs[name], min(new_tokens, len(runs[name].new_tokens) + 8)
            while len(generation.new_tokens) < target:
                started = time.perf_counter()
                record = next(steps[name], None)
                if record is None:
                    break
                records[name].append({
                    "candidates": record.candidates, "verified": record.verified, "emitted": len(record.emitted),
                    "seconds": time.perf_counter() - started, "drafting_pass": record.drafting_pass,
                    "stages": dict(record.stage_seconds), "model": dict(record.model_seconds),
                    "accepted": record.accepted, "predicted_tokens": record.predicted_tokens,
                    "predicted_seconds": record.predicted_seconds,
                })
            if len(generation.new_tokens) >= new_tokens or generation.finish_reason != "length":
                active.remove(name)
    return {"machine": machine_name(next(model.parameters()).device), "context": context, "new_tokens": new_tokens,
            "greedy": greedy, "seed": seed, "steps": records}


def summary(name: str, steps: list[dict]) -> str:
    def per_step(kind: list[dict]) -> str:
        if not kind:
            return "none"
        stages, model = collections.Counter(), collections.Counter()
        for step in kind:
            stages.update(step["stages"])
            model.update(step.get("model", {}))

        def stage_ms(stage: str, seconds: float) -> str:
            part = model.get(stage, 0.0)
            rest = f" (model {1000 * part / len(kind):.1f})" if 0 < part < 0.995 * seconds else ""
            return f"{stage} {1000 * seconds / len(kind):.1f}{rest}"

        ms = ", ".join(stage_ms(stage, seconds) for stage, seconds in stages.items())
        return (f"{len(kind)} steps, {sum(s['emitted'] for s in kind) / len(kind):.2f} tokens and "
                f"{1000 * sum(s['seconds'] for s in kind) / len(kind):.1f} ms a step ({ms} ms)")

    seconds, tokens = sum(s["seconds"] for s in steps), sum(s["emitted"] for s in steps)
    speculated = [s for s in steps if s["candidates"] > 0]
    plain = [s for s in steps if s["candidates"] == 0]
    return (f"{name}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.2f} tok/s\n"
            f"  speculated: {per_step(speculated)}\n  plain: {per_step(plain)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="eagle,tokenswift")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write every step as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    presets = [p.strip() for p in args.presets.split(",") if p.strip() and p.strip() != "ar"]
    if args.context < 2 or args.new_tokens < 1:
        parser.error(f"--context {args.context} / --new-tokens {args.new_tokens}: need a prompt of 2+ tokens and 1+ new")
    report = run(presets, args.context, args.new_tokens, args.greedy, args.seed)
    logger.info("%s, bfloat16, compiled, %d-token prompt, %s", report["machine"], args.context,
                "greedy" if args.greedy else "the paper's sampling")
    for name, steps in report["steps"].items():
        logger.info("%s", summary(name, steps))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
