"""Which attention a forward of n new tokens should take on this CPU: tokenswift's decode
kernel against PyTorch's SDPA (the runner's grouped path), 30 layers of SmolLM2-135M's
shapes (3 KV heads, 9 query heads, head dim 64), in turns in one process.

    python benchmarks/attention_tokens.py [--keys 2048 16384] [--tokens 1 2 4 8 16 32] [--dtype bfloat16]

The new tokens see every committed key and a random tree among themselves (each token
itself and some earlier ones), as a tree verify does. Prints a markdown table of ms per
30 layers (median of --repeats) and writes it to --out; ``tokenswift.kernels``'
``MAX_TOKENS*`` constants record where the kernel stops winning.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenswift import kernels
from tokenswift.machine import machine_name
from tokenswift.model.attention import grouped_attention
from tokenswift.tools.bench import print_and_write_table

LAYERS, KV_HEADS, Q_HEADS, DIM = 30, 3, 9, 64


def tree_mask(n: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.rand(n, n, generator=generator) < 0.5).tril() | torch.eye(n, dtype=torch.bool)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results/attention-tokens")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the kernel cannot be built here (see the warning above)")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    capacity = max(args.keys) + max(args.tokens)
    store = [(torch.randn(1, KV_HEADS, capacity, DIM, generator=generator).to(dtype),
              torch.randn(1, KV_HEADS, capacity, DIM, generator=generator).to(dtype)) for _ in range(LAYERS)]
    rows = []
    for keys in args.keys:
        for n in args.tokens:
            query = torch.randn(1, Q_HEADS, n, DIM, generator=generator).to(dtype)
            among = tree_mask(n, generator)
            mask = torch.cat([torch.ones(n, keys, dtype=torch.bool), among], dim=1).view(1, 1, n, keys + n)
            paths = {
                "kernel": lambda k, v: kernels.decode_attention(query, k, v, keys, among if n > 1 else None, DIM**-0.5),
                "pytorch": lambda k, v: grouped_attention(query, k, v, mask if n > 1 else None, DIM**-0.5),
            }
            samples = {name: [] for name in paths}
            for i in range(args.repeats + 1):
                for name in paths if i % 2 == 0 else reversed(list(paths)):
                    started = time.perf_counter()
                    for k, v in store:
                        paths[name](k[:, :, : keys + n], v[:, :, : keys + n])
                    if i > 0:  # the first turn warms both paths
                        samples[name].append(1000 * (time.perf_counter() - started))
            kernel, pytorch = (statistics.median(samples[name]) for name in paths)
            rows.append((keys, n, kernel, pytorch))
            print(f"{keys} keys, {n} tokens: kernel {kernel:.1f} ms, pytorch {pytorch:.1f} ms", flush=True)
    lines = ["| keys | new tokens | kernel ms | PyTorch ms | kernel / PyTorch |", "|---|---|---|---|---|"]
    lines += [f"| {keys:,} | {n} | {kernel:.1f} | {pytorch:.1f} | {kernel / pytorch:.2f} |" for keys, n, kernel, pytorch in rows]
    note = (f"\n{machine_name(torch.device('cpu'))}, {args.dtype}, {torch.get_num_threads()} threads, kernel path "
            f"{kernels.linear_path()}; {LAYERS} layers of {KV_HEADS} KV / {Q_HEADS} query heads x {DIM}, median of {args.repeats}\n")
    print_and_write_table(lines, note, args.out, "attention_tokens.md")


if __name__ == "__main__":
    main()
