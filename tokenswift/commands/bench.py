"""``tokenswift bench``: transformers ``generate()`` and the presets side by side (see
:mod:`tokenswift.tools.bench`)."""

from __future__ import annotations

import sys

from tokenswift.commands import DEFAULT_MODEL, DTYPE_CHOICES, CliError, read_prompt_file
from tokenswift.errors import TokenswiftError

NAME = "bench"
HELP = "benchmark transformers generate against the presets, side by side"

LONG_BENCH_TOKENS = 14_336
LONG_BENCH_ROPE = "yarn:2"


DEFAULT_NEW_TOKENS = 6144
CONTEXTS_NEW_TOKENS = 256


def add_arguments(parser) -> None:
    from tokenswift.tools.bench import HF_METHODS, PRESET_METHODS

    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--heads", default="auto", help="heads for the tokenswift and medusa presets")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument(
        "--prompt-file",
        help="UTF-8 text whose first tokens are the prompt(s), for prompts longer than the bundled held-out one "
             "(~48K tokens of the demo model; default: that one)",
    )
    parser.add_argument("--new-tokens", type=int, help="new tokens per method (default 6144; 256 with --contexts)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="1,024 new tokens, for iteration")
    length.add_argument(
        "--long", action="store_true",
        help=f"{LONG_BENCH_TOKENS:,} new tokens (16K positions with the prompt, twice the demo model's "
        f"trained context) with RoPE scaling {LONG_BENCH_ROPE} unless --rope says otherwise",
    )
    parser.add_argument("--rope", help="RoPE-scaling override TYPE:FACTOR (e.g. yarn:2), for runs past the trained context")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (reports identity with ar)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", help="comma-separated subset of: " + ", ".join(HF_METHODS + PRESET_METHODS))
    parser.add_argument("--out", default="bench-out", help="directory for bench.json, bench.md and bench.png")
    parser.add_argument(
        "--interleaved", action="store_true",
        help="presets decode in turns of 8 tokens on one model: speed ratios to ar that a noisy machine cannot fake, "
        "with each preset's tree decisions (writes interleaved.json/.md)",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", help="with --interleaved or --contexts: one comparison per seed, summed"
    )
    parser.add_argument(
        "--compile", choices=("off", "on", "both", "all"),
        help="with --interleaved: presets eager (off, the default), compiled (on), both side by side "
        "(PRESET+compiled), or all three with compile = auto (PRESET+auto); the compile time is reported. "
        "With --contexts: every method eager (off) or compiled (on, its ar then the baseline); "
        "default: as each preset's compile = auto decides",
    )
    parser.add_argument(
        "--no-compiled-baseline", dest="compiled_baseline", action="store_false",
        help="with --interleaved or --contexts: leave out ar+compiled, the fastest plain decoding, which every "
        "preset is otherwise also reported against (its one compile is then not paid)",
    )
    parser.add_argument(
        "--contexts", type=int, nargs="+", metavar="TOKENS",
        help="long-context sweep: for each prompt length, one prefill shared by the presets (default ar,tokenswift), "
        "which decode in turns; ratios to ar, tokens/step and a memory roofline per context; RoPE scaled "
        "automatically past the trained length (writes contexts.json/.md/.png)",
    )
    parser.add_argument(
        "--decodings", nargs="+", choices=("sampling", "greedy"), default=["sampling", "greedy"],
        help="with --contexts: the paper's sampling, greedy, or both (default both)",
    )


def run(args, argv: list[str] | None = None) -> int:
    if args.contexts:
        return run_contexts(args)
    if args.new_tokens is None:
        args.new_tokens = DEFAULT_NEW_TOKENS
    if args.interleaved:
        if args.compile is None:
            args.compile = "off"
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
        prompt_file=checked_prompt_file(args), new_tokens=new_tokens, greedy=args.greedy, seed=args.seed, methods=methods,
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
    from tokenswift.spec import ModelSpec
    from tokenswift.tools.bench import PRESET_METHODS, prompt_tokens_for
    from tokenswift.tools.interleaved import compare_presets, markdown, variant_names

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
    prompt_file = checked_prompt_file(args)
    model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device))
    try:
        prompt = prompt_tokens_for(tokenizer, args.prompt_tokens, prompt_file)
    except ValueError as exc:
        raise CliError(f"--prompt-tokens {args.prompt_tokens}: {exc}") from None
    names = ["ar", *[p for p in presets if p != "ar"]]
    variants = variant_names(names, args.compile, args.compiled_baseline)
    bar = tqdm(total=new_tokens * len(variants) * len(seeds), unit="tok", file=sys.stderr, dynamic_ncols=True)
    report = compare_presets(model, tokenizer, names, prompt, new_tokens, seeds=seeds, greedy=args.greedy, heads=args.heads,
                             compile=args.compile, compiled_baseline=args.compiled_baseline,
                             progress=lambda name, count: bar.update(count))
    bar.close()
    report["roofline"] = ar_roofline(model, report, args.prompt_tokens, new_tokens)
    from tokenswift.machine import machine_name

    report["config"] = {
        "model": args.model, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "device": args.device,
        "machine": machine_name(next(model.parameters()).device), "prompt_tokens": args.prompt_tokens,
        "new_tokens": new_tokens, "seeds": seeds, "greedy": args.greedy, "compile": args.compile,
        "compiled_baseline": args.compiled_baseline,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interleaved.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "interleaved.md").write_text(table)
    print(table, end="")
    print(f"{report['config']['machine']}, {report['config']['dtype']}; wrote {out / 'interleaved.json'} and interleaved.md", file=sys.stderr)
    return 0


