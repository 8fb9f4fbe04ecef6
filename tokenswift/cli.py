"""The ``tokenswift`` command line: argument parsing and dispatch. What each command
does lives in :mod:`tokenswift.commands`.

Bad input gives one line on stderr and exit status 2, never a traceback. Under
``torchrun`` every rank runs the same command; rank 0 alone prints and writes files.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tokenswift import distributed
from tokenswift.commands import DEFAULT_MODEL, DEFAULT_PRESET, CliError
from tokenswift.commands.bench import LONG_BENCH_ROPE, LONG_BENCH_TOKENS
from tokenswift.errors import TokenswiftError

EXIT_USAGE = 2
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float64"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, as for every other bad input
        raise CliError(f"{message} (see {self.prog} --help)")


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
    gen.add_argument("--dtype", choices=DTYPE_CHOICES, help="model dtype (default: auto, the fastest for this machine)")
    gen.add_argument(
        "--compile", choices=("auto", "true", "false"),
        help="compiled one-token forwards (default auto: where measured faster and the run repays compiling)",
    )
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
    train.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16")
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

    drafter = sub.add_parser(
        "train-drafter", help="train the eagle drafter's network (one layer over the model's features) on a JSON Lines corpus"
    )
    drafter.add_argument("--model", default=DEFAULT_MODEL, help=f"the target model (default {DEFAULT_MODEL!r})")
    drafter.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="the target's dtype for its features")
    drafter.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    drafter.add_argument("--data", required=True, help="JSON Lines file, one object with a 'text' key per line")
    drafter.add_argument("--out", required=True, help="directory for the network, checkpoints and training.json")
    drafter.add_argument("--features", help="folder for the cached target features (default OUT/features)")
    drafter.add_argument("--windows", type=int, default=512, help="training windows whose features are cached (default 512)")
    drafter.add_argument("--seq-len", type=int, default=512)
    drafter.add_argument("--steps", type=int, default=300)
    drafter.add_argument("--batch", type=int, default=8)
    drafter.add_argument("--depth", type=int, default=2, help="draft levels unrolled in training (default 2)")
    drafter.add_argument("--draft-vocab", type=int, default=8192, help="LM-head rows the draft ranks (default 8192)")
    drafter.add_argument("--penalty", type=float, default=1.2,
                         help="train on distributions after this contextual penalty, as the presets sample (1.0: raw)")
    drafter.add_argument("--lr", type=float, default=1e-3)
    drafter.add_argument("--warmup", type=int, default=20)
    drafter.add_argument("--seed", type=int, default=0)
    drafter.add_argument("--checkpoint-every", type=int, default=25)
    drafter.add_argument("--holdout", default="wuthering_heights", help="comma-separated book ids kept for evaluation")
    drafter.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")

    fit = sub.add_parser(
        "fit-tree",
        help="fit the tokenswift drafter's tree to how its drafts are accepted; writes tree.json beside the heads",
    )
    fit.add_argument("--model", default=DEFAULT_MODEL)
    fit.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16")
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
    bench.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    bench.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    bench.add_argument("--heads", default="auto", help="heads for the tokenswift and medusa presets")
    bench.add_argument("--prompt-tokens", type=int, default=2048)
    bench.add_argument("--new-tokens", type=int, help="new tokens per method (default 6144; 256 with --contexts)")
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
    bench.add_argument(
        "--interleaved", action="store_true",
        help="presets decode in turns of 8 tokens on one model: speed ratios to ar that a noisy machine cannot fake, "
        "with each preset's tree decisions (writes interleaved.json/.md)",
    )
    bench.add_argument("--seeds", type=int, nargs="+", help="with --interleaved or --contexts: one comparison per seed, summed")
    bench.add_argument(
        "--compile", choices=("off", "on", "both", "all"), default="off",
        help="with --interleaved: presets eager (off), compiled (on), both side by side (PRESET+compiled), or all "
        "three with compile = auto (PRESET+auto); the compile time is reported",
    )
    bench.add_argument(
        "--contexts", type=int, nargs="+", metavar="TOKENS",
        help="long-context sweep: for each prompt length, one prefill shared by the presets (default ar,tokenswift), "
        "which decode in turns; ratios to ar, tokens/step and a memory roofline per context; RoPE scaled "
        "automatically past the trained length (writes contexts.json/.md/.png)",
    )
    bench.add_argument("--decodings", nargs="+", choices=("sampling", "greedy"), default=["sampling", "greedy"],
                       help="with --contexts: the paper's sampling, greedy, or both (default both)")

    ablate = sub.add_parser("ablate", help="sweep a grid of component choices and parameters")
    ablate.add_argument("--grid", required=True, help="grid TOML (base spec, axes or cells, prompt, seeds, lengths)")
    ablate.add_argument("--out", help="directory for ablation.csv/.md and plots (default: ablation-<grid name>)")
    ablate.add_argument("--new-tokens", type=int, help="override the grid's new_tokens (shorter runs)")

    cal = sub.add_parser("calibrate", help="measure what forwards cost on this machine (cached; used to choose trees)")
    cal.add_argument("--model", default=DEFAULT_MODEL, help=f"model to calibrate for (default {DEFAULT_MODEL!r})")
    cal.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    cal.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    cal.add_argument("--show", action="store_true", help="show the cached calibration instead of measuring again")
    cal.add_argument("--compile", action="store_true", help="also compare compiled and eager one-token steps (compiles the model)")

    sub.add_parser("components", help="list registered components and presets")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _configure_logging(args)
        return _dispatch(args, argv)
    except (CliError, TokenswiftError, ValueError, TypeError, OSError) as exc:
        if distributed.is_primary():  # the ranks of a torchrun all fail alike
            print(f"tokenswift: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if distributed.is_primary():
            print("tokenswift: interrupted", file=sys.stderr)
        return 130
    return 0


def _dispatch(args, argv) -> int:
    if args.command == "generate":
        from tokenswift.commands import generate

        return generate.run(args)
    if args.command == "calibrate":
        from tokenswift.commands import calibrate

        return calibrate.run(args)
    if args.command == "components":
        from tokenswift.commands import components

        return components.run()
    if args.command == "ablate":
        from tokenswift.commands import ablate

        return ablate.run(args)
    if args.command == "bench":
        from tokenswift.commands import bench

        return bench.run(args)
    if args.command == "train-heads":
        from tokenswift.commands import train_heads

        return train_heads.run(args, argv)
    if args.command == "train-drafter":
        from tokenswift.commands import train_drafter

        return train_drafter.run(args, argv)
    if args.command == "fit-tree":
        from tokenswift.commands import fit_tree

        return fit_tree.run(args, argv)
    raise CliError(f"unknown command {args.command!r}")


def _configure_logging(args) -> None:
    from transformers.utils import logging as hf_logging

    level = logging.INFO if args.verbose else logging.WARNING
    if not distributed.is_primary():
        level = logging.ERROR  # the other ranks of a torchrun would repeat rank 0's notices
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        hf_logging.set_verbosity_error()  # transformers' own notices are not the user's business
        hf_logging.disable_progress_bar()  # loading takes under a second from the converted copy


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
