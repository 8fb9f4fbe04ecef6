"""One ultra-long generation, watched block by block: time per token and resident memory.

    python benchmarks/long_run.py --new-tokens 100000 --rope yarn:16 --out benchmarks/results/long-100k

The demo model was trained on 8,192 positions, so a run past that needs a RoPE-scaling
override (``--rope TYPE:FACTOR``, the model spec's ``rope`` option). For every block of
``--block`` new tokens it records the milliseconds per token (all of it, and the
drafting stage alone: the part a partial drafting cache keeps flat; verification always
reads the whole cache, so it grows with the context), the resident memory (VmRSS), and
the bound the run must stay within: 1.2 x (the Python runtime's resident memory before
the model is loaded + the weights' bytes + what the library predicts for the run: KV
store, drafting view and working set). The weights are counted from the parameters,
not from the resident memory after loading: a model loaded from safetensors is mapped
lazily, so most of its pages become resident only at the first forward. Writes ``long_run.json``
after every block (an interrupted run keeps its curve), ``long_run.png`` and
``long_run.md``; ``--resume`` continues an interrupted run from its checkpoint.

``--ar-at 8000,32000,...`` samples plain ``ar`` at those points of the run, from its
own checkpoint: the run's prompt and first N generated tokens prefilled, then
``--ar-tokens`` ``ar`` steps timed (the same model spec, sampling and KV capacity as
the run, so its compiled forwards are the run's); each sample is recorded beside the
run's block there (the speedup curve), with how many of its tokens equal the run's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from tqdm import tqdm

from tokenswift import Pipeline, hookimpl
from tokenswift.memory import malloc_mib, parameter_bytes, peak_rss_mib
from tokenswift.checkpoint import Checkpoint
from tokenswift.errors import SpecError, TokenswiftError
from tokenswift.health import EMPTY_SUMMARY
from tokenswift.prompts import prompt_ids
from tokenswift.spec import parse_rope

MIB = 2**20


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rope_option(value: str | None) -> dict | None:
    try:
        return parse_rope(value)
    except SpecError as exc:
        raise SystemExit(f"long_run.py: error: --rope: {exc}") from None


def session_marks(device) -> dict:
    """What each block records of where it ran: a resumed run may span machines and code."""
    import subprocess

    from tokenswift.machine import machine_name

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"machine": machine_name(device), "commit": commit}


def health_fields(health) -> dict:
    """distinct-1..4 and the model's own NLL over the last 1,024 tokens (None: none yet)."""
    summary = health.summary() if health is not None else dict(EMPTY_SUMMARY)
    summary.pop("self_nll")  # the run's mean since this session's start: the window's says more per block
    return summary


