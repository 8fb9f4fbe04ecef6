"""The ``tokenswift`` command line. It owns the terminal: library code only logs.

Bad input gives one line on stderr and exit status 2, never a traceback. Under
``torchrun`` every rank runs the same command; rank 0 alone prints and writes files.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from tokenswift import distributed
from tokenswift.errors import PluginError, TokenswiftError

DEFAULT_MODEL = "smollm2"
DEFAULT_PRESET = "tokenswift"
EXIT_USAGE = 2


class CliError(Exception):
    """A user error the CLI reports in one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, as for every other bad input
        raise CliError(f"{message} (see {self.prog} --help)")


LONG_BENCH_TOKENS = 14_336
LONG_BENCH_ROPE = "yarn:2"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenswift", description="Lossless acceleration of ultra-long generation.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text with a preset or spec")
    which = gen.add_mutually_exclusive_group()
    which.add_argument("--preset", help=f"a preset name (default {DEFAULT_PRESET!r})")
    which.add_argument("--spec", help="a TOML spec file")
    gen.add_argument("--model", help=f"model directory, .gguf file or packaged model (default {DEFAULT_MODEL!r})")
    gen.add_argument("--heads", help="directory of trained draft heads (for the tokenswift and medusa drafters)")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], help="model dtype (default: bfloat16)")
    gen.add_argument("--device", help="model device: cpu, cuda or cuda:N (default: the spec's, else cpu)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="read the prompt from a file")
    gen.add_argument("--max-new-tokens", type=int, default=1024, help="new tokens to generate (default 1024)")
    gen.add_argument("--seed", type=int, help="random seed (default: random, printed in the summary)")
    gen.add_argument("--greedy", action="store_true", help="greedy decoding instead of the spec's sampling")
    gen.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep going past end-of-sequence tokens (default: on for the bundled prompt, off otherwise)",
    )
    gen.add_argument("--out", help="write the text to this file instead of the terminal")
    gen.add_argument("--stats-json", help="also write the statistics as JSON to this file")
    gen.add_argument(
        "--checkpoint-every", type=int, default=256, help="with --out: write FILE.ckpt every N new tokens (default 256)"
    )
    gen.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is --out FILE.ckpt")
    gen.add_argument("--quiet", action="store_true", help="no progress bar and no summary")

    train = sub.add_parser("train-heads", help="train draft heads for a model on a JSON Lines corpus")
    train.add_argument("--model", default=DEFAULT_MODEL, help=f"model to train heads for (default {DEFAULT_MODEL!r})")
    train.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="bfloat16")
    train.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    train.add_argument("--data", required=True, help="JSON Lines file, one object with a 'text' key per line")
    train.add_argument("--out", required=True, help="directory for the heads, checkpoints and training.json")
    train.add_argument("--steps", type=int, default=600)
    train.add_argument("--seq-len", type=int, default=512)
    train.add_argument("--batch", type=int, default=4)
    train.add_argument("--positions", type=int, default=128, help="positions per window the loss is taken on (0: all)")
    train.add_argument("--lr", type=float, default=5e-3)
    train.add_argument("--warmup", type=int, default=30)
    train.add_argument("--num-heads", type=int, default=3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--checkpoint-every", type=int, default=50)
    train.add_argument("--holdout", default="wuthering_heights", help="comma-separated book ids kept for evaluation")
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")

    fit = sub.add_parser(
        "fit-tree",
        help="fit the tokenswift drafter's tree to how its drafts are accepted; writes tree.json beside the heads",
    )
    fit.add_argument("--model", default=DEFAULT_MODEL)
    fit.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="bfloat16")
    fit.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    fit.add_argument("--heads", default="auto", help="heads directory (default: the heads shipped for the model)")
    fit.add_argument("--nodes", type=int, default=40, help="tree nodes below the root (default 40, as [1,3,3,3])")
    fit.add_argument("--prompt-file", help="text to continue, UTF-8 (default: the bundled public-domain prompt)")
    fit.add_argument("--prompt-tokens", type=int, default=2048, help="prompt tokens used, from its start (default 2048)")
    fit.add_argument("--new-tokens", type=int, default=2000, help="new tokens replayed per seed (default 2000)")
    fit.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one generation per seed (default 1 2 3)")
    fit.add_argument("--out", help="directory to write tree.json to (default: the heads directory)")

    bench = sub.add_parser("bench", help="benchmark transformers generate against the presets, side by side")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="bfloat16")
    bench.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    bench.add_argument("--heads", default="auto", help="heads for the tokenswift and medusa presets")
    bench.add_argument("--prompt-tokens", type=int, default=2048)
    bench.add_argument("--new-tokens", type=int, default=6144)
    length = bench.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="1,024 new tokens, for iteration")
    length.add_argument(
        "--long", action="store_true",
        help=f"{LONG_BENCH_TOKENS:,} new tokens (16K positions with the prompt, twice the demo model's "
        f"trained context) with RoPE scaling {LONG_BENCH_ROPE} unless --rope says otherwise",
    )
    bench.add_argument("--rope", help="RoPE-scaling override TYPE:FACTOR (e.g. yarn:2), for runs past the trained context")
    bench.add_argument("--greedy", action="store_true", help="greedy decoding (reports identity with ar)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--methods", help="comma-separated subset of: " + ", ".join(("hf-generate", "hf-prompt-lookup", "ar", "tokenswift", "medusa", "prompt-lookup")))
    bench.add_argument("--out", default="bench-out", help="directory for bench.json, bench.md and bench.png")

    ablate = sub.add_parser("ablate", help="sweep a grid of component choices and parameters")
    ablate.add_argument("--grid", required=True, help="grid TOML (base spec, axes or cells, prompt, seeds, lengths)")
    ablate.add_argument("--out", help="directory for ablation.csv/.md and plots (default: ablation-<grid name>)")
    ablate.add_argument("--new-tokens", type=int, help="override the grid's new_tokens (shorter runs)")

    sub.add_parser("components", help="list registered components and presets")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _configure_logging(args)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "components":
            return cmd_components()
        if args.command == "ablate":
            return cmd_ablate(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "train-heads":
            return cmd_train_heads(args, argv)
        if args.command == "fit-tree":
            return cmd_fit_tree(args, argv)
    except (CliError, TokenswiftError, ValueError, TypeError, OSError) as exc:
        if distributed.is_primary():  # the ranks of a torchrun all fail alike
            print(f"tokenswift: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if distributed.is_primary():
            print("tokenswift: interrupted", file=sys.stderr)
        return 130
    return 0


def _configure_logging(args) -> None:
    from transformers.utils import logging as hf_logging

    level = logging.INFO if args.verbose else logging.WARNING
    if not distributed.is_primary():
        level = logging.ERROR  # the other ranks of a torchrun would repeat rank 0's notices
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        hf_logging.set_verbosity_error()  # transformers' own notices are not the user's business
        hf_logging.disable_progress_bar()  # loading takes under a second from the converted copy


def _read_prompt_file(name: str) -> str:
    path = Path(name)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"prompt file not found: {path}") from None
    except UnicodeDecodeError:
        raise CliError(f"prompt file is not UTF-8 text: {path}") from None


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        return _read_prompt_file(args.prompt_file)
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
        model = {"path": args.model or DEFAULT_MODEL, "dtype": model.get("dtype", "bfloat16")}
    if args.dtype:
        model["dtype"] = args.dtype
    if args.device:
        model["device"] = args.device
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


def cmd_generate(args) -> int:
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


def cmd_train_heads(args, argv) -> int:
    import shlex

    from tqdm import tqdm

    from tokenswift.drafters.training import TrainConfig, read_corpus, train_heads
    from tokenswift.model.loading import load_model
    from tokenswift.spec import ModelSpec

    try:
        config = TrainConfig(
            steps=args.steps,
            seq_len=args.seq_len,
            batch=args.batch,
            positions=args.positions,
            lr=args.lr,
            warmup=args.warmup,
            num_heads=args.num_heads,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
            holdout=tuple(name.strip() for name in args.holdout.split(",") if name.strip()),
        )
    except ValueError as exc:
        raise CliError(f"train-heads: {exc}") from None
    model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device))
    if tokenizer is None:
        raise CliError(f"train-heads needs a tokenizer, and none was found with {args.model}")
    corpus = read_corpus(args.data, tokenizer, config.holdout)
    print(
        f"training {config.num_heads} heads on {len(corpus.train):,} tokens ({len(corpus.train_ids)} books); "
        f"held out: {', '.join(corpus.held_out_ids)} ({len(corpus.held_out):,} tokens)",
        file=sys.stderr,
    )
    bar = tqdm(total=config.steps, unit="step", file=sys.stderr, dynamic_ncols=True)

    def progress(step, metrics):
        bar.n = step
        bar.set_postfix({"loss": f"{sum(metrics['loss']) / len(metrics['loss']):.3f}",
                         "acc": "/".join(f"{a:.2f}" for a in metrics["acc"])})

    if args.resume:
        from tokenswift.drafters.training import CHECKPOINT

        if not (Path(args.out) / CHECKPOINT).is_file():
            raise CliError(f"--resume: no checkpoint in {args.out}")
    def progress_and_close(step, metrics):
        progress(step, metrics)
        if step == config.steps:
            bar.close()
            print("evaluating on the held-out text...", file=sys.stderr)

    record = train_heads(model, corpus, args.out, config, resume=args.resume, progress=progress_and_close)
    record["command"] = "tokenswift " + shlex.join(argv if argv is not None else sys.argv[1:])
    record["model"] = args.model
    record["dtype"] = args.dtype
    record["device"] = _device_name(model)
    record["data"] = str(args.data)
    Path(args.out, "training.json").write_text(json.dumps(record, indent=2) + "\n")
    acc = record["held_out_accuracy"]
    print(f"held-out accuracy: top-1 {acc['top1']}, top-3 {acc['top3']} (LM head top-1 {acc['lm_head_top1']}); "
          f"{record['wall_seconds']:.0f} s", file=sys.stderr)
    return 0


