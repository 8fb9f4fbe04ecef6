"""Verify forwards of 1-4 tokens over a 2K held-out prompt, compiled, as a step calls the
runner, with environment variants in turns in one process (medians of 15 rounds).

Usage: forward_turns.py POSITIONS "VAR=A,VAR=B[:VAR2=C]" -- each variant a colon-separated
list of VAR=value set before its forwards. With linear_prefetch_toggle.patch applied, the
few-rows product reads TS_LPF (vectors prefetched ahead) at each call."""
import os, sys, time, statistics
import torch
from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
from tokenswift.tools.bench import preset_pipeline, prompt_tokens_for
from tokenswift.tools.interleaved import compile_model_once, prefill_once
from tokenswift.tree import DraftTree
ctx = int(sys.argv[1]); variants=sys.argv[2].split(",")
model, tok = load_model(ModelSpec(path="smollm2", dtype="bfloat16"))
prompt = prompt_tokens_for(tok, ctx, None)
compile_model_once(model, tok, trees=True)
pipe = preset_pipeline("ar", model, tok, overrides={"model": {"compile": True}})
pre = prefill_once({"p": pipe}, prompt, pipe.kv_capacity(len(prompt), 64))
gen = pipe.start(prompt, 64, seed=0, ignore_eos=True)
gen.prefill(pre)
steps = gen.steps(); next(steps), next(steps)
runner = pipe.runner
def fwd(n):
    tree = DraftTree.root_only(7)
    if n > 1: tree.add_branch(list(range(9, 9 + n - 1)))
    s=time.perf_counter()
    runner.forward(tree.token_tensor(), tree_mask=tree.mask() if n > 1 else None, depths=tree.depth_tensor() if n > 1 else None, logits_rows=None)
    return 1000*(time.perf_counter()-s)
sizes=(1,2,3,4)
for n in sizes: fwd(n); fwd(n)
ts={(v,n):[] for v in variants for n in sizes}
for r in range(15):
    for v in (variants if r%2==0 else variants[::-1]):
        for kv in v.split(':'):
            a,b=kv.split('='); os.environ[a]=b
        for n in sizes: ts[(v,n)].append(fwd(n))
for v in variants:
    print(ctx, v, " ".join(f"{n}: {statistics.median(ts[(v,n)]):.2f}" for n in sizes), flush=True)
