"""``tokenswift train-drafter``: train the ``eagle`` drafter's network on a frozen model
(see :mod:`tokenswift.tools.drafter_training`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenswift.commands import CliError, command_line, device_name


def run(args, argv) -> int:
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
            lr=args.lr,
            warmup=args.warmup,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
            holdout=tuple(name.strip() for name in args.holdout.split(",") if name.strip()),
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
