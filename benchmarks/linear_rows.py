"""The products of a forward, by rows: tokenswift's few-rows kernel against PyTorch's
``F.linear``, the 210 products of SmolLM2-135M's 30 layers (random weights of its
shapes) plus its LM head, in turns in one process.

    python benchmarks/linear_rows.py [--rows 1 2 4 8 16 32] [--dtype bfloat16]

Where the kernel keeps packed copies of the weights (AVX512-BF16 without AMX, AVX2), a third
column multiplies by the weights as stored: inference tensors, which the kernel never
packs (they have no version counter to notice a change by), so both layouts are timed
in the same run. Every turn first reads a buffer larger than the last-level cache, so
the weights come from memory as in a decode step. Prints a markdown table of ms (median
of --repeats) and writes it to --out.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tokenswift import kernels
from tokenswift.machine import machine_name
from tokenswift.tools.bench import print_and_write_table

LAYERS = 30
# SmolLM2-135M's products of one layer (out, in): q, k, v, o, gate, up, down
LAYER_SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/linear-rows")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the kernel cannot be built here (see the warning above)")
    bad = [n for n in args.rows if not 1 <= n <= kernels.MAX_LINEAR_ROWS]
    if bad:
        parser.error(f"--rows {bad}: the kernel serves 1 to {kernels.MAX_LINEAR_ROWS} rows")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    shapes = [*LAYER_SHAPES * LAYERS, HEAD]
    weights = [(torch.randn(shape, generator=generator) * shape[1] ** -0.5).to(dtype) for shape in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    packs = any(kernels.packed_size(w) for w in weights)
    if packs:
        with torch.inference_mode():
            as_stored = [w.clone() for w in weights]
    flush = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MB, past any last-level cache
    paths = {
        "kernel": lambda xs: [kernels.few_rows_linear(xs[w.shape[1]], w) for w in weights],
        "pytorch": lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights],
    }
    if packs:
        paths["kernel, as stored"] = lambda xs: [kernels.few_rows_linear(xs[w.shape[1]], w) for w in as_stored]
    rows = []
    for n in args.rows:
        xs = {k: torch.randn(n, k, generator=generator).to(dtype) for k in (576, 1536)}
        samples = {name: [] for name in paths}
        for i in range(args.repeats + 1):
            for name in paths if i % 2 == 0 else reversed(list(paths)):
                flush.add_(1.0)
                started = time.perf_counter()
                paths[name](xs)
                if i > 0:  # the first turn warms every path (and packs the weights)
                    samples[name].append(1000 * (time.perf_counter() - started))
        medians = {name: statistics.median(times) for name, times in samples.items()}
        rows.append((n, medians))
        print(f"{n} rows: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in medians.items()), flush=True)
    names = list(paths)
    lines = ["| rows | " + " | ".join(f"{name} ms" for name in names) + " | kernel / PyTorch |",
             "|---|" + "---|" * (len(names) + 1)]
    lines += [f"| {n} | " + " | ".join(f"{m[name]:.2f}" for name in names) + f" | {m['kernel'] / m['pytorch']:.2f} |"
              for n, m in rows]
    note = (f"\n{machine_name(torch.device('cpu'))}, {args.dtype}, {torch.get_num_threads()} threads, kernel path "
            f"{kernels.linear_path()}; {len(shapes)} products ({LAYERS} layers of SmolLM2-135M's shapes and its LM "
            f"head), {weight_bytes / 1e6:.0f} MB of weights, median of {args.repeats}\n")
    print_and_write_table(lines, note, args.out, "linear_rows.md")


if __name__ == "__main__":
    main()
