"""Profile compiled tree forwards at 2K on this machine: which parts grow with the rows."""
import statistics, sys, time, collections
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from forward_cost import chain_tree
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.spec import ModelSpec
from torch.profiler import profile, ProfilerActivity
context = 2048
model, _ = load_model(ModelSpec(path="smollm2", dtype="bfloat16"))
runner = Runner(model)
runner.allocate(context + 600)
runner.use_compiled(True)
runner.use_compiled_trees((32,))
runner.prefill(torch.randint(0, runner.vocab_size, (context,)))
sizes = [int(x) for x in sys.argv[1:]] or [1, 5, 11]
trees = {n: chain_tree(n - 1) for n in sizes}
def run(n):
    if n == 1:
        return runner.forward(torch.tensor([5]), logits_rows=None)
    t = trees[n]
    return runner.forward(t.token_tensor(), tree_mask=t.mask(), depths=t.depth_tensor(), logits_rows=None)
for n in sizes:
    for _ in range(5): run(n)
res = {}
for n in sizes:
    ts=[]
    for _ in range(20):
        s=time.perf_counter(); run(n); ts.append(1000*(time.perf_counter()-s))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10): run(n)
    parts = {e.key: e.self_cpu_time_total/10/1000 for e in prof.key_averages()}
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:6]
    print(f"{n} tokens: median {statistics.median(ts):.2f} ms;", ", ".join(f"{k} {v:.2f}" for k, v in top), flush=True)