def cmd_fit_tree(args, argv) -> int:
    import shlex
    import time

    from tqdm import tqdm

    from tokenswift.drafters.heads import DraftHeads, find_shipped_heads
    from tokenswift.drafters.tree_fit import fit_for_heads, save_tree
    from tokenswift.model.loading import check_device, load_model
    from tokenswift.prompts import prompt_ids
    from tokenswift.spec import ModelSpec

    for name in ("nodes", "prompt_tokens", "new_tokens"):
        if getattr(args, name) <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.heads != "auto" and not Path(args.heads).is_dir():
        raise CliError(f"--heads {args.heads!r} is not a directory of saved heads")
    if args.out is not None and not Path(args.out).is_dir():
        raise CliError(f"--out {args.out!r} is not a directory")
    text = _read_prompt_file(args.prompt_file) if args.prompt_file is not None else None
    if text is not None and not text.strip():
        raise CliError(f"the prompt file {args.prompt_file} is empty")
    ModelSpec(path=args.model, dtype=args.dtype, device=args.device)  # bad values fail here, before loading
    check_device(args.device)
    started = time.perf_counter()
    model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device))
    if tokenizer is None:
        raise CliError(f"fit-tree needs a tokenizer for its prompt, and none was found with {args.model}")
    heads_dir = Path(args.heads) if args.heads != "auto" else find_shipped_heads(model)
    if heads_dir is None:
        raise CliError(f"no heads are shipped for {args.model}; pass --heads DIR (train some with train-heads)")
    heads = DraftHeads.from_pretrained(heads_dir, model).eval()
    if text is None:
        prompt = prompt_ids(tokenizer, args.prompt_tokens)
    else:
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"][: args.prompt_tokens]
    bar = tqdm(total=args.new_tokens * len(args.seeds), unit="tok", file=sys.stderr, dynamic_ncols=True)
    paths, record = fit_for_heads(
        model, tokenizer, heads, nodes=args.nodes, prompt=prompt, new_tokens=args.new_tokens, seeds=args.seeds,
        progress=bar.update,
    )
    bar.close()
    record.update(
        command="tokenswift " + shlex.join(argv if argv is not None else sys.argv[1:]),
        prompt=args.prompt_file or "bundled (the opening of Wuthering Heights)",
        model=args.model,
        dtype=args.dtype,
        device=_device_name(model),
        wall_seconds=round(time.perf_counter() - started, 1),
    )
    written = save_tree(args.out or heads_dir, "tokenswift", paths, record)
    replayed = record["replayed_tokens_per_step"]
    print(
        f"fitted a {args.nodes}-node tree: replayed tokens/step {replayed['fitted']} "
        f"(default {record['default_tree']}: {replayed['default']}; {replayed['note']}); wrote {written}",
        file=sys.stderr,
    )
    return 0


