"""Presets as a user's script runs them: each in a fresh process, ``Pipeline.from_spec``
with the preset's defaults (``compile = "auto"``, nothing compiled beforehand), its
compile time counted, against ``ar`` run the same way.

    python benchmarks/as_users_run.py [--presets ar,eagle,tokenswift,medusa,prompt-lookup]
        [--context 2048] [--new-tokens 512] [--decodings sampling,greedy] [--rope-factor F]
        [--rounds 1] [--out FILE]

The prompt is the first ``--context`` tokens of the bundled held-out text. Each run is
``python -c`` in a new interpreter (so no graph, calibration or drafter survives from the
one before), timed around ``generate`` as a user would time it; the model load is not
counted. ``--rope-factor``: YaRN scaling of that factor (a factor no graph has seen
exercises the compile caches as a long-prompt user meets them). Prints each run's
tokens/s, its ratio to ``ar`` with the same decoding, its compile seconds and tokens per
step, and the text's health; ``--out`` writes them as JSON. ``--rounds N`` runs the presets
in turns N times (ar, A, B, ar, A, B, ...), each ratio against the ``ar`` run of its own
round, and logs each preset's median ratio: on a shared 2-core host ``ar`` alone varied
by 10% between fresh processes minutes apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from tokenswift.machine import machine_name

logger = logging.getLogger("as_users_run")

CHILD = r"""
import json, sys, time
from tokenswift import Pipeline
from tokenswift.model.loading import load_model
from tokenswift.prompts import prompt_ids
from tokenswift.spec import ModelSpec
preset, context, new_tokens, greedy, rope = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "greedy", float(sys.argv[5])
spec = {"path": "smollm2", "dtype": "bfloat16"}
if rope > 0:
    spec["rope"] = {"type": "yarn", "factor": rope}
model, tokenizer = load_model(ModelSpec(**spec))
overrides = {"sampling": {"greedy": True}} if greedy else None
started = time.perf_counter()
pipe = Pipeline.from_spec(preset, model, tokenizer, overrides=overrides)
result = pipe.generate(prompt_ids(tokenizer, context), new_tokens, seed=0, ignore_eos=True)
seconds = time.perf_counter() - started
summary = result.stats.summary()
print("RESULT " + json.dumps({"preset": preset, "greedy": greedy, "seconds": seconds,
      "tokens_per_second": len(result.tokens) / seconds, **{k: summary.get(k) for k in (
      "compile_seconds", "compiled", "tokens_per_step", "distinct_4", "self_nll", "recent_self_nll")}}))
"""


def run_one(preset: str, context: int, new_tokens: int, decoding: str, rope: float) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, preset, str(context), str(new_tokens), decoding, str(rope)],
        capture_output=True, text=True, check=False,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{preset} ({decoding}) failed:\n{done.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="ar,eagle,tokenswift,medusa,prompt-lookup")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--decodings", default="sampling,greedy")
    parser.add_argument("--rope-factor", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if "ar" not in presets:
        presets.insert(0, "ar")
    decodings = [d.strip() for d in args.decodings.split(",") if d.strip()]
    bad = [d for d in decodings if d not in ("sampling", "greedy")]
    if bad:
        parser.error(f"--decodings {bad}: valid are sampling, greedy")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    results = []
    for decoding in decodings:
        ratios: dict[str, list[float]] = {}
        for round_ in range(args.rounds):
            by_preset = {}
            for preset in presets:
                r = run_one(preset, args.context, args.new_tokens, decoding, args.rope_factor)
                by_preset[preset] = r
            ar = by_preset["ar"]["tokens_per_second"]
            for preset, r in by_preset.items():
                r["ratio_to_ar"] = r["tokens_per_second"] / ar
                ratios.setdefault(preset, []).append(r["ratio_to_ar"])
                results.append({**r, "decoding": decoding, "round": round_})
                logger.info(
                    "%-8s %-13s %6.2f tok/s  %.2fx ar  compile %5.1f s  %.2f tok/step  distinct-4 %s  self-NLL %s",
                    decoding, preset, r["tokens_per_second"], r["ratio_to_ar"], r["compile_seconds"] or 0.0,
                    r["tokens_per_step"] or 0.0, r["distinct_4"], r["recent_self_nll"],
                )
        if args.rounds > 1:
            for preset, values in ratios.items():
                logger.info("%-8s %-13s median %.3fx ar over %d rounds (%s)", decoding, preset,
                            statistics.median(values), len(values), ", ".join(f"{v:.3f}" for v in values))
    report = {"machine": machine_name(torch.device("cpu")), "context": args.context, "new_tokens": args.new_tokens,
              "rope_factor": args.rope_factor, "runs": results}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
