"""Tokens per step when every candidate is verified (fixed trees, at most 64 nodes): how
good the drafts are, apart from what they cost here.

    python benchmarks/drafter_acceptance.py [--new-tokens 512] [--prompt-tokens 2048] [--dtype float32]
        [--presets eagle,tokenswift] [--drafters-alone] [--out DIR]

The held-out 2,048-token prompt (the bundled *Wuthering Heights*, never trained on;
``--prompt-tokens`` more of it, past 8,192 with the RoPE scaled by YaRN as ``bench
--contexts`` scales it), seed 0, with the presets' penalty; greedy decoding, and the paper's sampling (T = 1,
min-p 0.1) with each sampler: ``keyed`` (the default: Gumbel-max with noise keyed by
position and token, the drafters rank by log q plus the same noise), ``coupled`` (the
same law, a Philox vector per position) and ``inverse-cdf`` (the sampler before them,
drafts independent of the draw); and ``rejection`` (the rejection verifier, drafts
drawn from q where the drafter can: ``eagle``). With ``--drafters-alone`` each drafter runs without
n-gram reuse and over the full cache; otherwise the presets as shipped (retriever and
cache included; ``tokenswift``'s pass every step). Writes acceptance.json and
acceptance.md, and prints each row as it is measured.
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
from tokenswift.prompts import prompt_ids
from tokenswift.spec import ModelSpec
from tokenswift.tools.contexts import auto_rope

TRAINED = 8192  # SmolLM2-135M's trained context (max_position_embeddings)

DECODINGS = {
    "greedy": {"greedy": True},
    "keyed": {"sampler": "keyed"},  # the paper's sampling, drawn by each sampler
    "coupled": {"sampler": "coupled"},
    "inverse-cdf": {"sampler": "inverse-cdf"},
    "rejection": {"sampler": "keyed", "verifier": "rejection"},  # drafts drawn from q, rejection sampling
}


def spec_for(
    name: str, decoding: dict, *, alone: bool, max_nodes: int, eagle_weights: str | None = None, heads: str | None = None,
    drafter_options: dict | None = None,
) -> dict:
    spec = {"preset": name, "speculation": {"tree": "fixed", "max_nodes": max_nodes}}
    if alone:
        spec.update(drafter={"name": name}, retriever={"name": "none"}, cache={"name": "full"})
    if name == "eagle" and eagle_weights:
        spec["drafter"] = {**spec.get("drafter", {}), "weights": eagle_weights}
    if name in ("tokenswift", "medusa") and heads:
        spec["drafter"] = {**spec.get("drafter", {}), "heads": heads}
    if drafter_options:
        spec["drafter"] = {**spec.get("drafter", {}), **drafter_options}
    decoding = dict(decoding)
    verifier = decoding.pop("verifier", None)
    if verifier is not None:
        spec["verifier"] = {"name": verifier}
    if decoding.get("greedy"):
        spec["sampling"] = decoding
    else:
        spec["sampling"] = {"temperature": 1.0, "min_p": 0.1, **decoding}  # the presets' sampling, this sampler
    return spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--presets", default="eagle,tokenswift", help="comma-separated presets (default eagle,tokenswift)")
    parser.add_argument("--drafters-alone", action="store_true", help="no n-gram reuse, full cache")
    parser.add_argument("--max-nodes", type=int, default=64)
    parser.add_argument("--eagle-weights", help="the eagle drafter's network (default: the shipped one)")
    parser.add_argument("--heads", help="the tokenswift/medusa drafters' heads (default: the shipped ones)")
    parser.add_argument("--drafter-options", type=json.loads, default=None,
                        help='JSON of drafter options for every preset, e.g. \'{"depth": 6, "width": 8}\'')
    parser.add_argument("--decodings", default=",".join(DECODINGS), help=f"comma-separated, of {list(DECODINGS)}")
    parser.add_argument("--out", default="benchmarks/results/drafter-acceptance")
    args = parser.parse_args()
    # Past the model's trained length the RoPE is scaled as `bench --contexts` scales it.
    rope = auto_rope(TRAINED, args.prompt_tokens + args.new_tokens + 64)
    model, tokenizer = load_model(ModelSpec(path="smollm2", dtype=args.dtype, rope=rope))
    prompt = prompt_ids(tokenizer, args.prompt_tokens)
    rows = []
    for decoding_name in args.decodings.split(","):
        for name in args.presets.split(","):
            spec = spec_for(name, DECODINGS[decoding_name], alone=args.drafters_alone, max_nodes=args.max_nodes,
                            eagle_weights=args.eagle_weights, heads=args.heads,
                            drafter_options=args.drafter_options)
            started = time.perf_counter()
            result = Pipeline.from_spec(spec, model, tokenizer).generate(prompt, args.new_tokens, seed=0, ignore_eos=True)
            stats = result.stats
            histogram = stats.tokens_per_step_histogram  # emitted tokens per step: accepted drafts + 1
            reached = [sum(n for emitted, n in histogram.items() if emitted > d) / stats.steps for d in range(1, 7)]
            rows.append({
                "decoding": decoding_name, "preset": name, "tokens_per_step": round(stats.tokens_per_step, 3),
                "nodes_verified_per_step": stats.decisions()["verified_per_step"],
                "acceptance_rate": round(stats.acceptance_rate, 3), "retriever_share": round(stats.retriever_share, 3),
                # the share of steps that accepted at least d drafted tokens, d = 1..6
                "accepted_to_depth": [round(r, 3) for r in reached],
                "seconds": round(time.perf_counter() - started, 1),
                # what it wrote, and how healthy that is (speed on degenerate text is no speed)
                "health": stats.health.summary() if stats.health is not None else {},
                "text": result.text,
            })
            print({k: v for k, v in rows[-1].items() if k != "text"}, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {
        "machine": machine_name(torch.device("cpu")), "python": platform.python_version(), "torch": torch.__version__,
        "dtype": args.dtype, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
        "max_nodes": args.max_nodes, "drafters_alone": args.drafters_alone, "eagle_weights": args.eagle_weights or "shipped", "heads": args.heads or "shipped",
        "drafter_options": args.drafter_options or {}, "rope": rope,
    }
    (out / "acceptance.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    lines = ["| decoding | preset | tokens/step | steps accepting >= 1 / 2 / 3 / 4 drafts | nodes verified per step "
             "| retriever share | distinct-4 | recent self-NLL |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['decoding']} | {r['preset']} | {r['tokens_per_step']} | "
              f"{' / '.join(f'{a:.2f}' for a in r['accepted_to_depth'][:4])} | {r['nodes_verified_per_step']} | "
              f"{r['retriever_share']} | {r['health'].get('distinct_4', '-')} | {r['health'].get('recent_self_nll', '-')} |"
              for r in rows]
    what = "drafters alone (no reuse, full cache)" if args.drafters_alone else "presets as shipped"
    (out / "acceptance.md").write_text(
        "\n".join(lines) + f"\n\n{info['machine']}, {args.dtype}, {what}, fixed trees (at most {args.max_nodes} nodes), "
        f"held-out {args.prompt_tokens}-token prompt{f' (RoPE {rope})' if rope else ''}, {args.new_tokens} new tokens, "
        "seed 0; each row's text is in acceptance.json\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
