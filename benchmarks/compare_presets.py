"""Compare presets on the demo model in one process (same model, prompt, settings).

    python benchmarks/compare_presets.py --presets ar prompt-lookup suffix --new-tokens 384

Prints tokens/s, the ratio to the first preset, tokens per step and the retriever's
share of accepted tokens, for sampling (paper settings) and for greedy decoding.
"""

from __future__ import annotations

import argparse

from tokenswift import Pipeline
from tokenswift.model.loading import load_model
from tokenswift.prompts import prompt_ids
from tokenswift.spec import ModelSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--presets", nargs="+", default=["ar", "prompt-lookup", "suffix"])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=384)
    args = parser.parse_args()
    model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype))
    prompt = prompt_ids(tokenizer, args.prompt_tokens)
    print("| sampling | preset | tok/s | vs first | tok/step | retriever share |")
    print("|---|---|---|---|---|---|")
    for greedy in (False, True):
        base = None
        for preset in args.presets:
            overrides = {"sampling": {"greedy": True}} if greedy else None
            pipe = Pipeline.from_spec(preset, model, tokenizer, overrides=overrides)
            stats = pipe.generate(prompt, args.new_tokens, seed=0, ignore_eos=True).stats
            base = base or stats.decode_tokens_per_second
            print(
                f"| {'greedy' if greedy else 'T=1, min-p 0.1'} | {preset} | {stats.decode_tokens_per_second:.2f} | "
                f"{stats.decode_tokens_per_second / base:.2f} | {stats.tokens_per_step:.2f} | {stats.retriever_share:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
