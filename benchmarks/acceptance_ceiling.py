"""How many tokens per step can a drafter earn under a sampling setting, and how
close do the shipped heads come?

Generates text with plain autoregressive decoding (the exact output distribution of
every preset), then replays it (``tokenswift.tools.tree_fit.replay``): for every
position, the rank of the drawn token among each drafter's candidates. Walking the
replayed text down a tree gives the tokens per step that drafter and tree would have
earned on it, for:

* ``heads``: the LM head's raw top-w at depth 1, the heads below (the drafter as
  shipped before the penalty ranking);
* ``depth1_penalized``: the same with depth 1 ranked after the penalty (as now);
* ``heads_penalized``: the penalty on the heads' logits too;
* ``oracle``: a drafter that knows the target's exact conditional distribution at
  every depth and proposes its top-w. No drafter proposing the same tree can do
  better on average.

Trees: the paper's [1, 3, 3, 3], cartesian [3]*4 and [10]*4, and sparse trees of N
nodes fitted (leave one seed out) for ``depth1_penalized`` and for the oracle.

    python benchmarks/acceptance_ceiling.py --new-tokens 2000 --seeds 0 1 2 \
        --fit-nodes 1 3 10 20 40 80 160 320 1000 --out benchmarks/results/ceiling

(``--reuse`` redoes the fits and tables from the saved ranks without generating.)
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from tokenswift import Pipeline
from tokenswift.drafters.draft_heads import DraftHeads, find_shipped_heads
from tokenswift.drafters.template import index_paths
from tokenswift.tools.tree_fit import MISS, depth_ranks, fit_tree, replay, tokens_per_step
from tokenswift.model.loading import load_model
from tokenswift.prompts import prompt_ids
from tokenswift.spec import ModelSpec

logger = logging.getLogger("acceptance_ceiling")


def summary(r: dict) -> dict:
    """Accuracy of the target, the LM head and the heads on the drawn tokens."""

    def share(ranks, below):
        ranks = ranks[ranks < MISS]
        return round((ranks < below).float().mean().item(), 4)

    return {
        "new_tokens": int(r["target"].shape[0]),
        "mean_p_max": round(r["p_max"].mean().item(), 4),
        "target_top1": share(r["target"], 1),
        "target_top3": share(r["target"], 3),
        "lm_raw_top1": share(r["lm"], 1),
        "head_top1": [share(h, 1) for h in r["heads"]],
        "head_top3": [share(h, 3) for h in r["heads"]],
        "head_penalized_top1": [share(h, 1) for h in r["heads_penalized"]],
    }


def drafters(r: dict, depth: int) -> dict[str, torch.Tensor]:
    """[m, depth] candidate ranks per drafter (see the module docstring)."""
    shift = lambda ranks, k: torch.cat([ranks[k:], torch.full((k,), MISS)])  # noqa: E731
    return {
        "heads": depth_ranks(r["lm"], list(r["heads"]), depth),
        "depth1_penalized": depth_ranks(r["target"], list(r["heads"]), depth),
        "heads_penalized": depth_ranks(r["target"], list(r["heads_penalized"]), depth),
        "oracle": depth_ranks(r["target"], [shift(r["target"], k) for k in range(1, depth)], depth),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--fit-nodes", type=int, nargs="*", default=[40], help="sparse-tree sizes to fit")
    parser.add_argument("--reuse", action="store_true", help="use the ranks saved in --out, no generation")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    replays = {}
    if args.reuse:
        for seed in args.seeds:
            replays[seed] = torch.load(args.out / f"ranks-seed{seed}.pt")
    else:
        model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype))
        heads = DraftHeads.from_pretrained(str(find_shipped_heads(model)), model).eval()
        pipe = Pipeline.from_spec("ar", model, tokenizer)  # the distribution every preset emits
        prompt = prompt_ids(tokenizer, args.prompt_tokens)
        for seed in args.seeds:
            result = pipe.generate(prompt, args.new_tokens, seed=seed, ignore_eos=True)
            replays[seed] = replay(
                model, heads, prompt + result.tokens, len(prompt), pipe.scorer, penalized_heads=True
            )
            torch.save(replays[seed], args.out / f"ranks-seed{seed}.pt")
            logger.info("seed %d replayed: %s", seed, summary(replays[seed]))

    depth = replays[args.seeds[0]]["heads"].shape[0] + 1
    shapes = {"[1, 3, 3, 3]": [1, 3, 3, 3], **{f"[{w}]*{depth}": [w] * depth for w in (3, 10)}}
    report = {"model": args.model, "dtype": args.dtype, "new_tokens": args.new_tokens, "runs": []}
    ranked = {seed: drafters(r, depth) for seed, r in replays.items()}
    for seed, r in replays.items():
        run = {"seed": seed, **summary(r), "tokens_per_step": {}}
        for name, ranks in ranked[seed].items():
            cells = {shape: tokens_per_step(ranks, index_paths(widths)) for shape, widths in shapes.items()}
            if name in ("depth1_penalized", "oracle"):  # sparse trees fitted on the other seeds
                others = [ranked[s][name] for s in replays if s != seed] or [ranks]
                for nodes in args.fit_nodes:
                    cells[f"fitted-{nodes}"] = tokens_per_step(ranks, fit_tree(others, nodes))
            run["tokens_per_step"][name] = {shape: round(value, 3) for shape, value in cells.items()}
        logger.info("seed %d: %s", seed, json.dumps(run["tokens_per_step"]))
        report["runs"].append(run)
    report["mean_tokens_per_step"] = {
        name: {
            shape: round(sum(run["tokens_per_step"][name][shape] for run in report["runs"]) / len(report["runs"]), 3)
            for shape in report["runs"][0]["tokens_per_step"][name]
        }
        for name in report["runs"][0]["tokens_per_step"]
    }
    (args.out / "ceiling.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "ceiling.md").write_text(markdown(report))
    if len(args.fit_nodes) > 1:
        plot(report, args.out / "ceiling.png")
    print(markdown(report), end="")


def plot(report: dict, path: Path) -> None:
    """Mean tokens per step of fitted trees against their size, per drafter, with the
    paper's [1, 3, 3, 3] tree marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = report["mean_tokens_per_step"]
    labels = {"depth1_penalized": "shipped heads, penalised depth 1", "oracle": "perfect drafter (oracle)"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, label in labels.items():
        fitted = sorted((int(shape.split("-")[1]), value) for shape, value in means[name].items() if shape.startswith("fitted-"))
        line = ax.plot([n for n, _ in fitted], [v for _, v in fitted], marker="o", label=f"{label}, fitted trees")[0]
        ax.scatter([40], [means[name]["[1, 3, 3, 3]"]], marker="x", s=70, color=line.get_color(),
                   label=f"{label}, [1, 3, 3, 3]")
    ax.scatter([40], [means["heads"]["[1, 3, 3, 3]"]], marker="x", s=70, color="grey", label="heads as shipped before, [1, 3, 3, 3]")
    ax.axhline(2.5, color="black", linestyle=":", linewidth=1, label="2.5 tokens per step")
    ax.set_xscale("log")
    ax.set_xlabel("tree nodes below the root (drafter only, no n-gram branches)")
    ax.set_ylabel("tokens per step (replayed)")
    ax.set_title(f"{report['model']}, {len(report['runs'])} x {report['new_tokens']} sampled tokens")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(report: dict) -> str:
    """Mean tokens per step, drafters by trees."""
    means = report["mean_tokens_per_step"]
    shapes = list(dict.fromkeys(shape for cells in means.values() for shape in cells))
    lines = ["| drafter | " + " | ".join(shapes) + " |", "| --- |" + " ---: |" * len(shapes)]
    for name, cells in means.items():
        lines.append(f"| {name} | " + " | ".join(f"{cells[s]:.3f}" if s in cells else "" for s in shapes) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
