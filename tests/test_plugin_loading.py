"""Loading third-party plugins from entry points: failures are one clear message naming
the plugin and its distribution, and an environment variable keeps plugins out."""

import sys
import types
from importlib import metadata

import pytest

from tokenswift import PluginError, hookimpl
from tokenswift.cli import main
from tokenswift.interfaces import Penalty, Retriever
from tokenswift.registry import build_registry, get_plugin_manager


class FakeDistribution:
    def __init__(self, name, version, entry_points):
        self.metadata = {"name": name}
        self.version = version
        self.entry_points = [metadata.EntryPoint(ep, value, "tokenswift") for ep, value in entry_points]


def install(monkeypatch, *dists):
    monkeypatch.setattr(metadata, "distributions", lambda: list(dists))
    monkeypatch.delenv("TOKENSWIFT_DISABLE_PLUGINS", raising=False)


def plugin_module(monkeypatch, name, register):
    module = types.ModuleType(name)
    module.tokenswift_register_components = hookimpl(register)
    monkeypatch.setitem(sys.modules, name, module)
    return module


class Halve(Penalty):
    """Halves scores."""

    def apply(self, contexts, scores):
        return scores * 0.5


def test_a_plugin_that_fails_to_import(monkeypatch):
    install(monkeypatch, FakeDistribution("broken-dist", "1.2.3", [("broken", "no_such_module_xyz")]))
    with pytest.raises(PluginError, match=r"plugin 'broken' from broken-dist 1.2.3 failed to import: ModuleNotFoundError.*TOKENSWIFT_DISABLE_PLUGINS=broken"):
        get_plugin_manager()


def test_a_plugin_that_takes_a_built_in_name(monkeypatch):
    plugin_module(monkeypatch, "fake_dupe", lambda registrar: registrar.add("penalty", "contextual", Halve))
    install(monkeypatch, FakeDistribution("dupe-dist", "0.1", [("dupe", "fake_dupe")]))
    with pytest.raises(PluginError, match=r"dupe-dist 0.1 \(plugin 'dupe'\): penalty name 'contextual' is already registered by built-in"):
        build_registry(get_plugin_manager())


def test_two_plugins_with_the_same_name(monkeypatch):
    plugin_module(monkeypatch, "fake_one", lambda registrar: registrar.add("penalty", "halve", Halve))
    plugin_module(monkeypatch, "fake_two", lambda registrar: registrar.add("penalty", "halve", Halve))
    install(monkeypatch, FakeDistribution("one", "1.0", [("one", "fake_one")]), FakeDistribution("two", "2.0", [("two", "fake_two")]))
    with pytest.raises(PluginError, match=r"two 2.0 \(plugin 'two'\): penalty name 'halve' is already registered by one 1.0 \(plugin 'one'\)"):
        build_registry(get_plugin_manager())


def test_a_plugin_registering_the_wrong_interface(monkeypatch):
    plugin_module(monkeypatch, "fake_wrong", lambda registrar: registrar.add("penalty", "oops", Retriever))
    install(monkeypatch, FakeDistribution("wrong-dist", "0.2", [("wrong", "fake_wrong")]))
    with pytest.raises(PluginError, match=r"wrong-dist 0.2 \(plugin 'wrong'\): penalty 'oops' must be a subclass of tokenswift.interfaces.Penalty"):
        build_registry(get_plugin_manager())


def test_a_plugin_that_crashes_while_registering(monkeypatch):
    def register(registrar):
        raise RuntimeError("boom")

    plugin_module(monkeypatch, "fake_crash", register)
    install(monkeypatch, FakeDistribution("crash-dist", "0.3", [("crash", "fake_crash")]))
    with pytest.raises(PluginError, match=r"crash-dist 0.3 \(plugin 'crash'\) failed while registering components: RuntimeError: boom"):
        build_registry(get_plugin_manager())


def test_a_good_plugin_is_listed_with_its_distribution(monkeypatch, capsys):
    plugin_module(monkeypatch, "fake_good", lambda registrar: registrar.add("penalty", "halve", Halve))
    install(monkeypatch, FakeDistribution("good-dist", "3.1", [("good", "fake_good")]))
    assert build_registry(get_plugin_manager()).get("penalty", "halve").origin == "good-dist 3.1 (plugin 'good')"
    assert main(["components"]) == 0
    assert "halve            [good-dist 3.1 (plugin 'good')] Halves scores." in capsys.readouterr().out


def test_disabling_plugins_by_name_or_all(monkeypatch, capsys):
    plugin_module(monkeypatch, "fake_good", lambda registrar: registrar.add("penalty", "halve", Halve))
    install(
        monkeypatch,
        FakeDistribution("broken-dist", "1.2.3", [("broken", "no_such_module_xyz")]),
        FakeDistribution("good-dist", "3.1", [("good", "fake_good")]),
    )
    monkeypatch.setenv("TOKENSWIFT_DISABLE_PLUGINS", "broken")
    assert "halve" in build_registry(get_plugin_manager()).names("penalty")
    monkeypatch.setenv("TOKENSWIFT_DISABLE_PLUGINS", "all")
    assert "halve" not in build_registry(get_plugin_manager()).names("penalty")
    monkeypatch.delenv("TOKENSWIFT_DISABLE_PLUGINS")
    assert main(["components"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plugin 'broken' from broken-dist 1.2.3 failed to import" in err