def ar_roofline(model, report: dict, prompt_tokens: int, new_tokens: int) -> dict:
    """``ar``'s ms per token (eager and/or compiled) beside what memory traffic allows: its
    weights and the mean context's KV read once per token, over this machine's measured
    bandwidth."""
    from tokenswift.memory import parameter_bytes
    from tokenswift.model.runner import Runner
    from tokenswift.tools.contexts import Roofline, measure_bandwidth

    runner = Runner(model)
    bandwidth = measure_bandwidth(runner.device)
    roof = Roofline(weights=parameter_bytes(model), kv_per_position=runner.kv_bytes(1), bandwidth=bandwidth)
    floor_ms = 1000 * roof.forward_seconds(prompt_tokens + new_tokens / 2)
    measured = {}
    for name, row in report["summary"].items():
        if name.split("+")[0] == "ar" and row["tokens_per_second"]:
            ms = 1000 / row["tokens_per_second"]
            measured[name] = {"ms_per_token": round(ms, 2), "fraction": round(floor_ms / ms, 3)}
    return {"bandwidth_gb_s": round(bandwidth / 1e9, 1), "floor_ms": round(floor_ms, 2), "ar": measured}


def checked_prompt_file(args) -> str | None:
    """``--prompt-file``, checked readable as UTF-8 text before anything loads (None: the bundled prompt)."""
    if args.prompt_file is None:
        return None
    if not read_prompt_file(args.prompt_file).strip():
        raise CliError(f"the prompt file {args.prompt_file} is empty")
    return args.prompt_file


