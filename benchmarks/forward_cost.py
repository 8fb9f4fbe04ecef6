"""Cost of one runner forward vs tree size and context length (and of a drafting
forward over a partial view), to size the default trees for a machine.

    python benchmarks/forward_cost.py --contexts 512 2048 4096 8000 --nodes 1 4 8 16 32 64 101 [--compile]

Prints a markdown table of milliseconds per forward (median of --repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenswift.model.kv import CompactView, FullView
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.spec import ModelSpec
from tokenswift.tree import DraftTree


def chain_tree(nodes: int) -> DraftTree:
    """A tree of ``nodes`` nodes below the root, three wide per level like the default."""
    tree = DraftTree.root_only(0)
    frontier = [0]
    token = 1
    while len(tree) - 1 < nodes:
        parent = frontier.pop(0)
        for _ in range(3):
            if len(tree) - 1 >= nodes:
                break
            child = tree.add_branch([token], parent=parent)
            token += 1
            frontier.append(child)
    return tree


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096, 8000])
    parser.add_argument("--nodes", type=int, nargs="+", default=[0, 3, 7, 15, 31, 63, 100])
    parser.add_argument("--view", type=int, default=1024, help="partial view size for the drafting forward")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true",
                        help="one-token forwards (1 node, the drafting columns) through the compiled graphs (docs/compiled.md)")
    parser.add_argument("--no-prefill", action="store_true",
                        help="time over an occupied store instead of prefilling each context (same arithmetic, minutes less)")
    args = parser.parse_args()

    model, _ = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device))
    runner = Runner(model)
    runner.allocate(max(args.contexts) + max(args.nodes) + 2)
    if args.compile:
        runner.use_compiled(True)
    where = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else f"cpu, threads={torch.get_num_threads()}"
    print(f"{where} dtype={args.dtype}" + (" compiled one-token forwards" if args.compile else ""))
    print("| context | " + " | ".join(f"{n + 1} nodes" for n in args.nodes) + f" | draft full | draft view {args.view} |")
    print("|---|" + "---|" * (len(args.nodes) + 2))
    for context in args.contexts:
        runner.store.reset()
        if args.no_prefill:
            runner.store.occupy(context)
        else:
            runner.prefill(torch.randint(0, runner.vocab_size, (context,)))
        row = []
        for nodes in args.nodes:
            tree = chain_tree(nodes)
            tokens, mask, depths = tree.token_tensor(), tree.mask(), tree.depth_tensor()
            row.append(timed(lambda: runner.forward(tokens, tree_mask=mask, depths=depths, logits_rows=None), args.repeats))
        root = torch.tensor([0])
        full = timed(lambda: runner.forward(root, view=FullView(runner.store)), args.repeats)
        view = CompactView(runner.store, args.view)
        view.load(runner.store, torch.arange(min(args.view, context)))
        partial = timed(lambda: runner.forward(root, view=view), args.repeats)
        print(f"| {context} | " + " | ".join(f"{t:.1f}" for t in row) + f" | {full:.1f} | {partial:.1f} |", flush=True)


if __name__ == "__main__":
    main()
