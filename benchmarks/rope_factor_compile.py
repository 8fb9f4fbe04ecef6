"""What compiling the one-token graph costs at a RoPE factor: cold (an FX-graph-cache
miss) or warm (hits only).

    python benchmarks/rope_factor_compile.py 3.75

Loads SmolLM2-135M with YaRN scaling of the given factor in this fresh process, compiles
its one-token forward and LM-head row, and prints the seconds and inductor's counters.
Run it at a factor never used before: with the graphs reading the scaling as an input
(:func:`tokenswift.model.compiled.rope_scaling_as_input`) it is a cache hit (8.2 s on a
2-core AMD EPYC Zen 4, 2026-12-05), where the scaling baked in as a constant compiled it
cold (94.5-97 s).
"""

import logging
import sys
import time

from torch._dynamo.utils import counters

from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
from tokenswift.tools.interleaved import compile_model_once

logging.basicConfig(level=logging.INFO, format="%(message)s")
factor = float(sys.argv[1])
model, tokenizer = load_model(ModelSpec(path="smollm2", dtype="bfloat16", rope={"type": "yarn", "factor": factor}))
started = time.perf_counter()
compile_model_once(model, tokenizer, trees=False)
logging.info("factor %s: compiled in %.1f s; inductor counters %s", factor, time.perf_counter() - started,
             dict(counters["inductor"]))
