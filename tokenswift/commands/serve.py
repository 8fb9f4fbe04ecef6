"""``tokenswift serve``: an OpenAI-compatible HTTP server (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``; see :mod:`tokenswift.server.app`)."""

from __future__ import annotations

import logging
import sys

from tokenswift.commands import DEFAULT_MODEL, DEFAULT_PRESET, DTYPE_CHOICES, CliError, spec_and_overrides

NAME = "serve"
HELP = "serve a preset or spec over an OpenAI-compatible HTTP API (needs the serve extra)"
EPILOG = (
    "Generations run one at a time, in the order requests arrive; a client that disconnects stops its "
    "generation. A request's seed gives exactly what Pipeline.generate gives with that seed (float32/float64; "
    "in bfloat16 the same distribution). temperature 0 is greedy decoding; temperature and top_p otherwise "
    "replace the spec's. Every response carries usage and tokenswift's statistics under \"tokenswift\". "
    "GET /health says whether a generation runs and how the last one ended."
)
logger = logging.getLogger(__name__)


def add_arguments(parser) -> None:
    parser.epilog = EPILOG
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--preset", help=f"a preset name (default {DEFAULT_PRESET!r})")
    which.add_argument("--spec", help="a TOML spec file")
    parser.add_argument("--model", help=f"model directory, .gguf file or packaged model (default {DEFAULT_MODEL!r})")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, help="model dtype (default: auto, the fastest for this machine)")
    parser.add_argument("--compile", choices=("auto", "true", "false"), help="compiled one-token forwards (default auto)")
    parser.add_argument("--device", help="model device: cpu, cuda or cuda:N (default: the spec's, else cpu)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--served-name", help="the model name clients ask for (default: --model's value)")
    parser.add_argument(
        "--default-max-tokens", type=int, default=256, help="new tokens for a request that gives no max_tokens (default 256)"
    )


def run(args, argv: list[str] | None = None) -> int:
    try:
        import uvicorn

        from tokenswift.server.app import Engine, create_app
    except ImportError as exc:
        raise CliError(f"tokenswift serve needs the serve extra ({exc.name} is missing): pip install 'tokenswift[serve]'") from None
    from tokenswift import Pipeline
    from tokenswift.spec import merge_overrides

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    if args.default_max_tokens <= 0:
        raise CliError(f"--default-max-tokens must be a positive integer, got {args.default_max_tokens}")
    spec, overrides = spec_and_overrides(args)
    first = Pipeline.from_spec(spec, overrides=overrides)
    if first.tokenizer is None:
        raise CliError("tokenswift serve needs a model with a tokenizer (requests and responses are text)")

    def make_pipeline(sampling: dict) -> Pipeline:
        if not sampling:
            return first
        return Pipeline.from_spec(spec, first.model, first.tokenizer, overrides=merge_overrides(overrides, {"sampling": sampling}))

    name = args.served_name or str(overrides["model"].get("path") or DEFAULT_MODEL)
    engine = Engine(make_pipeline, name, default_max_tokens=args.default_max_tokens)
    print(
        f"tokenswift: serving {name!r} (preset {first.spec.preset!r}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr, flush=True,
    )
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="info" if args.verbose else "warning")
    return 0
