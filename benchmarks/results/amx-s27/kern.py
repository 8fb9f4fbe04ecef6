"""30 layers of the decode kernel's attention (3 KV / 9 query heads x 64, bfloat16), each layer's KV its own tensor (read from memory), or with HOT=1 every layer over the first layer's (in cache: the kernel's arithmetic without the memory). Usage: kern.py KEYS TOKENS [REPEATS]; CHUNK=n sets the chunk size."""
import os, sys, time, torch, statistics
from tokenswift import kernels
keys = int(sys.argv[1]); n = int(sys.argv[2]); reps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
torch.manual_seed(0)
L = 30
HOT = os.environ.get('HOT') == '1'
CH = int(os.environ['CHUNK']) if os.environ.get('CHUNK') else kernels.chunk_size(keys, 3)
ks = [torch.randn(1, 3, keys + n, 64).bfloat16() for _ in range(L)]
vs = [torch.randn(1, 3, keys + n, 64).bfloat16() for _ in range(L)]
q = torch.randn(1, 9, n, 64).bfloat16()
mask = torch.ones(n, n, dtype=torch.bool).tril() if n > 1 else None
def once():
    for l in range(L):
        at = 0 if HOT else l
        kernels.decode_attention(q, ks[at], vs[at], keys, mask, 0.125, chunk=CH)
kernels.available(); once()
ts = []
for _ in range(reps):
    s = time.perf_counter(); once(); ts.append(1000 * (time.perf_counter() - s))
print(f"{keys} keys {n} tokens: {statistics.median(ts):.1f} ms")
