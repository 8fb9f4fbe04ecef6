"""``tokenswift components``: every registered component and preset, with origins and options."""

from __future__ import annotations

from tokenswift.commands import CliError
from tokenswift.errors import PluginError

NAME = "components"
HELP = "list registered components and presets"


def add_arguments(parser) -> None:
    """The command takes no arguments."""


def run(args=None, argv: list[str] | None = None) -> int:
    from tokenswift.registry import build_registry, get_plugin_manager

    try:
        registry = build_registry(get_plugin_manager())
    except PluginError as exc:
        raise CliError(str(exc)) from None
    current = None
    for info in registry.components():
        if info.kind != current:
            current = info.kind
            print(f"{current}:")
        options = ", ".join(f"{k}={v!r}" for k, v in info.option_defaults().items()) or "no options"
        print(f"  {info.name:<16} [{info.origin}] {info.summary}")
        print(f"  {'':<16} options: {options}")
    print("presets:")
    for name in sorted(registry.presets):
        print(f"  {name:<16} [{registry.preset_origins[name]}]")
    return 0
