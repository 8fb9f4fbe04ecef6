"""Converters for component options: values from TOML, dicts or the CLI, checked with
messages that name the option, the bad value and what is valid."""

from __future__ import annotations

from tokenswift.errors import SpecError


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
