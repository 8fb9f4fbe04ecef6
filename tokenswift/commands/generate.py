"""``tokenswift generate``: one generation, streamed to the terminal or a file, with a
progress bar, checkpoints beside ``--out`` and ``--resume``."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import signal
import sys
from pathlib import Path

from tokenswift import distributed
from tokenswift.health import LOOP_THRESHOLD
from tokenswift.commands import (
    DEFAULT_MODEL,
    DEFAULT_PRESET,
    DTYPE_CHOICES,
    CliError,
    check_writable,
    read_prompt_file,
    spec_and_overrides,
)
from tokenswift.validation import check_seed

NAME = "generate"
HELP = "generate text with a preset or spec"
EPILOG = (
    "Same seed, same tokens: in float32 and float64 a speculative preset emits, for a given seed, exactly the "
    "tokens --preset ar emits, and --resume continues exactly as the uninterrupted run would have; in float32 "
    "up to a rounding tie (the top two scores of a position within ~1e-6, which a tree forward and a one-token "
    "forward may round apart: none in 5,632 greedy tokens of the demo model measured on a Zen 4, one in 512 "
    "with fixed trees on an AMX machine), in float64 without exception. In bfloat16 "
    "(what --dtype auto picks on GPUs, on CPUs with AMX-BF16 or AVX512-BF16, and on other CPUs where a one-row "
    "product measures faster in it) a batched forward rounds differently from a one-token forward, so a "
    "speculative run and ar agree in distribution, not token for token. Since the trees a run verifies follow "
    "measured timings, two bfloat16 runs with the same seed and preset may differ too, and a resumed run, which "
    "rebuilds its cache in batched forwards and chooses its own trees, may part from the uninterrupted one "
    "shortly after its checkpoint. Pass --dtype float32 for token-identical runs (float64 where not even a "
    "rounding tie may part them)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--preset", help=f"a preset name (default {DEFAULT_PRESET!r})")
    which.add_argument("--spec", help="a TOML spec file")
    parser.add_argument("--model", help=f"model directory, .gguf file or packaged model (default {DEFAULT_MODEL!r})")
    parser.add_argument("--heads", help="directory of trained draft heads (for the tokenswift and medusa drafters)")
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES,
        help="model dtype (default: auto, the fastest for this machine); float32 or float64 for runs "
        "token-identical to ar's and, resumed, to the uninterrupted run's (see below)",
    )
    parser.add_argument(
        "--compile", choices=("auto", "true", "false"),
        help="compiled one-token forwards (default auto: where measured faster and the run repays compiling)",
    )
    parser.add_argument("--device", help="model device: cpu, cuda or cuda:N (default: the spec's, else cpu)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="read the prompt from a file")
    prompt.add_argument(
        "--chat", metavar="TEXT",
        help="an instruction: the model replies as the assistant, through its tokenizer's chat template, "
        "and stops at the template's end-of-turn token",
    )
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system prompt before the instruction")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="new tokens to generate (default 1024)")
    parser.add_argument(
        "--seed", type=int,
        help="random seed, an integer from 0 to 2**64-1 (default: random, printed in the summary); in "
        "float32/float64 a speculative preset "
        "then emits the tokens ar emits with that seed, in bfloat16 tokens from the same distribution (see below)",
    )
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of the spec's sampling")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep going past end-of-sequence tokens (default: on for the bundled prompt, off otherwise)",
    )
    parser.add_argument("--out", help="write the text to this file instead of the terminal")
    parser.add_argument("--stats-json", help="also write the statistics as JSON to this file")
    parser.add_argument(
        "--checkpoint-every", type=int, default=256, help="with --out: write FILE.ckpt every N new tokens (default 256)"
    )
    parser.add_argument(
        "--resume", action="store_true",
        help="continue the run whose checkpoint is --out FILE.ckpt, in the checkpoint's dtype: exactly as "
        "uninterrupted in float32/float64, from the same distribution in bfloat16",
    )
    parser.add_argument(
        "--loop-threshold", type=float, default=LOOP_THRESHOLD, metavar="X",
        help="warn when distinct-4 over the last 1,024 tokens falls below X, a loop (default "
        f"{LOOP_THRESHOLD}; 0: never). The summary and the progress bar show distinct-n and the model's own "
        "NLL of what it wrote either way",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)
    from tokenswift.prompts import demo_prompt

    return demo_prompt()


BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


class _Progress:
    """A pluggy observer drawing a live progress line with tqdm, from the first step on
    (so that a run refused before it starts prints nothing but its error)."""

    def __init__(self, total: int, enabled: bool, initial: int = 0) -> None:
        self.total, self.enabled, self.initial = total, enabled, initial
        self.bar = None

    def __call__(self, step) -> None:
        if self.bar is None:
            from tqdm import tqdm

            # tqdm's own rate (a smoothed recent rate) is left out: one tokens/s figure,
            # the run's, as in the summary; the ETA is tqdm's from its elapsed time.
            self.bar = tqdm(
                total=self.total, initial=self.initial, unit="tok", disable=not self.enabled,
                dynamic_ncols=True, leave=True, file=sys.stderr, bar_format=BAR_FORMAT,
            )
        self.bar.update(len(step.emitted))
        postfix = f"{step.generated / max(step.seconds, 1e-9):.1f} tok/s, {step.generated / step.step:.2f} tok/step"
        self.bar.set_postfix_str(postfix + health_postfix(step.health), refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def health_postfix(health) -> str:
    """What the text has become, for the progress line: distinct-4 over the last 1,024
    tokens and the model's own NLL of them (tokenswift.health)."""
    if health is None:
        return ""
    parts = []
    if not math.isnan(health.distinct_4):
        parts.append(f"distinct-4 {health.distinct_4:.2f}")
    if not math.isnan(health.recent_self_nll):
        parts.append(f"NLL {health.recent_self_nll:.2f}")
    return "".join(f", {part}" for part in parts)


