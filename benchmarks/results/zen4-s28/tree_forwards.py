"""1-, 2- and 3-token verify forwards over a long prefill (argv[1] positions), compiled or eager (argv[2]), through the runner as a step calls it; medians of 15 in turns. Usage: tree_forwards.py 16384 compiled"""
import sys, time, statistics, torch
from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
from tokenswift.tools.bench import preset_pipeline, prompt_tokens_for
from tokenswift.tools.contexts import auto_rope
from tokenswift.tools.interleaved import compile_model_once, prefill_once
from tokenswift.tree import DraftTree
ctx = int(sys.argv[1]); compiled = sys.argv[2] == "compiled"
rope = auto_rope(8192, ctx + 400) if ctx + 400 > 8192 else None
model, tok = load_model(ModelSpec(path="smollm2", dtype="bfloat16", rope=rope))
prompt = prompt_tokens_for(tok, ctx, None)
if compiled: compile_model_once(model, tok, trees=True)
pipe = preset_pipeline("ar", model, tok, overrides={"model": {"compile": compiled}})
pre = prefill_once({"p": pipe}, prompt, pipe.kv_capacity(len(prompt), 64))
gen = pipe.start(prompt, 64, seed=0, ignore_eos=True); gen.prefill(pre)
steps = gen.steps(); next(steps); next(steps)
runner = pipe.runner
def fwd(n):
    tree = DraftTree.root_only(7)
    if n > 1: tree.add_branch(list(range(9, 9 + n - 1)))
    t = time.perf_counter()
    runner.forward(tree.token_tensor(), tree_mask=tree.mask() if n > 1 else None, depths=tree.depth_tensor() if n > 1 else None)
    return 1000 * (time.perf_counter() - t)
for n in (1, 2, 3): fwd(n); fwd(n)
res = {n: [] for n in (1, 2, 3)}
for r in range(15):
    for n in (1, 2, 3): res[n].append(fwd(n))
print(ctx, "compiled" if compiled else "eager", " ".join(f"{n}: {statistics.median(v):.1f}" for n, v in res.items()))
