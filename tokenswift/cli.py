"""The ``tokenswift`` command line: the top-level parser and dispatch. Each command's
arguments and what it does live beside each other in its module of
:mod:`tokenswift.commands` (``NAME``, ``HELP``, ``add_arguments``, ``run``).

Bad input gives one line on stderr and exit status 2, never a traceback. Under
``torchrun`` every rank runs the same command; rank 0 alone prints and writes files.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tokenswift import __version__, distributed
from tokenswift.commands import (
    CliError,
    ablate,
    bench,
    calibrate,
    components,
    distill,
    fit_tree,
    generate,
    serve,
    train_drafter,
    train_heads,
)
from tokenswift.errors import TokenswiftError

EXIT_USAGE = 2
# Each command's module by its name on the command line, in the order --help lists them.
COMMANDS = {
    module.NAME: module
    for module in (generate, serve, distill, train_heads, train_drafter, fit_tree, bench, ablate, calibrate, components)
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, as for every other bad input
        raise CliError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenswift", description="Lossless acceleration of ultra-long generation.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _configure_logging(args)
        return COMMANDS[args.command].run(args, argv)
    except (CliError, TokenswiftError, ValueError, TypeError, OSError) as exc:
        if distributed.is_primary():  # the ranks of a torchrun all fail alike
            print(f"tokenswift: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if distributed.is_primary():
            print("tokenswift: interrupted", file=sys.stderr)
        return 130


def _configure_logging(args) -> None:
    from transformers.utils import logging as hf_logging

    level = logging.INFO if args.verbose else logging.WARNING
    if not distributed.is_primary():
        level = logging.ERROR  # the other ranks of a torchrun would repeat rank 0's notices
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        hf_logging.set_verbosity_error()  # transformers' own notices are not the user's business
        hf_logging.disable_progress_bar()  # loading takes under a second from the converted copy


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
