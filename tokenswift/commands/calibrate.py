"""``tokenswift calibrate``: measure (again) what forwards cost on this machine for a
model, show it, and cache it (see :mod:`tokenswift.calibration`)."""

from __future__ import annotations

import sys

from tokenswift.commands import DEFAULT_MODEL, DTYPE_CHOICES, CliError

NAME = "calibrate"
HELP = "measure what forwards cost on this machine (cached; used to choose trees)"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model to calibrate for (default {DEFAULT_MODEL!r})")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--show", action="store_true", help="show the cached calibration instead of measuring again")
    parser.add_argument(
        "--compile", action="store_true", help="also compare compiled and eager one-token steps and tree verify forwards (compiles the model)"
    )


def run(args, argv: list[str] | None = None) -> int:
    from tokenswift import Pipeline
    from tokenswift.calibration import Calibration, calibration_for, load_calibration
    from tokenswift.model.loading import check_device
    from tokenswift.spec import ModelSpec

    ModelSpec(path=args.model, dtype=args.dtype, device=args.device)  # bad values fail here, before loading
    check_device(args.device)
    pipe = Pipeline.from_spec({"preset": "ar", "model": {"path": args.model, "dtype": args.dtype, "device": args.device}})
    cached = load_calibration(pipe.runner)
    if cached is not None and not args.show:
        print(f"measuring again (the cached calibration took {cached.seconds:.1f} s)...", file=sys.stderr)
    if args.show and cached is None:
        raise CliError(f"no calibration is cached for {args.model} ({pipe.runner.dtype}) on this machine; run without --show")
    calibration = cached if args.show else calibration_for(pipe.runner, pipe.scorer, refresh=True)
    packed = "never" if calibration.packed_from_rows is None else f"from {calibration.packed_from_rows} tokens"
    print(f"machine: {calibration.machine}, {calibration.threads} threads, torch {calibration.torch}")
    print(f"model: {args.model}, {calibration.dtype} on {calibration.device}")
    print(f"oneDNN packed linears: forwards {packed}, LM head {'yes' if calibration.packed_lm_head else 'no'}"
          + (f" (measured {calibration.linears_ms})" if calibration.linears_ms else ""))
    print(f"scoring one node: {calibration.score_ms:.2f} ms")
    if calibration.head_ms is not None and calibration.head_rows_ms is not None:
        from tokenswift.costs import CostModel
        from tokenswift.scoring import FEW_PRODUCT_ROWS, ONE_PRODUCT_ROWS

        rows = CostModel(calibration).one_product_rows
        together = f"{rows} rows" if rows else "no, the likely path's rows only"
        few = ("" if calibration.head_few_rows_ms is None
               else f", {calibration.head_few_rows_ms:.2f} for {FEW_PRODUCT_ROWS}")
        print(f"LM head product: {calibration.head_ms:.2f} ms for one row, {calibration.head_rows_ms:.2f} for "
              f"{ONE_PRODUCT_ROWS}{few} (a step's likeliest nodes scored in one product: {together})")
    print("verify forward, ms, by new tokens (columns) and context length (rows):")
    print(calibration.table())
    print(f"took {calibration.seconds:.1f} s; cached in {Calibration.path(calibration.key)}", file=sys.stderr)
    if args.compile:
        show_compile(pipe.runner, refresh=not args.show)
    return 0


def show_compile(runner, *, refresh: bool) -> None:
    """Compiled vs eager one-token steps (measured again unless only shown)."""
    from tokenswift.compiling import CompileCalibration, load_compile_calibration, measure_compile
    from tokenswift.model.compiled import CompileUnavailable, store_identity
    from tokenswift.model import graph_store
    from tokenswift.model.graph_store import identity_dir

    try:
        if refresh:
            # the whole decoder's tree graph, where later runs can load it from the store
            result = measure_compile(runner, whole_trees=graph_store.enabled())
            result.save()
        else:
            result = load_compile_calibration(runner)
            if result is None:
                raise CliError("no compile calibration is cached for this model on this machine; run without --show")
    except CompileUnavailable as exc:
        raise CliError(f"compiled forwards are unavailable here: {exc}") from None
    print("one-token step (forward + LM-head row), ms, eager vs compiled:")
    for context, eager, compiled in zip(result.contexts, result.eager_ms, result.compiled_ms):
        print(f"  context {context}: eager {eager:.1f}, compiled {compiled:.1f} ({eager / compiled:.2f}x)")
    if result.tree_sizes:
        print(f"tree verify forward at context {result.contexts[-1]}, ms, eager vs compiled (padded sizes):")
        for size, eager, compiled in zip(result.tree_sizes, result.tree_eager_ms, result.tree_compiled_ms):
            verdict = "compiled" if size in result.paying_tree_sizes else "eager"
            print(f"  {size} tokens: eager {eager:.1f}, compiled {compiled:.1f} ({eager / compiled:.2f}x) -> {verdict}")
        if result.tree_far_compiled_ms:
            far = ", ".join(f"{size}: {ms:.1f}" for size, ms in zip(result.tree_sizes, result.tree_far_compiled_ms))
            print(f"  compiled at context {result.tree_far_context} (their growth with the context): {far}")
        if result.far_compiled_ms:
            print(f"  a one-token step compiled at context {result.tree_far_context}: {result.far_compiled_ms:.1f}")
    print(
        f"compiling took {result.compile_seconds:.1f} s (one token) + {result.tree_compile_seconds:.1f} s (trees); "
        f"cached in {CompileCalibration.path(result.key)}",
        file=sys.stderr,
    )
    identity = store_identity(runner.model, runner.logits_dtype, runner.kernel_linears)
    stored = sorted(identity_dir(identity).glob("*.bin")) if identity is not None else []
    if stored:
        print(f"compiled graphs stored in {stored[0].parent} ({', '.join(path.stem for path in stored)}): "
              "later runs load them in seconds, not compile them", file=sys.stderr)


def measure_for_run(what: str, spec_json: str, threads: str) -> int:
    """A run's first calibration, in the child process it started
    (:mod:`tokenswift.calibrate_apart`): ``what`` ("forwards" or "compile") for the
    pipeline of ``spec_json``, at the run's ``threads``, cached where the run looks.
    Returns the exit status (2: it stopped, said why; the run then measures itself)."""
    import json
    import logging

    import torch

    from tokenswift import Pipeline
    from tokenswift.calibration import calibration_for
    from tokenswift.compiling import compile_calibration_for
    from tokenswift.errors import TokenswiftError
    from tokenswift.model.compiled import CompileUnavailable

    torch.set_num_threads(int(threads))  # the run's threads: part of the records' key
    try:
        pipe = Pipeline.from_spec(json.loads(spec_json))
        if what == "forwards":
            calibration_for(pipe.runner, pipe.scorer)
        else:
            compile_calibration_for(pipe.runner)
    except (CompileUnavailable, TokenswiftError, ValueError) as exc:
        logging.getLogger(__name__).warning("the calibration process stopped: %s", exc)
        return 2
    return 0
