"""How often a greedy float32 run of each preset parts from `ar`, and whether each
parting is a rounding tie.

    python benchmarks/float32_partings.py --out benchmarks/results/float32-partings

For each held-out prompt (``--prompts`` windows of ``--prompt-tokens`` tokens of the
bundled *Wuthering Heights*, which no shipped drafter was trained on) it decodes
``--new-tokens`` greedily in float32 with `ar`, then with each preset, and finds the
first token where the two differ. A tree forward and a one-token forward add their
products in different orders, so where the top two penalized scores are within the
rounding of float32 (~1e-6 relative) the two paths can pick different tokens. At each
parting the top two scores of `ar`'s context are recomputed (one full forward in
float32 and one in float64) to say whether it was such a tie. Only the first parting of
a run counts (after it the texts differ): the rate is partings per 1,000 tokens of
exposure (the tokens each run matched `ar` before parting, or all of them).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from tokenswift import Pipeline
from tokenswift.machine import machine_name
from tokenswift.model.loading import load_model
from tokenswift.prompts import prompt_ids
from tokenswift.spec import ModelSpec

TIE = 1e-4  # a gap of the top two scores below this (in logits) is a rounding tie in float32


def top_two(pipe: Pipeline, model, context: list[int]) -> tuple[list[int], float]:
    """The top two penalized scores' tokens at the end of ``context`` and their gap,
    the logits from one full forward of ``model``."""
    with torch.inference_mode():
        logits = model(torch.tensor([context])).logits[0, -1].double()
        scores = pipe.scorer.penalize(pipe.scorer.context(context, device=logits.device), logits[None])[0]
        top = scores.topk(2)
    return top.indices.tolist(), float(top.values[0] - top.values[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--presets", default="eagle,tokenswift,medusa,prompt-lookup")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--compile", default="false", choices=("false", "auto", "true"))
    parser.add_argument("--tree", default="auto", choices=("auto", "fixed"),
                        help="speculation.tree: auto (as users run) or fixed (every candidate verified: most tree rows)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report-only", action="store_true", help="write partings.md from --out's partings.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.report_only:
        report(json.loads((args.out / "partings.json").read_text())["runs"], args)
        return

    model, tokenizer = load_model(ModelSpec(path=args.model, dtype="float32"))
    every = prompt_ids(tokenizer, 40_000)
    stride = (len(every) - args.prompt_tokens) // max(1, args.prompts - 1) if args.prompts > 1 else 0
    prompts = [every[i * stride : i * stride + args.prompt_tokens] for i in range(args.prompts)]
    overrides = {"sampling": {"greedy": True}, "model": {"compile": args.compile}, "speculation": {"tree": args.tree}}
    args.out.mkdir(parents=True, exist_ok=True)
    runs, model64 = [], None
    for p, prompt in enumerate(prompts):
        ar_pipe = Pipeline.from_spec("ar", model, tokenizer, overrides=overrides)
        ar = ar_pipe.generate(prompt, args.new_tokens, seed=0, ignore_eos=True)
        for preset in args.presets.split(","):
            pipe = Pipeline.from_spec(preset, model, tokenizer, overrides=overrides)
            started = time.perf_counter()
            result = pipe.generate(prompt, args.new_tokens, seed=0, ignore_eos=True)
            parted = next((i for i, (a, b) in enumerate(zip(ar.tokens, result.tokens)) if a != b), None)
            run = {
                "prompt": p, "preset": preset, "new_tokens": len(result.tokens), "parted_at": parted,
                "exposure": parted + 1 if parted is not None else len(result.tokens),
                "tokens_per_step": round(result.stats.tokens_per_step, 3), "seconds": round(time.perf_counter() - started, 1),
            }
            if parted is not None:
                context = prompt + ar.tokens[:parted]
                if model64 is None:
                    model64, _ = load_model(ModelSpec(path=args.model, dtype="float64"))
                tokens32, gap32 = top_two(ar_pipe, model, context)
                tokens64, gap64 = top_two(ar_pipe, model64, context)
                run.update({
                    "ar_token": ar.tokens[parted], "preset_token": result.tokens[parted],
                    "top_two_float32": tokens32, "gap_float32": gap32, "top_two_float64": tokens64, "gap_float64": gap64,
                    "tie": {ar.tokens[parted], result.tokens[parted]} == set(tokens32) and gap32 < TIE,
                })
            runs.append(run)
            logging.warning("%s", run)
            (args.out / "partings.json").write_text(json.dumps({"machine": machine_name(torch.device("cpu")), "runs": runs}, indent=1) + "\n")

    report(runs, args)


def report(runs: list[dict], args) -> None:
    """partings.md from the runs (also from a partial partings.json: ``--report-only``)."""
    presets = list(dict.fromkeys(r["preset"] for r in runs))
    prompts = len({r["prompt"] for r in runs})
    lines = [
        f"Greedy float32, {prompts} held-out prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens, "
        f"compile {args.compile}, trees {args.tree}; {machine_name(torch.device('cpu'))}",
        "",
        "| preset | runs | parted | tokens matched (exposure) | tokens per step | partings per 1,000 tokens | each parting: position, top-two gap float32 / float64, tie |",
        "|---|---|---|---|---|---|---|",
    ]
    for preset in presets:
        mine = [r for r in runs if r["preset"] == preset]
        parted = [r for r in mine if r["parted_at"] is not None]
        exposure = sum(r["exposure"] for r in mine)
        detail = "; ".join(
            f"{r['parted_at']}: {r['gap_float32']:.1e} / {r['gap_float64']:.1e}, {'tie' if r['tie'] else 'NOT a tie'}"
            for r in parted
        ) or "-"
        steps = sum(r["tokens_per_step"] for r in mine) / max(1, len(mine))
        lines.append(f"| {preset} | {len(mine)} | {len(parted)} | {exposure} | {steps:.2f} | {1000 * len(parted) / exposure:.2f} | {detail} |")
    (args.out / "partings.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