class BlockRecorder:
    """A pluggy observer: one record per ``block`` new tokens."""

    def __init__(self, block: int, bar: tqdm, on_block, marks: dict | None = None) -> None:
        self.block, self.bar, self.on_block = block, bar, on_block
        self.marks = marks or {}
        self.blocks: list[dict] = []
        self.mark = None  # (generated, seconds) at the last block end
        self.propose_seconds = 0.0  # drafting-stage seconds since the last block end
        self.steps = self.accepted = self.retrieved = self.passes = 0  # since the last block end

    @hookimpl
    def tokenswift_step_end(self, pipeline, step):
        self.bar.update(len(step.emitted))
        if self.mark is None:
            self.mark = (step.generated - len(step.emitted), 0.0)
        self.propose_seconds += step.stage_seconds["propose"]
        self.steps += 1
        self.accepted += step.accepted
        self.retrieved += step.retrieved
        self.passes += step.drafting_pass
        generated, seconds = self.mark
        if step.generated - generated < self.block and step.generated < self.bar.total:
            return
        tokens = step.generated - generated
        heaps = malloc_mib()
        self.blocks.append(
            {
                "generated": step.generated,
                "ms_per_token": round(1000 * (step.seconds - seconds) / tokens, 2),
                "draft_ms_per_token": round(1000 * self.propose_seconds / tokens, 2),
                "rss_mib": round(resident_mib(), 1),
                # of which malloc's heaps hold in use / keep freed (None: not glibc): what
                # grows in the first is still referenced; in the second, fragmentation
                "malloc_in_use_mib": round(heaps[0], 1) if heaps else None,
                "malloc_free_mib": round(heaps[1], 1) if heaps else None,
                # the mechanism: tokens a step and where the accepted ones came from
                "tokens_per_step": round(tokens / self.steps, 3),
                "drafter_tokens_per_step": round((self.accepted - self.retrieved) / self.steps, 3),
                "retriever_tokens_per_step": round(self.retrieved / self.steps, 3),
                "passes_per_step": round(self.passes / self.steps, 3),
                # what the text has become (tokenswift.health): over the last 1,024 tokens
                **health_fields(step.health),
                **self.marks,
            }
        )
        self.mark = (step.generated, step.seconds)
        self.propose_seconds = 0.0
        self.steps = self.accepted = self.retrieved = self.passes = 0
        last = self.blocks[-1]
        self.bar.set_postfix({
            "ms/tok": last["ms_per_token"], "tok/step": last["tokens_per_step"], "distinct-4": last["distinct_4"],
            "NLL": last["recent_self_nll"], "RSS MiB": last["rss_mib"],
        })
        self.on_block(self.blocks)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = record["blocks"]
    x = [b["generated"] / 1000 for b in blocks]
    fig, (time_ax, mem_ax, text_ax) = plt.subplots(1, 3, figsize=(16, 4))
    time_ax.plot(x, [b["ms_per_token"] for b in blocks], marker=".", label="whole step")
    time_ax.plot(x, [b["draft_ms_per_token"] for b in blocks], marker=".", label="drafting stage")
    samples = record.get("ar", [])
    if samples:
        time_ax.plot([a["generated"] / 1000 for a in samples], [a["ms_per_token"] for a in samples], marker="o",
                     linestyle="--", label="ar at the run's contexts")
    time_ax.set(xlabel="generated tokens (K)", ylabel="ms per token", title=f"time per {record['block']}-token block")
    time_ax.set_ylim(bottom=0)
    time_ax.legend()
    mem_ax.plot(x, [b["rss_mib"] for b in blocks], marker=".", label="resident (VmRSS)")
    held = [b for b in blocks if b.get("malloc_in_use_mib") is not None]
    if held:
        mem_ax.plot([b["generated"] / 1000 for b in held], [b["malloc_in_use_mib"] for b in held], marker=".",
                    label="of it, malloc in use")
    mem_ax.axhline(record["bound_mib"], color="red", linestyle="--", label="bound: 1.2 x (runtime + weights + predicted)")
    mem_ax.set(xlabel="generated tokens (K)", ylabel="MiB", title="resident memory")
    mem_ax.set_ylim(bottom=0)
    mem_ax.legend()
    healthy = [b for b in blocks if b.get("distinct_4") is not None]
    hx = [b["generated"] / 1000 for b in healthy]
    text_ax.plot(hx, [b["distinct_4"] for b in healthy], marker=".", color="tab:green", label="distinct-4")
    text_ax.plot(hx, [b["tokens_per_step"] / 4 for b in healthy], marker=".", color="tab:purple",
                 label="tokens per step / 4")
    text_ax.set(xlabel="generated tokens (K)", ylabel="distinct-4 (last 1,024 tokens)", title="the text and the mechanism")
    text_ax.set_ylim(0, 1.05)
    nll_ax = text_ax.twinx()
    nll_ax.plot(hx, [b["recent_self_nll"] for b in healthy], marker=".", color="tab:red", label="model's own NLL")
    nll_ax.set_ylabel("NLL per token (nats)")
    nll_ax.set_ylim(bottom=0)
    handles = text_ax.get_legend_handles_labels(), nll_ax.get_legend_handles_labels()
    text_ax.legend(handles[0][0] + handles[1][0], handles[0][1] + handles[1][1], loc="lower left", fontsize=8)
    fig.suptitle(record["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(record: dict) -> str:
    blocks = record["blocks"]
    lines = [
        f"{record['title']}",
        "",
        f"runtime before loading: {record['runtime_mib']} MiB; weights: {record['weights_mib']} MiB; predicted "
        f"KV store + drafting view: {record['predicted_mib']} MiB, working set: {record['working_mib']} MiB; "
        f"bound {record['bound_mib']} MiB; peak resident {record['peak_rss_mib']} MiB",
        "",
    ]
    if blocks:
        seconds = sum(
            b["ms_per_token"] * (b["generated"] - (blocks[i - 1]["generated"] if i else 0)) / 1000 for i, b in enumerate(blocks)
        )
        lines += [
            f"{blocks[-1]['generated']} new tokens in {seconds:,.0f} s ({seconds / 3600:.2f} h), the blocks summed (a "
            "session's first block includes its prefill; the run's first, its compiles)",
            "",
        ]
    lines += [
        "| generated | ms/token | drafting ms/token | tokens/step | from drafter / retriever | passes/step "
        "| distinct-4 | NLL | resident MiB | machine, commit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {b['generated']} | {b['ms_per_token']} | {b['draft_ms_per_token']} | {b.get('tokens_per_step', '-')} | "
        f"{b.get('drafter_tokens_per_step', '-')} / {b.get('retriever_tokens_per_step', '-')} | "
        f"{b.get('passes_per_step', '-')} | {b.get('distinct_4', '-')} | {b.get('recent_self_nll', '-')} | "
        f"{b['rss_mib']} | {b.get('machine', '?')}, {b.get('commit', '?')} |"
        for b in blocks
    ]
    samples = record.get("ar", [])
    if samples:
        lines += [
            "",
            "`ar` sampled from the run's checkpoint (`--ar-at`): the run's context prefilled, "
            f"{samples[0]['tokens']} `ar` tokens timed; the run's block at that point beside it",
            "",
            "| generated | ar ms/token | run ms/token | speedup | same tokens as the run | machine, commit |",
            "|---|---|---|---|---|---|",
        ]
        for a in samples:
            run = run_ms_at(blocks, a["generated"])
            speedup = f"{a['ms_per_token'] / run:.3f}x" if run else "-"
            lines.append(
                f"| {a['generated']} | {a['ms_per_token']} | {run or '-'} | {speedup} | {a['same']}/{a['compared']} | "
                f"{a.get('machine', '?')}, {a.get('commit', '?')} |"
            )
        lines += [
            "",
            "same tokens: how many of `ar`'s tokens equal the run's before the first that differs. In float32 all "
            "do (tested); in bfloat16 a prefill and the run's tree forwards round differently from one-token "
            "steps, so the two part within a few tokens: `ar` is timed at the same context, over its own continuation.",
        ]
    return "\n".join(lines) + "\n"


def write_record(path: Path, record: dict) -> None:
    """``record`` as ``path``, whole or not at all (staged beside it, then renamed)."""
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(record, indent=1) + "\n")
    staging.replace(path)


def run_ms_at(blocks: list[dict], generated: int) -> float | None:
    """The run's ms/token over the block that starts at ``generated`` (or contains it)."""
    after = [b for b in blocks if b["generated"] > generated]
    return after[0]["ms_per_token"] if after else None


def ar_spec(run_spec: dict) -> dict:
    """Plain ``ar`` with the run's model, penalty and sampling."""
    spec = {"preset": "ar", "model": dict(run_spec["model"])}
    for section in ("penalty", "sampling"):
        if section in run_spec:
            spec[section] = run_spec[section]
    return spec


def sample_ar(out: Path, points: list[int], tokens: int, warmup: int = 4) -> int:
    """Time ``ar`` at ``points`` (generated tokens) of the run checkpointed in ``out``."""
    json_path = out / "long_run.json"
    try:
        run = Checkpoint.load(out / "long_run.ckpt")
        record = json.loads(json_path.read_text())
    except (TokenswiftError, FileNotFoundError, json.JSONDecodeError) as exc:
        raise SystemExit(f"long_run.py: error: --ar-at needs a run in {out}: {exc}") from None
    beyond = [p for p in points if not 0 <= p <= len(run.tokens)]
    if beyond:
        raise SystemExit(
            f"long_run.py: error: --ar-at {beyond}: the run in {out} has generated {len(run.tokens)} tokens; "
            f"points must be within 0..{len(run.tokens)}"
        )
    spec = ar_spec(run.spec)
    pipe = Pipeline.from_spec(spec)
    marks = session_marks(next(pipe.model.parameters()).device)
    samples = {a["generated"]: a for a in record.get("ar", [])}
    for point in tqdm(points, unit="context", file=sys.stderr, desc="ar samples"):
        # the run's max_new_tokens: the same KV capacity, hence the run's compiled forwards
        start = Checkpoint(
            spec=spec, prompt_tokens=run.prompt_tokens,
            tokens=run.tokens[:point], seed=run.seed, rng_state=run.rng_state, max_new_tokens=run.max_new_tokens,
            ignore_eos=run.ignore_eos,
        )
        generation = pipe.start(resume=start)
        generation.prefill()
        drawn, timed_from, started = [], None, None
        for step in generation.steps():
            drawn.extend(step.emitted)
            if len(drawn) == warmup:
                timed_from, started = len(drawn), time.perf_counter()
            if len(drawn) >= warmup + tokens:
                break
        seconds = time.perf_counter() - started
        reference = run.tokens[point : point + len(drawn)]
        same = next((i for i, (a, b) in enumerate(zip(drawn, reference)) if a != b), len(reference))
        samples[point] = {
            "generated": point,
            "tokens": len(drawn) - timed_from,
            "ms_per_token": round(1000 * seconds / (len(drawn) - timed_from), 2),
            "prefill_seconds": round(generation.prefill_seconds, 1),
            "same": same,
            "compared": len(reference),
            **marks,
        }
        logging.getLogger(__name__).info("ar at %d: %s", point, samples[point])
        record["ar"] = [samples[k] for k in sorted(samples)]
        write_record(json_path, record)
    plot(record, out / "long_run.png")
    (out / "long_run.md").write_text(markdown(record))
    print(markdown(record), end="")
    return 0


def points_option(value: str) -> list[int]:
    try:
        points = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected generated-token counts like 8000,32000") from None
    if not points:
        raise argparse.ArgumentTypeError("expected at least one generated-token count")
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--preset", default="tokenswift")
    parser.add_argument("--heads", help="heads for the tokenswift/medusa presets (default: shipped, or random for other models)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=100_000)
    parser.add_argument("--rope", default="yarn:16", help="RoPE-scaling override TYPE:FACTOR, or 'none'")
    parser.add_argument("--block", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="long-run-out")
    parser.add_argument("--resume", action="store_true", help="continue the run checkpointed in --out")
    parser.add_argument("--ar-at", type=points_option, metavar="N,N,...",
                        help="time plain ar at these generated-token counts of the run in --out (from its checkpoint)")
    parser.add_argument("--ar-tokens", type=int, default=64, help="ar tokens timed per --ar-at point")
    args = parser.parse_args(argv)
    if args.ar_at:
        if args.ar_tokens < 1:
            parser.error(f"--ar-tokens {args.ar_tokens}: must be >= 1")
        return sample_ar(Path(args.out), args.ar_at, args.ar_tokens)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out / "long_run.ckpt"
    resume = Checkpoint.load(checkpoint_path) if args.resume else None
    rope = rope_option(args.rope)
    spec = {"preset": args.preset, "model": {"path": args.model, "dtype": args.dtype, "rope": rope}}
    if args.heads:
        spec["drafter"] = {"heads": args.heads}
    runtime = resident_mib()
    pipe = Pipeline.from_spec(resume.spec if resume else spec)
    prompt = resume.prompt_tokens if resume else prompt_ids(pipe.tokenizer, args.prompt_tokens)
    new_tokens = resume.max_new_tokens if resume else args.new_tokens
    estimate = pipe.estimate_memory(len(prompt), new_tokens)
    weights = parameter_bytes(pipe.model) / MIB
    predicted = (estimate.kv_bytes + estimate.view_bytes + estimate.packed_bytes) / MIB
    working = estimate.working_bytes / MIB
    record = {
        "title": f"{args.preset} on {args.model} ({args.dtype}), {len(prompt)}-token prompt + {new_tokens} "
        f"new tokens, rope {args.rope}",
        "command": "python benchmarks/long_run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "block": args.block,
        "runtime_mib": round(runtime, 1),
        "loaded_mib": round(resident_mib(), 1),
        "weights_mib": round(weights, 1),
        "predicted_mib": round(predicted, 1),
        "working_mib": round(working, 1),
        "bound_mib": round(1.2 * (runtime + weights + predicted + working), 1),
        "blocks": [],
    }
    json_path = out / "long_run.json"
    if resume and json_path.is_file():
        record = json.loads(json_path.read_text())  # the interrupted run's settings and blocks go on

    def save(blocks):
        record["blocks"] = previous + blocks
        # a resumed run's peak is the highest of every session's
        record["peak_rss_mib"] = round(max(peak_rss_mib(), record.get("peak_rss_mib", 0.0)), 1)
        write_record(json_path, record)

    previous = list(record["blocks"])
    done = len(resume.tokens) if resume else 0
    with tqdm(total=new_tokens, initial=done, unit="tok", dynamic_ncols=True, file=sys.stderr) as bar:
        recorder = BlockRecorder(record["block"], bar, save, session_marks(next(pipe.model.parameters()).device))
        pipe.plugin_manager.register(recorder)
        started = time.perf_counter()
        result = pipe.generate(
            prompt, new_tokens, seed=args.seed, ignore_eos=True,
            checkpoint=checkpoint_path, checkpoint_every=args.block, resume=resume,
        )
    save(recorder.blocks)
    record["summary"] = {**result.stats.summary(), "wall_seconds": round(time.perf_counter() - started, 1)}
    save(recorder.blocks)
    plot(record, out / "long_run.png")
    (out / "long_run.md").write_text(markdown(record))
    print(markdown(record), end="")
    if result.stats.finish_reason == "interrupted":
        print(f"interrupted; continue with: python benchmarks/long_run.py --out {args.out} --resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before generation started: nothing to keep
        print("long_run.py: interrupted", file=sys.stderr)
        sys.exit(130)
