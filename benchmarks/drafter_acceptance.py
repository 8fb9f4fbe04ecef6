"""Tokens per step of each drafter when every candidate is verified (fixed trees, no
n-gram reuse, full cache): how good its drafts are, apart from what they cost here.

    python benchmarks/drafter_acceptance.py [--new-tokens 128] [--dtype float32] [--out DIR]

Same model, the bundled 2,048-token prompt, seed 0; the paper's sampling and greedy
decoding (both with the presets' penalty). Writes acceptance.json and acceptance.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from tokenswift import Pipeline
from tokenswift.machine import machine_name
from tokenswift.model.loading import load_model
from tokenswift.prompts import demo_prompt
from tokenswift.spec import ModelSpec

DRAFTERS = {"tokenswift": {"name": "tokenswift"}, "medusa": {"name": "medusa"}, "eagle": {"name": "eagle"}}
SAMPLINGS = {"paper's sampling": None, "greedy": {"greedy": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="benchmarks/results/drafter-acceptance")
    args = parser.parse_args()
    model, tokenizer = load_model(ModelSpec(path="smollm2", dtype=args.dtype))
    prompt = tokenizer(demo_prompt(), add_special_tokens=False)["input_ids"][-2048:]
    rows = []
    for sampling_name, sampling in SAMPLINGS.items():
        for name, drafter in DRAFTERS.items():
            spec = {"preset": name, "drafter": drafter, "retriever": {"name": "none"}, "cache": {"name": "full"},
                    "speculation": {"tree": "fixed"}}
            if sampling is not None:
                spec["sampling"] = sampling
            started = time.perf_counter()
            result = Pipeline.from_spec(spec, model, tokenizer).generate(prompt, args.new_tokens, seed=0, ignore_eos=True)
            stats = result.stats
            rows.append({"sampling": sampling_name, "drafter": name, "tokens_per_step": round(stats.tokens_per_step, 3),
                         "tree_nodes": stats.decisions()["verified_per_step"], "seconds": round(time.perf_counter() - started, 1)})
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine_name(torch.device("cpu")), "python": platform.python_version(), "dtype": args.dtype, "new_tokens": args.new_tokens}
    (out / "acceptance.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    lines = ["| decoding | drafter | tokens/step | nodes verified per step |", "|---|---|---|---|"]
    lines += [f"| {r['sampling']} | {r['drafter']} | {r['tokens_per_step']} | {r['tree_nodes']} |" for r in rows]
    (out / "acceptance.md").write_text("\n".join(lines) + f"\n\n{info['machine']}, {args.dtype}, {args.new_tokens} new tokens\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
