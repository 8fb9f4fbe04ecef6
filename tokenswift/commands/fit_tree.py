"""``tokenswift fit-tree``: fit the ``tokenswift`` drafter's tree to how its drafts
are accepted (see :mod:`tokenswift.tools.tree_fit`); writes ``tree.json`` beside the heads."""

from __future__ import annotations

import sys
from pathlib import Path

from tokenswift.commands import DEFAULT_MODEL, DTYPE_CHOICES, CliError, command_line, device_name, read_prompt_file

NAME = "fit-tree"
HELP = "fit the tokenswift drafter's tree to how its drafts are accepted; writes tree.json beside the heads"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--heads", default="auto", help="heads directory (default: the heads shipped for the model)")
    parser.add_argument("--nodes", type=int, default=40, help="tree nodes below the root (default 40, as [1,3,3,3])")
    parser.add_argument("--prompt-file", help="text to continue, UTF-8 (default: the bundled public-domain prompt)")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="prompt tokens used, from its start (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=2000, help="new tokens replayed per seed (default 2000)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one generation per seed (default 1 2 3)")
    parser.add_argument(
        "--decodings", default="sampling,greedy",
        help="comma-separated: what the tree is fitted to, pooled: sampling (the preset's), greedy (default both)",
    )
    parser.add_argument("--out", help="directory to write tree.json to (default: the heads directory)")


def run(args, argv: list[str] | None = None) -> int:
    import time

    from tqdm import tqdm

    from tokenswift.drafters.draft_heads import DraftHeads, find_shipped_heads
    from tokenswift.drafters.template import save_tree
    from tokenswift.tools.tree_fit import fit_for_heads
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
    from tokenswift.tools.tree_fit import DECODINGS

    decodings = [d.strip() for d in args.decodings.split(",") if d.strip()]
    if not decodings or set(decodings) - set(DECODINGS):
        raise CliError(f"--decodings {args.decodings!r}: give a comma-separated list of {list(DECODINGS)}")
    text = read_prompt_file(args.prompt_file) if args.prompt_file is not None else None
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
    bar = tqdm(total=args.new_tokens * len(args.seeds) * len(decodings), unit="tok", file=sys.stderr, dynamic_ncols=True)
    paths, record = fit_for_heads(
        model, tokenizer, heads, nodes=args.nodes, prompt=prompt, new_tokens=args.new_tokens, seeds=args.seeds,
        decodings=decodings, progress=bar.update,
    )
    bar.close()
    record.update(
        command=command_line(argv),
        prompt=args.prompt_file or "bundled (the opening of Wuthering Heights)",
        model=args.model,
        dtype=args.dtype,
        device=device_name(model),
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
