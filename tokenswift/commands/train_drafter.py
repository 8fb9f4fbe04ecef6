"""``tokenswift train-drafter``: train the ``eagle`` drafter's network on a frozen model
(see :mod:`tokenswift.tools.drafter_training`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenswift.commands import (
    DEFAULT_MODEL, DTYPE_CHOICES, CliError, add_training_schedule, command_line, config_defaults, device_name,
)

NAME = "train-drafter"
HELP = "train the eagle drafter's network (one layer over the model's features) on a JSON Lines corpus"


def add_arguments(parser) -> None:
    from tokenswift.tools.drafter_training import DrafterTrainConfig

    default = config_defaults(DrafterTrainConfig)  # the flags' defaults are the config's
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"the target model (default {DEFAULT_MODEL!r})")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="the target's dtype for its features")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--data", required=True, help="JSON Lines file, one object with a 'text' key per line")
    parser.add_argument("--out", required=True, help="directory for the network, checkpoints and training.json")
    parser.add_argument("--features", help="folder for the cached target features (default OUT/features)")
    parser.add_argument(
        "--windows", type=int, default=default["windows"],
        help="training windows whose features are cached (default %(default)s)",
    )
    parser.add_argument("--seq-len", type=int, default=default["seq_len"])
    parser.add_argument("--steps", type=int, default=default["steps"])
    parser.add_argument("--batch", type=int, default=default["batch"])
    parser.add_argument(
        "--depth", type=int, default=default["depth"], help="draft levels unrolled in training (default %(default)s)"
    )
    parser.add_argument(
        "--draft-vocab", type=int, default=default["draft_vocab"], help="LM-head rows the draft ranks (default %(default)s)"
    )
    parser.add_argument(
        "--penalty", type=float, default=default["penalty"],
        help="train on distributions after this contextual penalty, as the presets sample (1.0: raw)",
    )
    parser.add_argument(
        "--feature-weight", type=float, default=default["feature_weight"],
        help="weight of EAGLE-1/2's feature regression (default %(default)s: EAGLE-3's token losses only)",
    )
    parser.add_argument(
        "--hard-weight", type=float, default=default["hard_weight"],
        help="weight of the cross-entropy on the target's greedy token, beside the soft one (default %(default)s)",
    )
    parser.add_argument(
        "--decay", type=float, default=default["decay"],
        help="level k's losses weigh decay**(k-1) (default %(default)s)",
    )
    parser.add_argument(
        "--autocast", choices=("auto", "on", "off"), default=default["autocast"],
        help="bfloat16 autocast of the network (auto: where the CPU has native bfloat16; default %(default)s)",
    )
    parser.add_argument(
        "--init", default=default["init"],
        help="start from this trained network (a train-drafter directory, or 'shipped') instead of a fresh one",
    )
    parser.add_argument(
        "--fused-layers", type=int, nargs="+", default=default["fused_layers"], metavar="K",
        help="EAGLE-3's fused features: also read the outputs of these decoder layers (1-based, e.g. 2 15), "
        "fused with the final-norm state; default: those of --init, or none",
    )
    add_training_schedule(parser, default)


def run(args, argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from tokenswift.model.loading import load_model
    from tokenswift.spec import ModelSpec
    from tokenswift.tools.drafter_training import CHECKPOINT, RECORD, DrafterTrainConfig, train_drafter
    from tokenswift.tools.training import read_corpus

    try:
        config = DrafterTrainConfig(
            windows=args.windows,
            seq_len=args.seq_len,
            steps=args.steps,
            batch=args.batch,
            depth=args.depth,
            draft_vocab=args.draft_vocab,
            penalty=args.penalty,
            feature_weight=args.feature_weight,
            hard_weight=args.hard_weight,
            decay=args.decay,
            autocast=args.autocast,
            lr=args.lr,
            warmup=args.warmup,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
            holdout=tuple(name.strip() for name in args.holdout.split(",") if name.strip()),
            init=args.init,
            fused_layers=tuple(args.fused_layers),
        )
    except ValueError as exc:
        raise CliError(f"train-drafter: {exc}") from None
    if args.resume and not (Path(args.out) / CHECKPOINT).is_file():
        raise CliError(f"--resume: no checkpoint in {args.out}")
    model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device))
    if tokenizer is None:
        raise CliError(f"train-drafter needs a tokenizer, and none was found with {args.model}")
    corpus = read_corpus(args.data, tokenizer, config.holdout)
    print(
        f"training the eagle drafter on {len(corpus.train):,} tokens ({len(corpus.train_ids)} books), features of "
        f"{config.windows} windows x {config.seq_len}; held out: {', '.join(corpus.held_out_ids)}",
        file=sys.stderr,
    )
    chunks = -(-config.windows // 8)
    feature_bar = tqdm(total=chunks, desc="features", unit="chunk", file=sys.stderr, dynamic_ncols=True)
    bar = None

    def feature_progress(done):
        feature_bar.n = done
        feature_bar.refresh()
        if done == chunks:
            feature_bar.close()

    def progress(step, metrics):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=config.steps, initial=step - 1, desc="training", unit="step", file=sys.stderr, dynamic_ncols=True)
        bar.n = step
        bar.set_postfix({"feature": f"{sum(metrics['feature']):.3f}", "token": f"{sum(metrics['token']):.2f}",
                         "hard": f"{sum(metrics['hard']):.2f}",
                         "agree": "/".join(f"{a:.2f}" for a in metrics["agree"])})
        if step == config.steps:
            bar.close()
            print("evaluating on the held-out text...", file=sys.stderr)

    record = train_drafter(
        model, corpus, args.out, config, features_dir=args.features, resume=args.resume,
        feature_progress=feature_progress, progress=progress,
    )
    record["command"] = command_line(argv)
    record["model"] = args.model
    record["dtype"] = args.dtype
    record["device"] = device_name(model)
    record["data"] = str(args.data)
    Path(args.out, RECORD).write_text(json.dumps(record, indent=2) + "\n")
    agreement = record["held_out_agreement"]
    print(f"held-out agreement with the model's top-1 per draft level: top-1 {agreement['top1']}, "
          f"top-3 {agreement['top3']}; {record['wall_seconds']:.0f} s training", file=sys.stderr)
    return 0
