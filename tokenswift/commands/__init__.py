"""What each ``tokenswift`` command does, one module per command; :mod:`tokenswift.cli`
only parses arguments and dispatches here. Commands own the terminal (progress bars,
summaries); library code only logs."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "smollm2"
DEFAULT_PRESET = "tokenswift"


class CliError(Exception):
    """A user error the CLI reports in one line (exit status 2)."""


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
