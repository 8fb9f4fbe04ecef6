"""Converters for component options: values from TOML, dicts or the CLI, checked with
messages that name the option, the bad value and what is valid."""

from __future__ import annotations

import numbers

from tokenswift.errors import SpecError

# A run's seed: 64 bits, what torch's generator (the inverse-CDF sampler), the coupled
# sampler's Philox key and the keyed sampler's hash take. Negative seeds are refused: torch would fold -1 onto
# 2**64 - 1, so two spellings of one run would be reported as different seeds.
SEED_MAX = 2**64 - 1


def int_at_least(option: str, low: int, *, optional: bool = False):
    """An attrs converter accepting integers >= ``low`` (and None when ``optional``).
    ``option`` is the dotted name used in messages, e.g. ``"retriever.top_k"``."""

    def convert(value):
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SpecError(f"{option} must be an integer >= {low}, got {value!r}")
        return value

    return convert


def weights_source(option: str, shipped: str, directory: str):
    """An attrs converter for where weights come from: ``"auto"`` (``shipped``),
    ``"random"``, or a ``directory`` path; any non-empty string passes here (a path is
    checked when loaded)."""

    def convert(value):
        if not isinstance(value, str) or not value:
            raise SpecError(f"{option} must be 'auto' ({shipped}), 'random', or {directory}; got {value!r}")
        return value

    return convert


def integer(option: str):
    """An attrs converter accepting any integer (not a bool)."""

    def convert(value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{option} must be an integer, got {value!r}")
        return value

    return convert


def boolean(option: str):
    """An attrs converter accepting only ``true`` / ``false``."""

    def convert(value):
        if not isinstance(value, bool):
            raise SpecError(f"{option} must be true or false, got {value!r}")
        return value

    return convert


def check_seed(value, name: str = "seed") -> int:
    """A run's seed as an int in [0, 2**64 - 1] (:data:`SEED_MAX`); any other value,
    a bool or a non-integer, is a :class:`SpecError` naming ``name`` (``"seed"``,
    ``"--seed"``) and the range. The one check the CLI, ``Pipeline.generate`` and the
    server share."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= SEED_MAX:
        if isinstance(value, numbers.Integral) and abs(int(value)).bit_length() > 256:
            shown = f"an integer of {abs(int(value)).bit_length()} bits"
        else:
            shown = f"{value!r:.60}"
        raise SpecError(f"{name} must be an integer from 0 to 2**64-1 ({SEED_MAX}), got {shown}")
    return int(value)
