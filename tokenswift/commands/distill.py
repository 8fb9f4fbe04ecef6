"""``tokenswift distill``: a self-distillation corpus, the target's own continuations
of book prompts, for training drafters on (see :mod:`tokenswift.tools.self_distill`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenswift.commands import DEFAULT_MODEL, DTYPE_CHOICES, CliError, command_line, config_defaults, device_name

NAME = "distill"
HELP = "write a corpus of what the model itself writes (resumable shards), for train-drafter / train-heads"


def add_arguments(parser) -> None:
    from tokenswift.tools.self_distill import DistillConfig

    default = config_defaults(DistillConfig)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"the target model (default {DEFAULT_MODEL!r})")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="the model's dtype (default auto)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--data", required=True, help="JSON Lines books to draw prompts from (one object with 'text' per line)")
    parser.add_argument("--out", required=True, help="directory for the shards (a run resumes at the first missing one)")
    parser.add_argument("--shards", type=int, default=default["shards"], help="shards in all (default %(default)s)")
    parser.add_argument("--batch", type=int, default=default["batch"], help="sequences per shard (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=default["prompt_tokens"], help="default %(default)s")
    parser.add_argument("--new-tokens", type=int, default=default["new_tokens"], help="per sequence (default %(default)s)")
    parser.add_argument("--seed", type=int, default=default["seed"])
    parser.add_argument(
        "--holdout", default=",".join(default["holdout"]), help="comma-separated book ids never used for prompts"
    )
    parser.add_argument(
        "--chat", action="store_true",
        help="this run's shards prompt with instructions through the chat template (answers end at the end of turn)",
    )


def run(args, argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from tokenswift.model.loading import load_model
    from tokenswift.spec import ModelSpec
    from tokenswift.tools.self_distill import RECORD, DistillConfig, distill, shard_path

    try:
        config = DistillConfig(
            shards=args.shards, batch=args.batch, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
            seed=args.seed, chat=args.chat, holdout=tuple(name.strip() for name in args.holdout.split(",") if name.strip()),
        )
    except ValueError as exc:
        raise CliError(f"distill: {exc}") from None
    model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device))
    if tokenizer is None:
        raise CliError(f"distill needs a tokenizer, and none was found with {args.model}")
    if config.chat:
        from tokenswift.prompts import chat_template_text

        chat_template_text(tokenizer, [{"role": "user", "content": "?"}])  # no template: refused before any work
    missing = sum(not shard_path(args.out, i).is_file() for i in range(config.shards))
    bar = tqdm(total=missing * config.batch * config.new_tokens, unit="tok", desc="distilling", file=sys.stderr,
               dynamic_ncols=True)
    record = distill(model, tokenizer, args.data, args.out, config, progress=bar.update)
    bar.close()
    record.update(command=command_line(argv), model=args.model, dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                  device=device_name(model))
    (Path(args.out) / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: record[k] for k in ("tokens_generated_this_run", "seconds_this_run")} | {"shards": len(record["shards"])}))
    return 0
