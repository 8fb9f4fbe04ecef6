"""A real eagle run (step_stages' setup) at a long context with the verify forward's parts timed."""
import collections, statistics, sys, time
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import step_stages
from tokenswift.model import runner as R
from tokenswift import decoding as D
from tokenswift.model import compiled as C
times = collections.defaultdict(list)
orig_forward = R.Runner.forward
def forward(self, tokens, **kw):
    s = time.perf_counter(); out = orig_forward(self, tokens, **kw)
    if kw.get("view") is None and kw.get("tree_mask") is not None:
        times[("runner.forward", int(tokens.numel()))].append(time.perf_counter() - s)
    return out
R.Runner.forward = forward
orig_call = C.CompiledForward.forward
def cforward(self, ids, pos):
    s = time.perf_counter(); out = orig_call(self, ids, pos)
    times[("compiled.forward", int(ids.shape[-1]))].append(time.perf_counter() - s)
    return out
C.CompiledForward.forward = cforward
orig_ns = D.NodeScores.__init__
def ns(self, tree, *a, **k):
    s = time.perf_counter(); orig_ns(self, tree, *a, **k)
    times[("NodeScores", len(tree))].append(time.perf_counter() - s)
D.NodeScores.__init__ = ns
orig_output = R.Runner._output
def output(self, *a, **k):
    s = time.perf_counter(); out = orig_output(self, *a, **k)
    times[("_output", 0)].append(time.perf_counter() - s)
    return out
R.Runner._output = output
context = int(sys.argv[1])
step_stages.run(["eagle"], context, 128, True, 0)
for key in sorted(times):
    v = times[key]
    print(key, len(v), f"median {1000*statistics.median(v):.2f} ms")
