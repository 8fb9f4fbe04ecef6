"""What a process serving many requests holds: malloc's heaps and resident memory after
requests of distinct prompt lengths, as a server gets them.

    python benchmarks/request_memory.py --requests 100 --out benchmarks/results/request-memory

Each mode runs in a fresh process: one pipeline (eager, so that nothing compiles in
between), then ``--requests`` generations of ``--new-tokens`` tokens whose prompts are
the held-out text's first 200, 207, 214, ... tokens (each longer than the last, so the
runner's KV store is replaced each time, and each a new shape for every product).
``capped``: oneDNN's per-shape caches as importing tokenswift sets them;
``uncapped``: 1,024 entries each, PyTorch's default. Every ``--every`` requests it
records malloc's in-use and free MiB (``tokenswift.memory.malloc_mib``) and VmRSS, and
at the end what a full cyclic collection frees (nothing, where no reference cycle holds
memory). Modes run one after the other, never together.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tokenswift.memory import NATIVE_CACHE_VARIABLES

PROGRAM = r"""
import gc, json, sys, logging
from tokenswift import Pipeline
from tokenswift.memory import malloc_mib
from tokenswift.prompts import prompt_ids
logging.basicConfig(level=logging.WARNING)
preset, model, requests, new_tokens, every = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
def resident():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
pipe = Pipeline.from_spec({"preset": preset, "model": {"path": model, "compile": False}})
text = prompt_ids(pipe.tokenizer, 200 + 7 * requests)
rows = []
for i in range(requests):
    pipe.generate(text[: 200 + 7 * i], new_tokens, seed=0, ignore_eos=True)
    if (i + 1) % every == 0:
        in_use, free = malloc_mib()
        rows.append({"requests": i + 1, "in_use_mib": round(in_use, 1), "free_mib": round(free, 1),
                     "rss_mib": round(resident(), 1)})
before = malloc_mib()[0]
collected = gc.collect()
print(json.dumps({"rows": rows, "collected_objects": collected, "collection_freed_mib": round(before - malloc_mib()[0], 1)}))
"""

MODES = {"capped": {}, "uncapped": dict.fromkeys(NATIVE_CACHE_VARIABLES, "1024")}


def measure(mode: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MODES["uncapped"]}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, args.preset, args.model, str(args.requests), str(args.new_tokens), str(args.every)],
        env={**env, **MODES[mode]}, stdout=subprocess.PIPE, text=True, check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the {mode} run failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(report: dict) -> str:
    lines = ["| caches | requests | malloc in use, MiB | malloc free, MiB | resident, MiB |", "|---|---|---|---|---|"]
    for mode, result in report["modes"].items():
        for row in result["rows"]:
            lines.append(f"| {mode} | {row['requests']} | {row['in_use_mib']:,} | {row['free_mib']:,} | {row['rss_mib']:,} |")
    tail = "; ".join(f"{mode}: a full collection at the end freed {r['collection_freed_mib']} MiB"
                     for mode, r in report["modes"].items())
    return "\n".join(lines) + f"\n\n{report['machine']}; preset {report['preset']}, eager, " \
        f"{report['requests']} requests of {report['new_tokens']} new tokens, prompts of 200 + 7i tokens; {tail}.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ar")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=2)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--modes", default="capped,uncapped", help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.requests < 1 or args.every < 1:
        parser.error(f"--modes takes {list(MODES)} (got {unknown}); --requests and --every at least 1")
    import torch

    from tokenswift.machine import machine_name

    report = {"machine": machine_name(torch.device("cpu")), "preset": args.preset, "requests": args.requests,
              "new_tokens": args.new_tokens, "modes": {mode: measure(mode, args) for mode in modes}}
    text = markdown(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "request_memory.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "request_memory.md").write_text(text)


if __name__ == "__main__":
    main()
