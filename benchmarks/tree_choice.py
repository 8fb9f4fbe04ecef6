"""How the chosen tree changes with the drafter's confidence and the context length, on
this machine: the cost model's decision for a typical candidate tree, plotted.

    python benchmarks/tree_choice.py --out docs/tree-choice.png

For each dtype it uses the cached calibration of the demo model on this machine
(``tokenswift calibrate --dtype D`` makes it, once). The candidate tree is shaped like
the heads' (three candidates per depth, three depths); the best depth-1 candidate has
chance ``p`` of being accepted, the second ``p/3``, the third ``p/6``, and the same at
every depth below (so the likeliest path of three is accepted with ``p^3``). For every
``p`` and context length the plot shows how many nodes the cost model verifies and
the tokens per second it expects relative to a plain step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenswift.calibration import load_calibration
from tokenswift.costs import CostModel
from tokenswift.records import machine_key
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.spec import ModelSpec
from tokenswift.speculation import AcceptanceTracker, choose
from tokenswift.tree import Branch, DraftTree

CONTEXTS = (1024, 4096, 16384, 65536)


def candidate_tree(p: float) -> DraftTree:
    shares = (p, p / 3, p / 6)
    tree = DraftTree.root_only(0)
    for a, ca in enumerate(shares):
        for b, cb in enumerate(shares):
            for c, cc in enumerate(shares):
                tree.add_branch(Branch([1 + a, 10 + 3 * a + b, 100 + 9 * a + 3 * b + c], [ca, cb, cc]))
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--out", default="docs/tree-choice.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    confidences = [i / 40 for i in range(41)]
    table = {}
    fig, axes = plt.subplots(2, len(args.dtypes), figsize=(5.5 * len(args.dtypes), 7), squeeze=False, sharex=True)
    for column, dtype in enumerate(args.dtypes):
        model, _ = load_model(ModelSpec(path=args.model, dtype=dtype))
        runner = Runner(model)
        calibration = load_calibration(runner)
        if calibration is None:
            raise SystemExit(f"no calibration for {args.model} {dtype} here (key {machine_key(runner)}); "
                             f"run: tokenswift calibrate --model {args.model} --dtype {dtype}")
        costs = CostModel(calibration)
        tracker = AcceptanceTracker(prior=1e9)  # the proposer's confidences taken at their word
        for context in CONTEXTS:
            nodes, gain = [], []
            for p in confidences:
                choice = choose(candidate_tree(p), tracker, costs, context, max_nodes=64)
                plain = costs.forward_seconds(1, context) + costs.scoring_seconds(1.0)
                nodes.append(len(choice.keep) - 1)
                gain.append(choice.expected_tokens / choice.seconds * plain)
            table[f"{dtype}@{context}"] = {"nodes": nodes, "speedup": [round(g, 3) for g in gain]}
            axes[0][column].plot(confidences, nodes, label=f"context {context:,}")
            axes[1][column].plot(confidences, gain, label=f"context {context:,}")
        axes[0][column].set(title=f"{dtype}: {calibration.machine}", ylabel="nodes verified")
        axes[1][column].set(xlabel="chance of the best depth-1 candidate (p)", ylabel="expected speed vs a plain step")
        axes[1][column].axhline(1.0, color="grey", lw=0.8)
        for ax in axes[:, column]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"confidences": confidences, "choices": table}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
