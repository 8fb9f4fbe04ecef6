"""The plugin manager, the registry and the observer hooks."""

import pytest
import torch

from tokenswift import Pipeline, PluginError, get_plugin_manager, hookimpl
from tokenswift.hookspecs import __dict__ as hookspec_namespace
from tokenswift.interfaces import Penalty, Retriever
from tokenswift.registry import build_registry
from tokenswift.testing import tiny_model_for


def hook_names():
    return sorted(name for name in hookspec_namespace if name.startswith("tokenswift_"))


def test_every_hook_is_specified_and_documented():
    pm = get_plugin_manager()
    for name in hook_names():
        assert hasattr(pm.hook, name)
        assert hookspec_namespace[name].__doc__, f"{name} has no docstring"


def test_builtins_register_through_the_hook():
    registry = build_registry(get_plugin_manager())
    assert registry.names("verifier") == ["greedy", "rejection", "tree-sampling"]
    assert {info.origin for info in registry.components()} == {"built-in"}
    assert "ar" in registry.presets


class Recorder:
    def __init__(self):
        self.events = []

    @hookimpl
    def tokenswift_generation_start(self, pipeline, prompt_ids, max_new_tokens):
        self.events.append(("start", len(prompt_ids), max_new_tokens))

    @hookimpl
    def tokenswift_step_end(self, pipeline, step):
        self.events.append(("step", step.step, step.generated, tuple(step.emitted)))

    @hookimpl
    def tokenswift_generation_end(self, pipeline, result):
        self.events.append(("end", tuple(result.tokens)))


def test_observer_hooks_see_every_step():
    pm = get_plugin_manager()
    recorder = Recorder()
    pm.register(recorder)
    try:
        pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha"), plugin_manager=pm)
        result = pipe.generate([1, 2, 3], 5, seed=0, ignore_eos=True)
    finally:
        pm.unregister(recorder)
    assert recorder.events[0] == ("start", 3, 5)
    steps = [e for e in recorder.events if e[0] == "step"]
    assert [s[1] for s in steps] == [1, 2, 3, 4, 5] and steps[-1][2] == 5
    assert [t for s in steps for t in s[3]] == result.tokens
    assert recorder.events[-1] == ("end", tuple(result.tokens))


class DoublePenalty(Penalty):
    """Halves every score: a deliberately simple third-party penalty."""

    def apply(self, contexts, scores):
        return scores * 0.5


class ThirdParty:
    @hookimpl
    def tokenswift_register_components(self, registrar):
        registrar.add("penalty", "halve", DoublePenalty)
        registrar.add_preset("ar-halved", {"preset": None, "penalty": {"name": "halve"}, "sampling": {"greedy": True}})


def test_a_registered_plugin_component_is_usable_by_name():
    pm = get_plugin_manager()
    pm.register(ThirdParty(), name="third-party")
    pipe = Pipeline.from_spec({"preset": "ar", "penalty": {"name": "halve"}}, tiny_model_for("llama-mha"), plugin_manager=pm)
    assert isinstance(pipe.penalty, DoublePenalty)
    info = pipe.registry.get("penalty", "halve")
    assert info.origin == "plugin 'third-party'"
    assert "ar-halved" in pipe.registry.presets


class Duplicate:
    @hookimpl
    def tokenswift_register_components(self, registrar):
        registrar.add("penalty", "contextual", DoublePenalty)


class WrongInterface:
    @hookimpl
    def tokenswift_register_components(self, registrar):
        registrar.add("penalty", "not-a-penalty", Retriever)


class BadKind:
    @hookimpl
    def tokenswift_register_components(self, registrar):
        registrar.add("sampler", "x", DoublePenalty)


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (Duplicate(), r"plugin 'bad': penalty name 'contextual' is already registered by built-in"),
        (WrongInterface(), r"plugin 'bad': penalty 'not-a-penalty' must be a subclass of tokenswift.interfaces.Penalty"),
        (BadKind(), r"plugin 'bad': unknown component kind 'sampler'"),
    ],
)
def test_bad_registrations_name_the_plugin(plugin, message):
    pm = get_plugin_manager()
    pm.register(plugin, name="bad")
    with pytest.raises(PluginError, match=message):
        build_registry(pm)


def test_pipeline_repr_and_max_tree_nodes():
    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-mha"))
    assert repr(pipe) == "Pipeline(drafter='none', retriever='none', cache='full', verifier='tree-sampling', penalty='contextual')"
    assert pipe.max_tree_nodes() == 1
    assert torch.is_tensor(pipe.runner.lm_head.weight)