def checkpoint_path(out: str) -> Path:
    return Path(f"{out}.ckpt")


def _check_paths(args) -> None:
    """The files a run will write (--out, its checkpoint, --stats-json) can be written:
    checked before the model loads, none of them opened."""
    if args.out:
        check_writable(args.out, "--out")
        check_writable(checkpoint_path(args.out), "--out's checkpoint")
    if args.stats_json:
        check_writable(args.stats_json, "--stats-json")


@contextlib.contextmanager
def frozen_heap():
    """The objects alive before the run (the model's modules, transformers' and torch's
    ~500K) left out of the cyclic garbage collector's scans while it runs, and given back
    after it. Its collections took 0.29 s of a 1,000-token run (~1.7%, every preset alike),
    0.05 s with them frozen (SmolLM2, a 2-core AMD EPYC Zen 4)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run(args, argv: list[str] | None = None) -> int:
    from tokenswift import Pipeline, hookimpl
    from tokenswift.checkpoint import Checkpoint
    from tokenswift.detok import IncrementalDecoder

    if not 0 <= args.loop_threshold <= 1:
        raise CliError(f"--loop-threshold must be a number in [0, 1] (0: never warn), got {args.loop_threshold}")
    # Every input is checked before a model loads and before any file is opened for
    # writing: a refused run leaves every file as it was.
    _check_paths(args)
    if args.checkpoint_every <= 0:
        raise CliError(f"--checkpoint-every must be a positive integer, got {args.checkpoint_every}")
    if args.seed is not None:
        check_seed(args.seed, "--seed")
    resume = None
    if args.resume:
        if not args.out:
            raise CliError("--resume needs --out FILE (the checkpoint is FILE.ckpt)")
        resume = Checkpoint.load(checkpoint_path(args.out))
        pipe = Pipeline.from_spec(resume.spec)
        try:
            pipe.check_resume(resume)  # its tokens are this model's, the run fits: before --out is rewritten
        except ValueError as exc:
            raise CliError(f"cannot resume {checkpoint_path(args.out)}: {exc}") from None
        prompt, max_new_tokens = None, resume.max_new_tokens
    else:
        if args.max_new_tokens <= 0:
            raise CliError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
        if args.chat is not None:
            if not args.chat.strip():
                raise CliError("--chat: the instruction is empty")
        elif args.system is not None:
            raise CliError("--system goes with --chat (a system prompt for a chat instruction)")
        else:
            prompt = _read_prompt(args)
            if not prompt.strip():
                raise CliError("the prompt is empty")
        spec, overrides = spec_and_overrides(args)
        pipe = Pipeline.from_spec(spec, overrides=overrides)
        if args.chat is not None:  # the template is the model's: known once it is loaded
            from tokenswift.prompts import chat_messages

            prompt = pipe.chat_prompt(chat_messages(args.chat, args.system))
        max_new_tokens = args.max_new_tokens
        prompt = pipe.check(prompt, max_new_tokens, name="--max-new-tokens")  # refuse a bad run before any file is opened

    # The live bar shares the terminal with streamed text only when the text goes elsewhere.
    text_on_terminal = args.out is None and sys.stdout.isatty()
    primary = distributed.is_primary()  # under torchrun, rank 0 alone writes
    progress = _Progress(
        max_new_tokens,
        enabled=primary and not args.quiet and not text_on_terminal,
        initial=len(resume.tokens) if resume else 0,
    )
    bundled = args.prompt is None and args.prompt_file is None and args.chat is None
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else bundled

    class ProgressPlugin:
        @hookimpl
        def tokenswift_step_end(self, pipeline, step):
            progress(step)

    plugin = ProgressPlugin()
    pipe.plugin_manager.register(plugin)
    out_file = None
    # SIGTERM as Ctrl-C: a clean stop after the current step (tokenswift.pipeline.deferred_interrupts)
    previous_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.out and primary:
            # Written as it is generated (flushed every step); a checkpoint beside it
            # lets --resume continue after a crash, kill or Ctrl-C.
            out_file = open(args.out, "w", encoding="utf-8")
            if resume is not None and pipe.tokenizer is not None:
                out_file.write(IncrementalDecoder(pipe.tokenizer).prime(resume.tokens))
                out_file.flush()

        def stream(chunk):
            if chunk.text:
                target = out_file or sys.stdout
                target.write(chunk.text)
                target.flush()

        with frozen_heap():
            result = pipe.generate(
                prompt,
                max_new_tokens,
                seed=args.seed,
                ignore_eos=ignore_eos,
                stream=stream,
                checkpoint=checkpoint_path(args.out) if args.out else None,
                checkpoint_every=args.checkpoint_every,
                resume=resume,
                loop_threshold=args.loop_threshold,
            )
        if out_file is None and primary:
            sys.stdout.write("\n")
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        progress.close()
        pipe.plugin_manager.unregister(plugin)
        if out_file is not None:
            out_file.close()

    if not primary:
        return {"interrupted": 130, "non-finite scores": 1}.get(result.stats.finish_reason, 0)
    summary = {"preset": pipe.spec.preset, "seed": result.seed, **result.stats.summary()}
    if args.stats_json:  # with where the steps' time went (GenerationStats.stage_profile)
        details = {**summary, "stages": result.stats.stage_profile()}
        Path(args.stats_json).write_text(json.dumps(details, indent=2) + "\n")
    if not args.quiet:
        print(" ".join(f"{k}={v}" for k, v in summary.items()), file=sys.stderr)
    reason = result.stats.finish_reason
    if reason == "interrupted":
        where = f"; continue with: tokenswift generate --resume --out {args.out}" if args.out else ""
        print(f"tokenswift: interrupted after {len(result.tokens)} new tokens{where}", file=sys.stderr)
        return 130
    if reason == "non-finite scores":
        print(
            f"tokenswift: error: the model produced NaN/inf scores after {len(result.tokens)} tokens; "
            "the text so far was kept" + (f" in {args.out}" if args.out else ""),
            file=sys.stderr,
        )
        return 1
    return 0
