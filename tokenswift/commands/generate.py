"""``tokenswift generate``: one generation, streamed to the terminal or a file, with a
progress bar, checkpoints beside ``--out`` and ``--resume``."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from tokenswift import distributed
from tokenswift.commands import DEFAULT_MODEL, DEFAULT_PRESET, CliError, read_prompt_file


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)
    from tokenswift.prompts import demo_prompt

    return demo_prompt()


def _spec_and_overrides(args):
    from tokenswift.spec import load_toml

    if args.spec:
        spec = load_toml(args.spec)
    else:
        spec = {"preset": args.preset or DEFAULT_PRESET}
    model = dict(spec.get("model") or {})
    if args.model or not model:
        model = {"path": args.model or DEFAULT_MODEL, "dtype": model.get("dtype", "auto")}
    if args.dtype:
        model["dtype"] = args.dtype
    if args.device:
        model["device"] = args.device
    if args.compile:
        model["compile"] = args.compile
    overrides: dict = {"model": model}
    if args.greedy:
        overrides["sampling"] = {"greedy": True}
    if args.heads:
        overrides["drafter"] = {"heads": args.heads}
    return spec, overrides


class _Progress:
    """A pluggy observer drawing a live progress line with tqdm, from the first step on
    (so that a run refused before it starts prints nothing but its error)."""

    def __init__(self, total: int, enabled: bool, initial: int = 0) -> None:
        self.total, self.enabled, self.initial = total, enabled, initial
        self.bar = None

    def __call__(self, step) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total, initial=self.initial, unit="tok", disable=not self.enabled,
                dynamic_ncols=True, leave=True, file=sys.stderr,
            )
        self.bar.update(len(step.emitted))
        self.bar.set_postfix(
            {"tok/s": f"{step.generated / max(step.seconds, 1e-9):.1f}", "tok/step": f"{step.generated / step.step:.2f}"},
            refresh=False,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def checkpoint_path(out: str) -> Path:
    return Path(f"{out}.ckpt")


def run(args) -> int:
    from tokenswift import Pipeline, hookimpl
    from tokenswift.checkpoint import Checkpoint
    from tokenswift.detok import IncrementalDecoder

    resume = None
    if args.resume:
        if not args.out:
            raise CliError("--resume needs --out FILE (the checkpoint is FILE.ckpt)")
        resume = Checkpoint.load(checkpoint_path(args.out))
        pipe = Pipeline.from_spec(resume.spec)
        prompt, max_new_tokens = None, resume.max_new_tokens
    else:
        if args.max_new_tokens <= 0:
            raise CliError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
        if args.checkpoint_every <= 0:
            raise CliError(f"--checkpoint-every must be a positive integer, got {args.checkpoint_every}")
        prompt = _read_prompt(args)
        if not prompt.strip():
            raise CliError("the prompt is empty")
        spec, overrides = _spec_and_overrides(args)
        pipe = Pipeline.from_spec(spec, overrides=overrides)
        max_new_tokens = args.max_new_tokens
        prompt = pipe.check(prompt, max_new_tokens)  # refuse a bad run before any file is opened

    # The live bar shares the terminal with streamed text only when the text goes elsewhere.
    text_on_terminal = args.out is None and sys.stdout.isatty()
    primary = distributed.is_primary()  # under torchrun, rank 0 alone writes
    progress = _Progress(
        max_new_tokens,
        enabled=primary and not args.quiet and not text_on_terminal,
        initial=len(resume.tokens) if resume else 0,
    )
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else (args.prompt is None and args.prompt_file is None)

    class ProgressPlugin:
        @hookimpl
        def tokenswift_step_end(self, pipeline, step):
            progress(step)

    plugin = ProgressPlugin()
    pipe.plugin_manager.register(plugin)
    out_file = None
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
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

        result = pipe.generate(
            prompt,
            max_new_tokens,
            seed=args.seed,
            ignore_eos=ignore_eos,
            stream=stream,
            checkpoint=checkpoint_path(args.out) if args.out else None,
            checkpoint_every=args.checkpoint_every,
            resume=resume,
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
    if args.stats_json:
        Path(args.stats_json).write_text(json.dumps(summary, indent=2) + "\n")
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


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
