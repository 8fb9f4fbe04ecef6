"""Resident memory and malloc's heaps of a run resumed from the Zen 4 100K run's checkpoint.

    python benchmarks/results/zen4-memory-steady/resume_memory.py 4000 14000 [PRESET]

Resumes the run's first START generated tokens (its spec, or PRESET with the run's model,
penalty and sampling), generates to END, and prints VmRSS and glibc's mallinfo2 (arena,
in use, free, mmapped) at the first step and every 1,000 tokens. The logs beside it
(ar-4k-14k.log with PRESET ar, tokenswift-4k-14k.log with the run's own spec) were written
by a diagnostic version of this script that printed mallinfo2's fields one by one (its
"inuse" is the heaps' bytes in use without the mmapped chunks, which ``malloc_mib``
counts in use; the mmapped ones stayed at 113.8 MiB from the first step on) (2026-12-06).
"""
import sys

from tokenswift import Pipeline
from tokenswift.checkpoint import Checkpoint
from tokenswift.memory import malloc_mib

start, end = int(sys.argv[1]), int(sys.argv[2])
preset = sys.argv[3] if len(sys.argv) > 3 else None
run = Checkpoint.load("benchmarks/results/zen4-long-100k/long_run.ckpt")
spec = dict(run.spec)
if preset:
    spec = {"preset": preset, **{k: spec[k] for k in ("model", "penalty", "sampling")}}
resume = Checkpoint(spec=spec, prompt_tokens=run.prompt_tokens, tokens=run.tokens[:start], seed=run.seed,
                    rng_state=run.rng_state, max_new_tokens=end, ignore_eos=True)


def report(label):
    rss = next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
    in_use, free = malloc_mib() or (float("nan"), float("nan"))
    print(f"{label} rss {rss:.1f} malloc in use {in_use:.1f} free {free:.1f}", flush=True)


generation = Pipeline.from_spec(spec).start(resume=resume)
generation.prefill()
last = None
for _ in generation.steps():
    generated = len(generation.new_tokens)
    if last is None or generated - last >= 1000:
        report(generated)
        last = generated
report("done")
