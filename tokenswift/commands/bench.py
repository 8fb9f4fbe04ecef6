"""``tokenswift bench``: transformers ``generate()`` and the presets side by side (see
:mod:`tokenswift.tools.bench`)."""

from __future__ import annotations

import sys

from tokenswift.commands import CliError

LONG_BENCH_TOKENS = 14_336
LONG_BENCH_ROPE = "yarn:2"


def run(args) -> int:
    if args.interleaved:
        return run_interleaved(args)
    from tqdm import tqdm

    from tokenswift.tools.bench import HF_METHODS, PRESET_METHODS, BenchConfig, markdown_table, run_bench, write_reports
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


def run_interleaved(args) -> int:
    """``bench --interleaved``: presets decoding in turns; ratios to ar."""
    import json
    from pathlib import Path

    from tqdm import tqdm

    from tokenswift.model.loading import check_device, load_model
    from tokenswift.prompts import prompt_ids
    from tokenswift.spec import ModelSpec
    from tokenswift.tools.bench import PRESET_METHODS
    from tokenswift.tools.interleaved import compare_presets, markdown

    presets = list(PRESET_METHODS)
    if args.methods:
        presets = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in presets if m not in PRESET_METHODS]
        if unknown:
            raise CliError(f"--interleaved compares presets; unknown {unknown}; valid: {list(PRESET_METHODS)}")
    new_tokens = 1024 if args.quick else args.new_tokens
    if new_tokens <= 0 or args.prompt_tokens <= 0:
        raise CliError("--new-tokens and --prompt-tokens must be positive")
    seeds = args.seeds if args.seeds else [args.seed]
    ModelSpec(path=args.model, dtype=args.dtype, device=args.device)  # bad values fail here, before any output
    check_device(args.device)
    model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device))
    prompt = prompt_ids(tokenizer, args.prompt_tokens)
    names = ["ar", *[p for p in presets if p != "ar"]]
    bar = tqdm(total=new_tokens * len(names) * len(seeds), unit="tok", file=sys.stderr, dynamic_ncols=True)
    report = compare_presets(model, tokenizer, names, prompt, new_tokens, seeds=seeds, greedy=args.greedy, heads=args.heads,
                             progress=lambda name, count: bar.update(count))
    bar.close()
    from tokenswift.machine import machine_name

    report["config"] = {
        "model": args.model, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "device": args.device,
        "machine": machine_name(next(model.parameters()).device), "prompt_tokens": args.prompt_tokens,
        "new_tokens": new_tokens, "seeds": seeds, "greedy": args.greedy,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interleaved.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "interleaved.md").write_text(table)
    print(table, end="")
    print(f"{report['config']['machine']}, {report['config']['dtype']}; wrote {out / 'interleaved.json'} and interleaved.md", file=sys.stderr)
    return 0
