"""The component registry and the plugin manager that fills it.

Built-in components register through the same hook as third-party plugins
(:mod:`tokenswift.builtins`), so every component is found by ``(kind, name)`` the same
way. Plugins load from the ``tokenswift`` entry-point group; set
``TOKENSWIFT_DISABLE_PLUGINS`` to ``all`` or to a comma-separated list of entry-point
names to keep them from loading.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import attrs
import pluggy

from tokenswift import hookspecs, interfaces
from tokenswift.errors import PluginError, SpecError
from tokenswift.spec import COMPONENT_KINDS, ComponentSpec

logger = logging.getLogger(__name__)

hookimpl = pluggy.HookimplMarker("tokenswift")
ENTRY_POINT_GROUP = "tokenswift"
DISABLE_ENV = "TOKENSWIFT_DISABLE_PLUGINS"
BUILTIN_ORIGIN = "built-in"

INTERFACES: dict[str, type] = {
    "drafter": interfaces.Drafter,
    "retriever": interfaces.Retriever,
    "cache": interfaces.CachePolicy,
    "verifier": interfaces.Verifier,
    "penalty": interfaces.Penalty,
}


@attrs.frozen(kw_only=True)
class ComponentInfo:
    kind: str
    name: str
    cls: type
    origin: str

    @property
    def summary(self) -> str:
        doc = (self.cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def option_defaults(self) -> dict[str, Any]:
        out = {}
        for field in attrs.fields(self.cls.Options):
            default = field.default
            if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                default = default.factory()
            out[field.name] = None if default is attrs.NOTHING else default
        return out


class Registry:
    """Components by kind and name, and presets by name."""

    def __init__(self) -> None:
        self._components: dict[str, dict[str, ComponentInfo]] = {kind: {} for kind in COMPONENT_KINDS}
        self.presets: dict[str, dict[str, Any]] = {}
        self.preset_origins: dict[str, str] = {}

    def add(self, kind: str, name: str, cls: type, *, origin: str) -> None:
        if kind not in self._components:
            raise PluginError(f"{origin}: unknown component kind {kind!r}; valid kinds: {list(COMPONENT_KINDS)}")
        if not isinstance(name, str) or not name:
            raise PluginError(f"{origin}: a {kind} name must be a non-empty string, got {name!r}")
        if not (isinstance(cls, type) and issubclass(cls, INTERFACES[kind])):
            raise PluginError(
                f"{origin}: {kind} {name!r} must be a subclass of tokenswift.interfaces."
                f"{INTERFACES[kind].__name__}, got {cls!r}"
            )
        if not attrs.has(getattr(cls, "Options", None)):
            raise PluginError(f"{origin}: {kind} {name!r} needs an attrs class `Options` (its options)")
        existing = self._components[kind].get(name)
        if existing is not None:
            raise PluginError(f"{origin}: {kind} name {name!r} is already registered by {existing.origin}")
        self._components[kind][name] = ComponentInfo(kind=kind, name=name, cls=cls, origin=origin)

    def add_preset(self, name: str, spec: Mapping[str, Any], *, origin: str) -> None:
        if name in self.presets:
            raise PluginError(f"{origin}: preset {name!r} is already registered by {self.preset_origins[name]}")
        self.presets[name] = dict(spec)
        self.preset_origins[name] = origin

    def names(self, kind: str) -> list[str]:
        return sorted(self._components[kind])

    def components(self) -> list[ComponentInfo]:
        return [info for kind in COMPONENT_KINDS for _, info in sorted(self._components[kind].items())]

    def get(self, kind: str, name: str) -> ComponentInfo:
        info = self._components[kind].get(name)
        if info is None:
            raise SpecError(f"unknown {kind} {name!r}; valid {kind}s: {self.names(kind)}")
        return info

    def make_options(self, kind: str, spec: ComponentSpec):
        info = self.get(kind, spec.name)
        options_cls = info.cls.Options
        valid = info.option_defaults()
        unknown = sorted(set(spec.options) - set(valid))
        if unknown:
            listing = ", ".join(f"{k} (default {v!r})" for k, v in valid.items()) or "none"
            raise SpecError(f"{kind} {spec.name!r} has no option(s) {unknown}; valid options: {listing}")
        try:
            return options_cls(**spec.options)
        except SpecError:
            raise
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{kind} {spec.name!r}: invalid option: {exc}") from None

    def build(self, kind: str, spec: ComponentSpec, context: interfaces.BuildContext):
        options = self.make_options(kind, spec)
        return self.get(kind, spec.name).cls(options, context)


class Registrar:
    """What ``tokenswift_register_components`` receives: adds to a registry on behalf
    of one plugin, so that every entry records where it came from."""

    def __init__(self, registry: Registry, origin: str) -> None:
        self._registry = registry
        self.origin = origin

    def add(self, kind: str, name: str, cls: type) -> None:
        self._registry.add(kind, name, cls, origin=self.origin)

    def add_preset(self, name: str, spec: Mapping[str, Any]) -> None:
        self._registry.add_preset(name, spec, origin=self.origin)


def _disabled_plugins() -> set[str] | None:
    """Entry-point names not to load; None means load none at all."""
    value = os.environ.get(DISABLE_ENV, "").strip()
    if value.lower() in ("all", "1", "true", "*"):
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, remembering which distribution each plugin came from."""

    def __init__(self) -> None:
        super().__init__("tokenswift")
        self.origins: dict[str, str] = {}


def get_plugin_manager(*, load_entrypoints: bool = True) -> PluginManager:
    """A fresh manager: hook specs, built-ins, then entry-point plugins."""
    from tokenswift import builtins

    pm = PluginManager()
    pm.add_hookspecs(hookspecs)
    pm.register(builtins, name=BUILTIN_ORIGIN)
    disabled = _disabled_plugins()
    if load_entrypoints and disabled is not None:
        _load_entrypoints(pm, disabled)
    pm.check_pending()
    return pm


def _load_entrypoints(pm: PluginManager, disabled: set[str]) -> None:
    from importlib import metadata

    for dist in metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP or ep.name in disabled or pm.get_plugin(ep.name) is not None:
                continue
            where = f"plugin {ep.name!r} from {dist.metadata['name']} {dist.version}"
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"{where} failed to import: {type(exc).__name__}: {exc} "
                    f"(set {DISABLE_ENV}={ep.name} to skip it)"
                ) from exc
            pm.register(plugin, name=ep.name)
            pm.origins[ep.name] = f"{dist.metadata['name']} {dist.version} (plugin {ep.name!r})"


def plugin_origin(pm: pluggy.PluginManager, plugin: object) -> str:
    name = pm.get_name(plugin) or repr(plugin)
    if name == BUILTIN_ORIGIN:
        return BUILTIN_ORIGIN
    return getattr(pm, "origins", {}).get(name, f"plugin {name!r}")


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every plugin's ``tokenswift_register_components`` with its own registrar."""
    registry = Registry()
    # get_hookimpls() lists plugins in registration order: built-ins first.
    for impl in pm.hook.tokenswift_register_components.get_hookimpls():
        origin = plugin_origin(pm, impl.plugin)
        try:
            impl.function(registrar=Registrar(registry, origin))
        except (PluginError, SpecError):
            raise
        except Exception as exc:
            raise PluginError(f"{origin} failed while registering components: {type(exc).__name__}: {exc}") from exc
    return registry
