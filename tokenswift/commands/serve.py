"""``tokenswift serve``: an OpenAI-compatible HTTP server (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``; see :mod:`tokenswift.server.app`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from tokenswift.commands import DEFAULT_MODEL, DEFAULT_PRESET, DTYPE_CHOICES, CliError, spec_and_overrides

NAME = "serve"
HELP = "serve a preset or spec over an OpenAI-compatible HTTP API (needs the serve extra)"
EPILOG = (
    "Generations run one at a time, in the order requests arrive; a client that disconnects stops its "
    "generation (a queued one never starts). A request body larger than --max-body-bytes gets a 413, a prompt "
    "longer than the context a 400 as soon as its counted tokens pass it. SIGTERM or Ctrl-C stops the running "
    "generation after its step: each open stream gets a last chunk with finish_reason \"cancelled\" and [DONE], "
    "queued requests a 503, and the server exits; a second signal exits at once. A request's seed (an integer "
    "from 0 to 2**64-1) gives exactly what Pipeline.generate gives with that seed (float32/float64; "
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
    parser.add_argument(
        "--max-body-bytes", type=int, default=None, metavar="N",
        help="refuse a request body larger than N bytes with a 413 (default 4194304: 4 MiB)",
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
    from tokenswift.server.app import DEFAULT_MAX_BODY_BYTES

    max_body_bytes = DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes
    if max_body_bytes <= 0:
        raise CliError(f"--max-body-bytes must be a positive number of bytes, got {max_body_bytes}")
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
    config = uvicorn.Config(
        create_app(engine, max_body_bytes=max_body_bytes), host=args.host, port=args.port,
        log_level="info" if args.verbose else "warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    _server_class(uvicorn)(config, engine).run()
    return 0


# After the running generation is cancelled, how long a connection still busy (a client
# still sending its request) may hold the exit back.
GRACEFUL_SHUTDOWN_SECONDS = 2.0


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's server, whose first SIGTERM or SIGINT also closes the engine at once
        (uvicorn alone waited for the running generation to finish: 24 s for a long
        one) and whose second one, of either kind, exits at once."""

        def __init__(self, config, engine) -> None:
            super().__init__(config)
            self.engine = engine

        def handle_exit(self, sig: int, frame) -> None:
            if self.should_exit:
                os.write(2, f"tokenswift: {signal.Signals(sig).name} again: exiting now\n".encode())
                os._exit(128 + sig)
            try:  # on the event loop, not inside the handler: the signal may land mid-lock
                asyncio.get_running_loop().call_soon_threadsafe(self.engine.close)
            except RuntimeError:  # no loop runs (yet)
                self.engine.close()
            super().handle_exit(sig, frame)

    return Server
