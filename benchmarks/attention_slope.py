"""How one-token forward time grows with the context, with tokenswift's CPU decode
kernel and with PyTorch's attention, in turns in one process.

    python benchmarks/attention_slope.py [--contexts 2048 8192 16384 32768] [--dtype bfloat16]

Times ``Runner.forward`` of one token over a store occupied to each context (the
arithmetic of a decode step at that length; no prefill needed), median of
``--repeats``, the two paths alternating. Prints and writes a markdown table with the
slope between the middle and the last context in ms per 1K positions, beside the
memory floor: 23 KB of KV per position (30 layers x 3 KV heads x 64 x 2 x 2 bytes in
bfloat16) over the machine's measured read bandwidth (a two-thread sum of 1 GB).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenswift import kernels
from tokenswift.machine import machine_name
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.spec import ModelSpec
from tokenswift.tools.bench import print_and_write_table


def read_bandwidth() -> float:
    """GB/s of a plain float32 sum over 1 GB (all threads)."""
    data = torch.ones(256 * 1024 * 1024)
    data.sum()
    started = time.perf_counter()
    for _ in range(5):
        data.sum()
    return data.numel() * 4 * 5 / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results/attention-slope")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats {args.repeats}: at least 3 (the first two turns of each context warm it up)")
    if not kernels.available():
        raise SystemExit("the kernel cannot be built here (see the warning above)")
    model, _ = load_model(ModelSpec(path="smollm2", dtype=args.dtype))
    runner = Runner(model)
    runner.allocate(max(args.contexts) + 2)
    token = torch.tensor([5])
    served = kernels.max_tokens
    times = {"kernel": {}, "pytorch": {}}
    for context in args.contexts:
        runner.store.reset()
        runner.store.occupy(context)
        samples = {"kernel": [], "pytorch": []}
        for i in range(args.repeats):
            for path in ("kernel", "pytorch") if i % 2 == 0 else ("pytorch", "kernel"):
                # the kernel serves up to max_tokens(dtype) new tokens (per CPU path): 0 turns it off
                kernels.max_tokens = served if path == "kernel" else (lambda dtype: 0)
                started = time.perf_counter()
                runner.forward(token)
                samples[path].append(time.perf_counter() - started)
        kernels.max_tokens = served
        for path, values in samples.items():
            times[path][context] = 1000 * statistics.median(values[2:])
        print(context, {path: round(times[path][context], 2) for path in times}, flush=True)
    bandwidth = read_bandwidth()
    kv_per_position = 2 * runner.num_layers * runner.kv_heads * runner.head_dim * model.dtype.itemsize
    floor = kv_per_position * 1000 / (bandwidth * 1e9) * 1000  # ms per 1K positions
    low, high = args.contexts[(len(args.contexts) - 1) // 2], args.contexts[-1]
    lines = ["| path | " + " | ".join(f"{c:,} positions" for c in args.contexts) + f" | ms per 1K ({low // 1024}K-{high // 1024}K) |",
             "|---|" + "---|" * (len(args.contexts) + 1)]
    for path in times:
        slope = (times[path][high] - times[path][low]) / ((high - low) / 1000)
        lines.append(f"| {path} | " + " | ".join(f"{times[path][c]:.1f} ms" for c in args.contexts) + f" | {slope:.2f} |")
    note = (f"\n{machine_name(torch.device('cpu'))}, {args.dtype}, {torch.get_num_threads()} threads; one-token forward "
            f"(no scoring), median of {args.repeats}; memory floor {floor:.2f} ms per 1K positions "
            f"({kv_per_position / 1024:.0f} KB of KV per position at a measured {bandwidth:.1f} GB/s read)\n")
    print_and_write_table(lines, note, args.out, "slope.md")


if __name__ == "__main__":
    main()
