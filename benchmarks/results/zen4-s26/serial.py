"""Whole tree graph: inductor kernels parallel (default) vs serial (cpp.threads=1), in turns at 2K."""
import os, statistics, sys, time, logging
os.environ["TOKENSWIFT_GRAPH_STORE"] = "0"
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from forward_cost import chain_tree
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.model import compiled as cm
from tokenswift.spec import ModelSpec
logging.basicConfig(level=logging.INFO)
sizes = [1, 2, 3, 4, 6, 8, 16]
model, _ = load_model(ModelSpec(path="smollm2", dtype="bfloat16"))
runner = Runner(model)
runner.allocate(2048 + 64)
A = runner.use_compiled(True)
A.layered_trees = False
runner.use_compiled_trees((32,))
runner.prefill(torch.randint(0, runner.vocab_size, (2048,)))
B = cm.CompiledForward(model, runner.decoder, runner.lm_head, runner.logits_dtype, runner.kernel_linears)
B.layered_trees = False
B._graphs["forward"] = A._graphs["forward"]; B._graphs["logits"] = A._graphs["logits"]; B._ready |= {k for k in A._ready if k[1] == 1}
flush = torch.empty(64 * 2**20)
def run(n):
    t = chain_tree(n - 1)
    return runner.forward(t.token_tensor(), tree_mask=t.mask(), depths=t.depth_tensor(), logits_rows=None)
for name, graphs in (("parallel", A), ("serial", B)):
    runner.compiled = graphs
    t0 = time.perf_counter()
    if name == "serial":
        with torch._inductor.config.patch({"cpp.threads": 1}):
            [run(n) for n in sizes]
    else:
        [run(n) for n in sizes]
    print(name, "compile", time.perf_counter() - t0, flush=True)
samples = {(k, n): [] for k in ("parallel", "serial") for n in sizes}
for i in range(15):
    for name, graphs in ((("parallel", A), ("serial", B)) if i % 2 == 0 else (("serial", B), ("parallel", A))):
        runner.compiled = graphs
        for n in sizes:
            flush.add_(1.0)
            s = time.perf_counter(); run(n); samples[(name, n)].append(1000 * (time.perf_counter() - s))
a = run(4); runner.compiled = A; b = run(4)
print("max diff serial vs parallel", (a.float() - b.float()).abs().max().item() if torch.is_tensor(a) else "n/a")
for n in sizes:
    p = statistics.median(samples[("parallel", n)]); s = statistics.median(samples[("serial", n)])
    print(f"{n} tokens: parallel {p:.2f} ms, serial {s:.2f} ms, serial-parallel {s-p:+.2f}")
