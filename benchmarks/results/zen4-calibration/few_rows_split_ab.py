"""A/B of two builds of the few-rows kernel in one process (see few-rows-split-ab.txt):
/tmp/oldk/frl_old.cpp and frl_new.cpp, copies of tokenswift/kernels/few_rows_linear.cpp with the
op namespace renamed to tokenswift_old / tokenswift_new, and amx.h beside them."""
import time, torch, statistics, sys
from torch.utils import cpp_extension
for name in ("old", "new"):
    cpp_extension.load(name=f"frl_{name}", sources=[f"/tmp/oldk/frl_{name}.cpp"], extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"],
                       extra_ldflags=["-fopenmp"], build_directory="/tmp/oldk/" + name if False else None, is_python_module=False, verbose=False)
ops = {"old": torch.ops.tokenswift_old.few_rows_linear, "new": torch.ops.tokenswift_new.few_rows_linear}
shapes = [(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]*30
Ws = [torch.randn(o,k).to(torch.bfloat16) for o,k in shapes]
head = torch.randn(49152, 576).to(torch.bfloat16)
def once(op, n, ws):
    xs = {k: torch.randn(n,k).to(torch.bfloat16) for k in (576,1536)}
    t=time.perf_counter(); [op(xs[w.shape[1]], w, None) for w in ws]; return time.perf_counter()-t
rows = [int(a) for a in sys.argv[1:]] or [1,2,3,4,5,8,12,16]
x = torch.randn(16, 576).to(torch.bfloat16)
for n in rows:
    assert torch.equal(ops["old"](x[:n], Ws[0], None).float().sum(), ops["old"](x[:n], Ws[0], None).float().sum())
for label, ws in (("forward products", Ws), ("LM head", [head])):
    for n in rows:
        res = {"old": [], "new": []}
        for rep in range(12):
            for name in (("old", "new") if rep % 2 else ("new", "old")):
                res[name].append(once(ops[name], n, ws))
        o, nw = (1000*statistics.median(res[k]) for k in ("old", "new"))
        print(f"{label} {n:2d} rows: old {o:.2f} ms new {nw:.2f} ms ({nw/o:.2f}x)", flush=True)