def _device_name(model) -> str:
    """'cpu', or 'cuda:0 (NVIDIA H200)': where a model runs, for records."""
    import torch

    device = next(model.parameters()).device
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from tokenswift.bench import HF_METHODS, PRESET_METHODS, BenchConfig, markdown_table, run_bench, write_reports
    from tokenswift.model.loading import check_device
    from tokenswift.spec import ModelSpec, parse_rope

    methods = HF_METHODS + PRESET_METHODS
    if args.methods:
        methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
        unknown = [m for m in methods if m not in HF_METHODS + PRESET_METHODS]
        if unknown:
            raise CliError(f"unknown method(s) {unknown}; valid: {list(HF_METHODS + PRESET_METHODS)}")
    new_tokens = 1024 if args.quick else LONG_BENCH_TOKENS if args.long else args.new_tokens
    rope = parse_rope(args.rope if args.rope or not args.long else LONG_BENCH_ROPE)
    if new_tokens <= 0 or args.prompt_tokens <= 0:
        raise CliError("--new-tokens and --prompt-tokens must be positive")
    ModelSpec(path=args.model, dtype=args.dtype, device=args.device, rope=rope)  # bad values fail here, before any output
    check_device(args.device)
    config = BenchConfig(
        model=args.model, dtype=args.dtype, device=args.device, rope=rope, heads=args.heads, prompt_tokens=args.prompt_tokens,
        new_tokens=new_tokens, greedy=args.greedy, seed=args.seed, methods=methods,
    )
    bars = []  # made at the first token, so that a model that fails to load leaves one error line

    def progress(method, count):
        if not bars:
            bars.append(tqdm(total=new_tokens * len(methods), unit="tok", file=sys.stderr, dynamic_ncols=True))
        bars[0].set_description(method, refresh=False)
        bars[0].update(count)

    # Reports are rewritten after every method: an interrupted long run keeps what it measured.
    results, info = run_bench(config, progress, on_method=lambda partial, info: write_reports(partial, info, args.out))
    for bar in bars:
        bar.close()
    paths = write_reports(results, info, args.out)
    print(markdown_table(results), end="")
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def cmd_ablate(args) -> int:
    from tqdm import tqdm

    from tokenswift.ablate import Grid, run_ablation, write_reports

    grid = Grid.load(args.grid)
    if args.new_tokens is not None:
        if args.new_tokens <= 0:
            raise CliError(f"--new-tokens must be a positive integer, got {args.new_tokens}")
        import attrs

        grid = attrs.evolve(grid, new_tokens=args.new_tokens)
    out = args.out or f"ablation-{Path(args.grid).stem}"
    bar = tqdm(total=2 * len(grid.cells) * len(grid.seeds), unit="run", file=sys.stderr, dynamic_ncols=True)

    def progress(label):
        bar.set_description(label[:60], refresh=False)
        bar.update(1)

    rows = run_ablation(grid, out, progress=progress)
    bar.close()
    paths = write_reports(rows, out)
    print(paths["markdown"].read_text(), end="")
    print(f"wrote {out}/ablation.csv and {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def cmd_components() -> int:
    from tokenswift.registry import build_registry, get_plugin_manager

    try:
        registry = build_registry(get_plugin_manager())
    except PluginError as exc:
        raise CliError(str(exc)) from None
    current = None
    for info in registry.components():
        if info.kind != current:
            current = info.kind
            print(f"{current}:")
        options = ", ".join(f"{k}={v!r}" for k, v in info.option_defaults().items()) or "no options"
        print(f"  {info.name:<16} [{info.origin}] {info.summary}")
        print(f"  {'':<16} options: {options}")
    print("presets:")
    for name in sorted(registry.presets):
        print(f"  {name:<16} [{registry.preset_origins[name]}]")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
