"""1-, 2- and 3-token verify forwards over a long prefill, through the runner as a step
calls it, compiled or eager; medians of 15 rounds in turns.

Usage: tree_forwards.py POSITIONS compiled|eager [VAR A B]. With VAR A B, each round
runs every size under VAR=A and VAR=B in turns (the kernel built with
kernel_toggles.patch reads TS_PF / TS_PVR at each call)."""
import os, sys, time, statistics
from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
from tokenswift.tools.bench import preset_pipeline, prompt_tokens_for
from tokenswift.tools.contexts import auto_rope
from tokenswift.tools.interleaved import compile_model_once, prefill_once
from tokenswift.tree import DraftTree

ctx, compiled = int(sys.argv[1]), sys.argv[2] == "compiled"
var, variants = (sys.argv[3], sys.argv[4:6]) if len(sys.argv) > 5 else (None, [None])
rope = auto_rope(8192, ctx + 400) if ctx + 400 > 8192 else None
model, tok = load_model(ModelSpec(path="smollm2", dtype="bfloat16", rope=rope))
prompt = prompt_tokens_for(tok, ctx, None)
if compiled:
    compile_model_once(model, tok, trees=True)
pipe = preset_pipeline("ar", model, tok, overrides={"model": {"compile": compiled}})
pre = prefill_once({"p": pipe}, prompt, pipe.kv_capacity(len(prompt), 64))
gen = pipe.start(prompt, 64, seed=0, ignore_eos=True)
gen.prefill(pre)
steps = gen.steps()
next(steps), next(steps)
runner = pipe.runner


def forward_ms(n):
    tree = DraftTree.root_only(7)
    if n > 1:
        tree.add_branch(list(range(9, 9 + n - 1)))
    start = time.perf_counter()
    runner.forward(tree.token_tensor(), tree_mask=tree.mask() if n > 1 else None, depths=tree.depth_tensor() if n > 1 else None)
    return 1000 * (time.perf_counter() - start)


for n in (1, 2, 3):
    forward_ms(n), forward_ms(n)
times = {(v, n): [] for v in variants for n in (1, 2, 3)}
for r in range(15):
    for v in variants if r % 2 == 0 else variants[::-1]:
        if var:
            os.environ[var] = v
        for n in (1, 2, 3):
            times[(v, n)].append(forward_ms(n))
for v in variants:
    label = f"{var}={v} " if var else ""
    print(ctx, "compiled" if compiled else "eager", label + " ".join(f"{n}: {statistics.median(times[(v, n)]):.1f}" for n in (1, 2, 3)))
