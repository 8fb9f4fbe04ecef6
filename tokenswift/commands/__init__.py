"""What each ``tokenswift`` command does, one module per command; :mod:`tokenswift.cli`
builds the top-level parser and dispatches here. Commands own the terminal (progress
bars, summaries); library code only logs.

Each command module has its name and one-line help (``NAME``, ``HELP``), its arguments
(``add_arguments(parser)``, which adds them to the command's subparser) and its handler
(``run(args, argv)``, the exit status). What a command needs to run it imports when it
runs; building the parser imports at most a tool's config class, for its defaults."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "smollm2"
DEFAULT_PRESET = "tokenswift"
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float64"]


class CliError(Exception):
    """A user error the CLI reports in one line (exit status 2)."""


def config_defaults(config_class) -> dict:
    """An attrs config class's field defaults by name: a command's flags take their
    defaults from the config they fill, which is the one authority for them."""
    import attrs

    return {
        field.name: field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
        for field in attrs.fields(config_class)
    }


def add_training_schedule(parser, default: dict) -> None:
    """The flags both training commands share (learning rate and warm-up, seed,
    checkpoints, held-out books, resuming), with their defaults from ``default``
    (:func:`config_defaults` of the command's config)."""
    parser.add_argument("--lr", type=float, default=default["lr"])
    parser.add_argument("--warmup", type=int, default=default["warmup"])
    parser.add_argument("--seed", type=int, default=default["seed"])
    parser.add_argument("--checkpoint-every", type=int, default=default["checkpoint_every"])
    parser.add_argument(
        "--holdout", default=",".join(default["holdout"]), help="comma-separated book ids kept for evaluation"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")


def spec_and_overrides(args):
    """The spec (``--spec`` file or ``--preset``) and the overrides of the model flags
    (``--model``, ``--dtype``, ``--device``, ``--compile``; ``--greedy``, ``--heads``
    where the command has them) for ``Pipeline.from_spec``."""
    from tokenswift.spec import load_toml

    if args.spec:
        spec = load_toml(args.spec)
    else:
        spec = {"preset": args.preset or DEFAULT_PRESET}
    model = dict(spec.get("model") or {})
    if args.model or not model:
        model = {"path": args.model or DEFAULT_MODEL, "dtype": model.get("dtype", "auto")}
    if args.dtype:
        model["dtype"] = args.dtype
    if args.device:
        model["device"] = args.device
    if args.compile:
        model["compile"] = args.compile
    overrides: dict = {"model": model}
    if getattr(args, "greedy", False):
        overrides["sampling"] = {"greedy": True}
    if getattr(args, "heads", None):
        overrides["drafter"] = {"heads": args.heads}
    return spec, overrides


def check_writable(name: str | Path, flag: str) -> Path:
    """A file path a command will write, checked without opening it (so that a refused
    run leaves an existing file as it was): not a directory, in an existing directory,
    writable. ``flag`` names it in the one-line error."""
    import os

    path = Path(name)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise CliError(f"{flag} {path} is a directory; give a file path")
    if not parent.is_dir():
        raise CliError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise CliError(f"{flag} {path} is not writable")
    return path


def read_prompt_file(name: str) -> str:
    path = Path(name)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"prompt file not found: {path}") from None
    except UnicodeDecodeError:
        raise CliError(f"prompt file is not UTF-8 text: {path}") from None


def device_name(model) -> str:
    """'cpu', or 'cuda:0 (NVIDIA H200)': where a model runs, for records."""
    import torch

    device = next(model.parameters()).device
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def command_line(argv: list[str] | None) -> str:
    """The command as typed, for records."""
    import shlex
    import sys

    return "tokenswift " + shlex.join(argv if argv is not None else sys.argv[1:])
