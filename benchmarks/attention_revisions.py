"""The decode-attention kernel of this working tree against the one of an earlier git
revision, in turns in one process, on SmolLM2-135M's shapes (30 layers, 3 KV heads, 9
query heads, head dim 64), outputs compared bit for bit.

    python benchmarks/attention_revisions.py [--base HEAD] [--keys 2048 8192] [--tokens 1 2 4 8]

The base revision's ``tokenswift/kernels/decode_attention.cpp`` is built beside the
tree's under another op namespace (so both load into one process) with the same flags.
Timing the two in separate processes on a shared 2-core host read differences of +-30%
for the same build; in turns they see the same drift. Prints a markdown table (ms per 30
layers, median of --repeats; "equal" when every output matched the base's exactly) and
writes it to --out.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from tokenswift import kernels
from tokenswift.machine import machine_name
from tokenswift.tools.bench import print_and_write_table

LAYERS, KV_HEADS, GROUP, DIM = 30, 3, 3, 64
SOURCE = "tokenswift/kernels/decode_attention.cpp"
HEADERS = ("tokenswift/kernels/amx.h",)


def build_base(revision: str, folder: Path) -> None:
    """The revision's kernel built as torch.ops.tokenswift_base.decode_attention."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip())
    for path in (SOURCE, *HEADERS):
        text = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=root, capture_output=True, text=True, check=True).stdout
        (folder / Path(path).name).write_text(text.replace("tokenswift_cpu", "tokenswift_base"))
    cpp_extension.load(
        name="tokenswift_base_attention", sources=[str(folder / Path(SOURCE).name)], build_directory=str(folder),
        extra_cflags=["-O3", f"-march={kernels.march()}", "-fopenmp", "-ffp-contract=fast"], extra_ldflags=["-fopenmp"],
        is_python_module=False, verbose=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernel is the baseline")
    parser.add_argument("--keys", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/attention-revisions")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the kernel cannot be built here (see the warning above)")
    with tempfile.TemporaryDirectory() as folder:
        build_base(args.base, Path(folder))
    ops = {"base": torch.ops.tokenswift_base.decode_attention, "tree": torch.ops.tokenswift_cpu.decode_attention}
    generator = torch.Generator().manual_seed(0)
    capacity = max(args.keys) + max(args.tokens)
    store = [(torch.randn(1, KV_HEADS, capacity, DIM, generator=generator).bfloat16(),
              torch.randn(1, KV_HEADS, capacity, DIM, generator=generator).bfloat16()) for _ in range(LAYERS)]
    rows = []
    for keys in args.keys:
        chunk = kernels.chunk_size(keys, KV_HEADS)
        for n in args.tokens:
            query = torch.randn(KV_HEADS, GROUP * n, DIM, generator=generator)
            mask = torch.ones(n, n, dtype=torch.bool).tril() if n > 1 else None
            prefix = keys if n > 1 else keys + 1
            samples, first = {name: [] for name in ops}, {}
            for i in range(args.repeats + 1):
                for name in ops if i % 2 == 0 else reversed(list(ops)):
                    started = time.perf_counter()
                    outs = [ops[name](query, k[:, :, : keys + n], v[:, :, : keys + n], prefix, mask, chunk, DIM**-0.5) for k, v in store]
                    if i == 0:  # the first turn warms both; its outputs are compared
                        first[name] = outs
                    else:
                        samples[name].append(1000 * (time.perf_counter() - started))
            equal = all(torch.equal(a, b) for a, b in zip(first["base"], first["tree"]))
            base, tree = (statistics.median(samples[name]) for name in ops)
            rows.append((keys, n, base, tree, equal))
            print(f"{keys} keys, {n} tokens: base {base:.1f} ms, tree {tree:.1f} ms ({tree / base:.3f}), outputs {'equal' if equal else 'DIFFER'}", flush=True)
    lines = [f"| keys | new tokens | {args.base} ms | working tree ms | ratio | outputs |", "|---|---|---|---|---|---|"]
    lines += [f"| {keys:,} | {n} | {base:.1f} | {tree:.1f} | {tree / base:.3f} | {'equal' if equal else 'differ'} |" for keys, n, base, tree, equal in rows]
    note = (f"\n{machine_name(torch.device('cpu'))}, bfloat16 KV, float32 queries, {torch.get_num_threads()} threads, "
            f"-march={kernels.march()}; {LAYERS} layers of {KV_HEADS} KV / {KV_HEADS * GROUP} query heads x {DIM}, in turns, median of {args.repeats}\n")
    print_and_write_table(lines, note, args.out, "attention_revisions.md")


if __name__ == "__main__":
    main()
