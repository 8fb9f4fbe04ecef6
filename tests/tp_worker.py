"""Run under torchrun by tests/test_tensor_parallel.py: the API runs of CASES on a
saved tiny model; each rank writes what it generated to OUT.rank<N>.json."""

import json
import sys

from tokenswift import Pipeline, distributed

# name -> (spec overrides, seed); greedy unless the case sets sampling.
CASES = {
    "ar": ({"preset": "ar", "sampling": {"greedy": True}}, 0),
    "tokenswift": ({"preset": "tokenswift", "drafter": {"heads": "random"}, "sampling": {"greedy": True}}, 0),
    "medusa": ({"preset": "medusa", "drafter": {"heads": "random"}, "sampling": {"greedy": True}}, 0),
    # A budget far below the context: the dynamic policy really selects, per local KV head.
    "tokenswift-budget-12": (
        {"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 12, "sink": 2},
         "sampling": {"greedy": True}},
        0,
    ),
    "tokenswift-sampling": ({"preset": "tokenswift", "drafter": {"heads": "random"}}, 3),
}
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 8, 9, 1, 2, 3, 4]
NEW_TOKENS = 48


def run_case(name: str, model_dir: str) -> dict:
    overrides, seed = CASES[name]
    spec = {**overrides, "model": {"path": model_dir, "dtype": "float32"}}
    pipe = Pipeline.from_spec(spec)
    result = pipe.generate(PROMPT, NEW_TOKENS, seed=seed, ignore_eos=True)
    return {"tokens": result.tokens, "kv_heads": pipe.runner.kv_heads, "tokens_per_step": result.stats.tokens_per_step}


def main(model_dir: str, out: str) -> None:
    results = {name: run_case(name, model_dir) for name in CASES}
    results["world_size"] = distributed.world_size()
    with open(f"{out}.rank{distributed.rank()}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
