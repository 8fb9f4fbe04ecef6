"""Tree forwards at 2K through the layered graph vs the whole decoder's graph of every size, in turns."""
import statistics, sys, time, logging
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from forward_cost import chain_tree
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.spec import ModelSpec
logging.basicConfig(level=logging.INFO)
context = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
sizes = [1, 2, 3, 4, 6, 8]
model, _ = load_model(ModelSpec(path="smollm2", dtype="bfloat16"))
runner = Runner(model)
runner.allocate(context + 64)
runner.use_compiled(True)
runner.use_compiled_trees((32,))
runner.prefill(torch.randint(0, runner.vocab_size, (context,)))
flush = torch.empty(64 * 2**20)
trees = {n: chain_tree(n - 1) for n in sizes}
def run(n):
    t = trees[n]
    return runner.forward(t.token_tensor(), tree_mask=t.mask(), depths=t.depth_tensor(), logits_rows=None)
samples = {(k, n): [] for k in ("layered", "whole") for n in sizes}
for kind in ("layered", "whole"):
    runner.compiled.layered_trees = kind == "layered"
    t0 = time.perf_counter(); [run(n) for n in sizes]; print(kind, "warm/compile", time.perf_counter() - t0, flush=True)
for i in range(15):
    for kind in (("layered", "whole") if i % 2 == 0 else ("whole", "layered")):
        runner.compiled.layered_trees = kind == "layered"
        for n in sizes:
            flush.add_(1.0)
            s = time.perf_counter(); run(n); samples[(kind, n)].append(1000 * (time.perf_counter() - s))
for n in sizes:
    l = statistics.median(samples[("layered", n)]); w = statistics.median(samples[("whole", n)])
    print(f"{n} tokens: layered {l:.2f} ms, whole {w:.2f} ms, whole-layered {w-l:+.2f}")
