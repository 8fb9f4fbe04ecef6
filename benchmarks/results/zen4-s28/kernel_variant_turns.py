"""Two variants of the decode kernel in turns in one process, 30 layers of SmolLM2's
attention (3 KV / 9 query heads x 64, bfloat16), each layer's KV its own tensor (read
from memory; HOT=1: every layer over the first layer's, in cache). Needs the kernel built
with kernel_toggles.patch applied: TS_PF (rows prefetched ahead) and TS_PVR (rows from
which the values take pairs) are read at each call. The setup follows amx-s27/kern.py.

Usage: kernel_variant_turns.py KEYS TOKENS VAR A B [ROUNDS] (STAGED=1: through
staged_attention, as the runner calls it, writing the new KV into a bigger store)."""
import os, sys, time, torch, statistics
from tokenswift import kernels

keys, n, var = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
variants = sys.argv[4:6]
rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 12
hot, staged = os.environ.get("HOT") == "1", os.environ.get("STAGED") == "1"
torch.manual_seed(0)
layers, capacity = 30, keys + 64
ks = [torch.randn(1, 3, capacity, 64).bfloat16() for _ in range(layers)]
vs = [torch.randn(1, 3, capacity, 64).bfloat16() for _ in range(layers)]
query = torch.randn(1, 9, n, 64).bfloat16()
new_k, new_v = torch.randn(1, 3, n, 64).bfloat16(), torch.randn(1, 3, n, 64).bfloat16()
mask = torch.ones(n, n, dtype=torch.bool).tril() if n > 1 else None
chunk = kernels.chunk_size(keys, 3)
kernels.available()


def once():
    for layer in range(layers):
        at = 0 if hot else layer
        if staged:
            kernels.staged_attention(query, new_k, new_v, ks[at], vs[at], keys, mask, 0.125, chunk)
        else:
            kernels.decode_attention(query, ks[at][:, :, : keys + n], vs[at][:, :, : keys + n], keys, mask, 0.125, chunk=chunk)


once()
times = {v: [] for v in variants}
for r in range(rounds):
    for v in variants if r % 2 == 0 else variants[::-1]:
        os.environ[var] = v
        start = time.perf_counter()
        once()
        times[v].append(1000 * (time.perf_counter() - start))
medians = {v: statistics.median(t) for v, t in times.items()}
print(f"{'staged ' if staged else ''}{keys} keys {n} tokens{' hot' if hot else ''}: "
      + ", ".join(f"{var}={v} {m:.1f} ms" for v, m in medians.items()), f"ratio {medians[variants[1]] / medians[variants[0]]:.3f}")
