"""30 layers of staged_attention over KEYS positions (argv[1]), in turns in one process: one token, two tokens as a dense chain (no mask) and with their tree mask. Usage: two_token_kernel_turns.py 32768"""
import time, statistics, torch, sys
from tokenswift import kernels
keys = int(sys.argv[1]); n = 2; L = 30; cap = keys + 64
torch.manual_seed(0)
sk = [torch.randn(1, 3, cap, 64).bfloat16() for _ in range(L)]
sv = [torch.randn(1, 3, cap, 64).bfloat16() for _ in range(L)]
q = torch.randn(1, 9, n, 64).bfloat16(); k = torch.randn(1, 3, n, 64).bfloat16(); v = torch.randn(1, 3, n, 64).bfloat16()
q1 = q[:, :, :1].contiguous(); k1 = k[:, :, :1].contiguous(); v1 = v[:, :, :1].contiguous()
tril = torch.ones(n, n, dtype=torch.bool).tril()
kernels.available()
def once(kind):
    for l in range(L):
        if kind == "one": kernels.staged_attention(q1, k1, v1, sk[l], sv[l], keys, None, 0.125, kernels.chunk_size(keys + 1, 3))
        elif kind == "none": kernels.staged_attention(q, k, v, sk[l], sv[l], keys, None, 0.125, kernels.chunk_size(keys + n, 3))
        else: kernels.staged_attention(q, k, v, sk[l], sv[l], keys, tril, 0.125, kernels.chunk_size(keys, 3))
for kind in ("one", "none", "tril"): once(kind)
ts = {kind: [] for kind in ("one", "none", "tril")}
for r in range(10):
    for kind in ts:
        s = time.perf_counter(); once(kind); ts[kind].append(1000 * (time.perf_counter() - s))
print(keys, {kind: round(statistics.median(t), 1) for kind, t in ts.items()}, "chunks", kernels.chunk_size(keys + n, 3), kernels.chunk_size(keys, 3))
