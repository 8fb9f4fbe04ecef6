"""Needs the kernel built with kernel_toggles.patch applied (TS_PF: rows prefetched ahead; TS_PVR: rows from which values take pairs), read at each call. Compiled verify forwards of 1 and 2 tokens over a long prefill, env-toggled kernel variants in turns."""
import os, sys, time, statistics, torch
from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
from tokenswift.tools.bench import preset_pipeline, prompt_tokens_for
from tokenswift.tools.contexts import auto_rope
from tokenswift.tools.interleaved import compile_model_once, prefill_once
from tokenswift.tree import DraftTree
ctx = int(sys.argv[1]); var = sys.argv[2]; vals = sys.argv[3:5]
rope = auto_rope(8192, ctx + 400) if ctx + 400 > 8192 else None
model, tok = load_model(ModelSpec(path="smollm2", dtype="bfloat16", rope=rope))
prompt = prompt_tokens_for(tok, ctx, None)
compile_model_once(model, tok, trees=True)
pipe = preset_pipeline("ar", model, tok, overrides={"model": {"compile": True}})
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
res = {(v, n): [] for v in vals for n in (1, 2, 3)}
for r in range(12):
    for v in (vals if r % 2 == 0 else vals[::-1]):
        os.environ[var] = v
        for n in (1, 2, 3):
            res[(v, n)].append(fwd(n))
for n in (1, 2, 3):
    print(f"{ctx} {n} tokens: " + ", ".join(f"{var}={v} {statistics.median(res[(v, n)]):.1f}" for v in vals))