def run_contexts(args) -> int:
    """``bench --contexts``: the presets against ar as the prompt grows (see
    :mod:`tokenswift.tools.contexts`)."""
    import json
    from pathlib import Path

    from tqdm import tqdm

    from tokenswift.machine import machine_name
    from tokenswift.model.loading import check_device, load_model
    from tokenswift.spec import ModelSpec, parse_rope
    from tokenswift.tools.bench import PRESET_METHODS, prompt_tokens_for
    from tokenswift.tools.contexts import TREE_SLACK, auto_rope, markdown, plot, run_contexts as sweep

    if args.interleaved or args.quick or args.long:
        raise CliError("--contexts is its own comparison; it takes no --interleaved, --quick or --long")
    if args.compile in ("both", "all"):
        raise CliError(f"--compile {args.compile} is for --interleaved; --contexts takes --compile off or on "
                       "(or neither: each preset's compile = auto)")
    compiled = {"off": False, "on": True}.get(args.compile)  # None: as each preset decides
    from tokenswift.presets import PAPER_PENALTY
    from tokenswift.tools import llamacpp

    presets = ["ar", "tokenswift"]
    references: list[str] = []
    if args.methods:
        presets = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in presets if m not in PRESET_METHODS and m not in llamacpp.METHODS]
        if unknown:
            raise CliError(f"--contexts compares presets and references; unknown {unknown}; "
                           f"valid: {list(PRESET_METHODS) + list(llamacpp.METHODS)}")
        references = [m for m in presets if m in llamacpp.METHODS]
        presets = [m for m in presets if m not in llamacpp.METHODS]
    if references and not llamacpp.available():
        raise CliError(f"--methods {','.join(references)} needs llama-cpp-python; install it with: {llamacpp.INSTALL}")
    if references:
        try:
            gguf = llamacpp.gguf_file(args.model)
        except TokenswiftError as exc:
            raise CliError(str(exc)) from None
    bad = [c for c in args.contexts if c < 2]
    if bad:
        raise CliError(f"--contexts must be prompt lengths of at least 2 tokens, got {bad}")
    new_tokens = CONTEXTS_NEW_TOKENS if args.new_tokens is None else args.new_tokens
    if new_tokens <= 0:
        raise CliError(f"--new-tokens must be positive, got {new_tokens}")
    contexts = sorted(set(args.contexts))
    seeds = args.seeds if args.seeds else [args.seed]
    rope = parse_rope(args.rope)
    ModelSpec(path=args.model, dtype=args.dtype, device=args.device, rope=rope)  # bad values fail here, before any output
    check_device(args.device)
    prompt_file = checked_prompt_file(args)
    model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device, rope=rope))
    trained = int(model.config.max_position_embeddings)
    needed = contexts[-1] + new_tokens + TREE_SLACK
    if rope is None and auto_rope(trained, needed) is not None:
        rope = auto_rope(trained, needed)
        print(f"RoPE scaled for the sweep: {rope['type']} x{rope['factor']:g} ({needed:,} positions needed, the model "
              f"was trained on {trained:,})", file=sys.stderr)
        model, tokenizer = load_model(ModelSpec(path=args.model, dtype=args.dtype, device=args.device, rope=rope))
    if tokenizer is None:
        raise CliError(f"model {args.model!r} has no tokenizer; --contexts needs one for its held-out prompts")
    try:
        prompt_tokens_for(tokenizer, contexts[-1], prompt_file)
    except ValueError as exc:
        raise CliError(f"--contexts {contexts[-1]}: {exc}") from None
    out = Path(args.out)
    device = next(model.parameters()).device
    info = {
        "model": args.model, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "device": args.device,
        "machine": machine_name(device), "threads": torch_threads(), "rope": rope, "new_tokens": new_tokens,
        "seeds": seeds, "presets": presets, "decodings": args.decodings, "compiled_baseline": args.compiled_baseline,
        "compile": "auto" if compiled is None else compiled,
    }
    methods = len(presets if "ar" in presets else ["ar", *presets]) + int(args.compiled_baseline and compiled is not True)
    methods += len(references)
    runs = methods * len(args.decodings) * len(seeds)
    bar = tqdm(total=new_tokens * runs * len(contexts), unit="tok", file=sys.stderr, dynamic_ncols=True)

    def write(report: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        report = {**report, "config": info, "title": f"{args.model}, {info['dtype']}, {info['machine']}"}
        (out / "contexts.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "contexts.md").write_text(markdown(report))
        plot(report, out / "contexts.png")

    loaded = {
        name: llamacpp.LlamaCpp(gguf, n_ctx=needed, threads=torch_threads(), window=PAPER_PENALTY["window"],
                                lookup=name.endswith("+lookup"), rope=rope, trained=trained)
        for name in references
    }
    if references:
        info["references"] = {"gguf": str(gguf), "llama_cpp_python": llamacpp.version()}
    report = sweep(
        model, tokenizer, lambda n: prompt_tokens_for(tokenizer, n, prompt_file), contexts=contexts, new_tokens=new_tokens, references=loaded,
        presets=presets, decodings=args.decodings, seeds=seeds, heads=args.heads,
        overrides=None if compiled is None else {"model": {"compile": compiled}},
        compiled_baseline=args.compiled_baseline, progress=lambda name, count: bar.update(count), on_context=write,
    )
    bar.close()
    write(report)
    print(markdown(report), end="")
    print(f"{info['machine']}, {info['dtype']}, memory bandwidth {report['bandwidth_gb_s']} GB/s; "
          f"wrote {out / 'contexts.json'}, contexts.md, contexts.png", file=sys.stderr)
    return 0


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
