"""``tokenswift train-heads``: train draft heads on a frozen model (see
:mod:`tokenswift.tools.training`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenswift.commands import (
    DEFAULT_MODEL, DTYPE_CHOICES, CliError, add_training_schedule, command_line, config_defaults, device_name,
)

NAME = "train-heads"
HELP = "train draft heads for a model on a JSON Lines corpus"


def add_arguments(parser) -> None:
    from tokenswift.tools.training import TrainConfig

    default = config_defaults(TrainConfig)  # the flags' defaults are the config's
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model to train heads for (default {DEFAULT_MODEL!r})")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--data", required=True, help="JSON Lines file, one object with a 'text' key per line")
    parser.add_argument(
        "--features",
        help="train on the target's own text: a folder of its cached features (made by `train-drafter --features`) "
        "from the self-distilled corpus that --data names (whose held-out part scores the heads)",
    )
    parser.add_argument(
        "--penalty", type=float, default=default["penalty"],
        help="with --features: the contextual penalty of the target distribution the heads learn (default %(default)s)",
    )
    parser.add_argument("--out", required=True, help="directory for the heads, checkpoints and training.json")
    parser.add_argument("--steps", type=int, default=default["steps"])
    parser.add_argument("--seq-len", type=int, default=default["seq_len"])
    parser.add_argument("--batch", type=int, default=default["batch"])
    parser.add_argument(
        "--positions", type=int, default=default["positions"], help="positions per window the loss is taken on (0: all)"
    )
    parser.add_argument("--num-heads", type=int, default=default["num_heads"])
    parser.add_argument(
        "--init", default=default["init"],
        help="start from these trained heads (a train-heads directory, or 'shipped') instead of fresh ones",
    )
    add_training_schedule(parser, default)


def run(args, argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from tokenswift.tools.training import TrainConfig, read_corpus, train_heads
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
            init=args.init,
            penalty=args.penalty,
        )
    except ValueError as exc:
        raise CliError(f"train-heads: {exc}") from None
    model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device))
    if tokenizer is None:
        raise CliError(f"train-heads needs a tokenizer, and none was found with {args.model}")
    corpus = read_corpus(args.data, tokenizer, config.holdout)
    cache = None
    if args.features:
        from tokenswift.tools.drafter_training import load_feature_cache

        cache = load_feature_cache(model, args.features, config.penalty)
        print(f"self-distillation: {cache.windows.numel():,} cached positions of the target's own text "
              f"in {args.features}", file=sys.stderr)
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
        from tokenswift.tools.training import CHECKPOINT

        if not (Path(args.out) / CHECKPOINT).is_file():
            raise CliError(f"--resume: no checkpoint in {args.out}")
    def progress_and_close(step, metrics):
        progress(step, metrics)
        if step == config.steps:
            bar.close()
            print("evaluating on the held-out text...", file=sys.stderr)

    record = train_heads(model, corpus, args.out, config, resume=args.resume, progress=progress_and_close, cache=cache)
    record["command"] = command_line(argv)
    record["model"] = args.model
    record["dtype"] = args.dtype
    record["device"] = device_name(model)
    record["data"] = str(args.data)
    if args.features:
        record["features"] = str(args.features)
    Path(args.out, "training.json").write_text(json.dumps(record, indent=2) + "\n")
    acc = record["held_out_accuracy"]
    print(f"held-out accuracy: top-1 {acc['top1']}, top-3 {acc['top3']} (LM head top-1 {acc['lm_head_top1']}); "
          f"the target's greedy token: top-1 {acc['greedy_top1']}, top-3 {acc['greedy_top3']}; "
          f"{record['wall_seconds']:.0f} s", file=sys.stderr)
    return 0
