"""In one process, in turns: the staged C++ op vs the Python join + decode_attention path (compiled forwards at 2K)."""
import statistics, sys, time
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from forward_cost import chain_tree
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.spec import ModelSpec
from tokenswift.model import attention as A
from tokenswift import kernels
model, _ = load_model(ModelSpec(path="smollm2", dtype="bfloat16"))
runner = Runner(model)
runner.allocate(2048 + 600)
runner.use_compiled(True)
runner.use_compiled_trees((32,))
runner.prefill(torch.randint(0, runner.vocab_size, (2048,)))
new_call = A._StagedKernel.__call__
def old_call(self, layer, query, key, value, scaling):
    if query.dtype != self.dtype:
        return None
    keys, values = self.plan.view.join(self.store, layer, key, value)
    return kernels.decode_attention(query, keys, values, self.plan.prefix, self.mask, scaling, chunk=self.chunk)
t5 = chain_tree(4)
one = lambda: runner.forward(torch.tensor([5]), logits_rows=None)
five = lambda: runner.forward(t5.token_tensor(), tree_mask=t5.mask(), depths=t5.depth_tensor(), logits_rows=None)
res = {}
for i in range(60):
    for kind, call in ((("old", old_call), ("new", new_call)) if i % 2 else (("new", new_call), ("old", old_call))):
        A._StagedKernel.__call__ = call
        for k, f in (("one", one), ("five", five)):
            s = time.perf_counter(); f(); t = 1000 * (time.perf_counter() - s)
            if i >= 4: res.setdefault((kind, k), []).append(t)
for k in ("one", "five"):
    o, n = statistics.median(res[("old", k)]), statistics.median(res[("new", k)])
    print(f"{k}: old {o:.2f} ms, new {n:.2f} ms, new-old {n-o:+.2f}")
