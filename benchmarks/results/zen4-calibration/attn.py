"""30 layers of attention for n new tokens over 2K keys, bf16: decode kernel vs the SDPA path."""
import sys, time, torch
from tokenswift import kernels
from tokenswift.model.attention import grouped_attention
prefix = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
dt = torch.bfloat16
def t(fn, reps=9):
    fn(); best = 1e9
    for _ in range(reps):
        s = time.perf_counter(); fn(); best = min(best, time.perf_counter() - s)
    return best * 1000
print("path", kernels.linear_path(), "prefix", prefix)
for n in (1, 2, 3, 4, 8, 16, 32):
    L = prefix + n
    qs = [torch.randn(1, 9, n, 64).to(dt) for _ in range(30)]
    ks = [torch.randn(1, 3, L, 64).to(dt) for _ in range(30)]
    vs = [torch.randn(1, 3, L, 64).to(dt) for _ in range(30)]
    tree = torch.eye(n, dtype=torch.bool); tree[:, 0] = True
    full = torch.ones(1, 1, n, L, dtype=torch.bool); full[0, 0, :, prefix:] = tree
    a = t(lambda: [kernels.decode_attention(q, k, v, prefix, tree, 0.125) for q, k, v in zip(qs, ks, vs)])
    b = t(lambda: [grouped_attention(q, k, v, full, 0.125) for q, k, v in zip(qs, ks, vs)])
    err = (kernels.decode_attention(qs[0], ks[0], vs[0], prefix, tree, 0.125).float() - grouped_attention(qs[0], ks[0], vs[0], full, 0.125).float()).abs().max().item()
    print(f"n {n:2d}: kernel {a:6.2f} ms  sdpa {b:6.2f} ms  max diff {err:.3g}", flush=True)
