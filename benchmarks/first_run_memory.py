"""Resident memory of a machine's first run, with its calibrations measured in the run's
process against in a child process of their own (``TOKENSWIFT_CALIBRATE``).

    python benchmarks/first_run_memory.py --new-tokens 100000 --stop-after 300 --out benchmarks/results/first-run-memory

Each mode starts a fresh process on an empty cache, as a machine's first run finds it
(inductor's cache too: its compiles are cold), except that the converted models and the
built kernels are shared with the user's cache, so nothing is converted or built again. The
process loads the model by name, starts a generation of ``--new-tokens`` (a run this long
also measures compiled steps), generates ``--stop-after`` tokens and reports its resident
memory and its peak (VmHWM) then. Modes run one after the other, never together.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenswift.paths import cache_dir

PROGRAM = r"""
import json, sys, time, logging
from tokenswift import Pipeline
from tokenswift.memory import peak_rss_mib
from tokenswift.prompts import prompt_ids
logging.basicConfig(level=logging.WARNING)
preset, model, new_tokens, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def resident():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
started = time.time()
pipe = Pipeline.from_spec({"preset": preset, "model": {"path": model}})
run = pipe.start(prompt_ids(pipe.tokenizer, 2048), new_tokens, seed=0, ignore_eos=True)
run.prefill()
for _ in run.steps():
    if len(run.new_tokens) >= stop:
        break
print(json.dumps({"resident_mib": round(resident(), 1), "peak_mib": round(peak_rss_mib(), 1),
                  "seconds": round(time.time() - started, 1), "generated": len(run.new_tokens)}))
"""


def measure(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="tokenswift-first-run-") as fresh:
        user = cache_dir()
        for shared in ("models", "kernels"):
            if (user / shared).is_dir():
                os.symlink(user / shared, Path(fresh) / shared)
        env = {**os.environ, "TOKENSWIFT_CACHE": fresh, "TOKENSWIFT_CALIBRATE": mode,
               "TOKENSWIFT_KERNEL_CACHE": os.environ.get("TOKENSWIFT_KERNEL_CACHE", str(user / "kernels")),
               "TORCHINDUCTOR_CACHE_DIR": str(Path(fresh) / "inductor")}
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM, args.preset, args.model, str(args.new_tokens), str(args.stop_after)],
            env=env, stdout=subprocess.PIPE, text=True, check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"first_run_memory.py: the {mode} run failed (exit status {done.returncode})")
    return {"mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tokenswift")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=100_000)
    parser.add_argument("--stop-after", type=int, default=300)
    parser.add_argument("--out", help="directory for first_run_memory.json and .md")
    args = parser.parse_args(argv)
    if args.stop_after < 1 or args.new_tokens < args.stop_after:
        parser.error(f"--stop-after {args.stop_after} must be in 1..--new-tokens ({args.new_tokens})")
    from tokenswift.machine import machine_name

    import torch

    rows = [measure(mode, args) for mode in ("here", "apart")]
    lines = [
        f"{args.preset} on {args.model}, 2,048-token prompt, {args.new_tokens} new tokens asked, "
        f"stopped after {args.stop_after}; {machine_name(torch.device('cpu'))}, {torch.get_num_threads()} threads",
        "",
        "| calibrations measured | resident MiB | peak MiB | seconds |",
        "|---|---|---|---|",
        *[f"| {'in the run' if r['mode'] == 'here' else 'in a child process'} | {r['resident_mib']} | {r['peak_mib']} | "
          f"{r['seconds']} |" for r in rows],
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "first_run_memory.json").write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows}, indent=1) + "\n")
        (out / "first_run_memory.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
