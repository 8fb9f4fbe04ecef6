"""210 products of a SmolLM2 forward: torch F.linear vs the few-rows kernel, per row count."""
import sys, time, torch, torch.nn.functional as F
from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
from tokenswift import kernels
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
model, _ = load_model(ModelSpec(path="smollm2", dtype=dtype, device="cpu"))
ws = [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
print(len(ws), "products", sum(w.numel() * w.element_size() for w in ws) / 1e6, "MB; path", kernels.linear_path())
def t(fn, reps=7):
    fn(); best = 1e9
    for _ in range(reps):
        s = time.perf_counter(); fn(); best = min(best, time.perf_counter() - s)
    return best * 1000
for rows in (1, 2, 4, 8, 16, 32):
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in ws}
    a = t(lambda: [F.linear(xs[w.shape[1]], w) for w in ws])
    b = t(lambda: [kernels.few_rows_linear(xs[w.shape[1]], w) for w in ws])
    print(f"rows {rows:2d}: torch {a:6.1f} ms  kernel {b:6.1f} ms")
head = model.lm_head.weight
for rows in (1, 4, 16):
    x = torch.randn(rows, head.shape[1]).to(head.dtype)
    print(f"lm head rows {rows}: torch {t(lambda: F.linear(x, head)):.2f} kernel {t(lambda: kernels.few_rows_linear(x, head)):.2f}")
