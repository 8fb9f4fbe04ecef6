"""Spec parsing and validation: every bad value is a ValueError that names it."""

import attrs
import pytest

from tokenswift import Pipeline, PipelineSpec, SpecError
from tokenswift.presets import PRESETS
from tokenswift.testing import tiny_model_for


@pytest.fixture(scope="module")
def model():
    return tiny_model_for("llama-mha")


def test_preset_fills_and_overrides_merge(model):
    pipe = Pipeline.from_spec({"preset": "ar", "penalty": {"window": 64}}, model)
    assert pipe.spec.preset == "ar"
    assert pipe.spec.penalty.name == "contextual"
    assert pipe.spec.penalty.options == {"value": 1.2, "window": 64}
    assert pipe.penalty.window == 64
    assert pipe.spec.sampling.min_p == 0.1


def test_greedy_override_replaces_warpers_and_warper_override_turns_greedy_off(model):
    greedy = Pipeline.from_spec("ar", model, overrides={"sampling": {"greedy": True}})
    assert greedy.spec.sampling.greedy and greedy.spec.sampling.min_p is None
    back = Pipeline.from_spec(greedy.spec, model, overrides={"sampling": {"temperature": 0.7}})
    assert not back.spec.sampling.greedy and back.spec.sampling.temperature == 0.7


def test_component_name_change_drops_the_old_options(model):
    pipe = Pipeline.from_spec("ar", model, overrides={"penalty": {"name": "none"}})
    assert pipe.spec.penalty.options == {}


def test_spec_round_trips_through_dict_and_evolve(model):
    pipe = Pipeline.from_spec("ar", model)
    again = PipelineSpec.from_dict(pipe.spec.to_dict(), PRESETS)
    assert again == pipe.spec
    variant = attrs.evolve(pipe.spec, preset=None)
    assert variant.penalty == pipe.spec.penalty


def test_toml_file(tmp_path, model):
    path = tmp_path / "spec.toml"
    path.write_text('preset = "ar"\n[penalty]\nname = "contextual"\nvalue = 1.5\nwindow = 32\n[sampling]\ngreedy = true\n')
    pipe = Pipeline.from_spec(path, model)
    assert pipe.spec.penalty.options == {"value": 1.5, "window": 32}
    assert pipe.spec.sampling.greedy
    assert Pipeline.from_spec(str(path), model).spec == pipe.spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonexistent-preset", r"unknown preset 'nonexistent-preset'; valid presets: \['ar', 'eagle', 'medusa', 'prompt-lookup', 'tokenswift'\]"),
        ({"preset": "bogus"}, r"unknown preset 'bogus'; valid presets: \['ar', 'eagle', 'medusa', 'prompt-lookup', 'tokenswift'\]"),
        ({"preset": "ar", "drafter": {"name": "wizard"}}, r"unknown drafter 'wizard'; valid drafters: \['eagle', 'medusa', 'none', 'tokenswift'\]"),
        ({"preset": "ar", "verifier": "nope"}, r"unknown verifier 'nope'; valid verifiers: \['greedy', 'rejection', 'tree-sampling'\]"),
        ({"preset": "ar", "penalty": {"value": 1.2, "windw": 5}}, r"no option\(s\) \['windw'\]; valid options: value \(default 1.2\), window \(default 1024\)"),
        ({"preset": "ar", "penalty": {"window": -1}}, r"penalty.window must be >= 0, got -1"),
        ({"preset": "ar", "penalty": {"window": "ten"}}, r"penalty.window must be an integer >= 0, got 'ten'"),
        ({"preset": "ar", "penalty": {"value": 0}}, r"penalty.value must be > 0"),
        ({"preset": "ar", "sampling": {"temperature": 0}}, r"sampling.temperature must be in \(0, inf\), got 0.0"),
        ({"preset": "ar", "sampling": {"top_p": 1.5}}, r"sampling.top_p must be in \(0, 1\], got 1.5"),
        ({"preset": "ar", "sampling": {"top_k": 0}}, r"sampling.top_k must be in \[1, inf\], got 0"),
        ({"preset": "ar", "sampling": {"min_p": "lots"}}, r"sampling.min_p must be a number, got 'lots'"),
        ({"preset": "ar", "sampling": {"temprature": 1}}, r"\[sampling\] has unknown option\(s\) \['temprature'\]"),
        ({"preset": "ar", "sampling": {"greedy": True, "top_k": 5}}, r"greedy = true takes no temperature"),
        ({"preset": "ar", "samplign": {}}, r"unknown section\(s\) \['samplign'\]"),
        ({"preset": "ar", "penalty": {"value": 2}, "verifier": {"name": "greedy"}}, r"verifier 'greedy' needs sampling.greedy = true"),
        ({"preset": "ar", "drafter": {"heads": 3}}, r"\[drafter\] needs a 'name'|no option"),
        ({"preset": "ar", "model": {"dtype": "int8", "path": "x"}}, r"model.dtype must be one of \['auto', 'float32', 'bfloat16', 'float16', 'float64'\], got 'int8'"),
        ({"preset": "ar", "model": {"device": "tpu", "path": "x"}}, r"model.device must be one of"),
        ({"preset": "ar", "model": {"dtype": "float32"}}, r"exactly one of 'path'"),
    ],
)
def test_bad_specs_raise_clear_value_errors(spec, message, model):
    with pytest.raises(ValueError, match=message) as info:
        Pipeline.from_spec(spec, model)
    assert isinstance(info.value, SpecError)


def test_malformed_toml(tmp_path, model):
    path = tmp_path / "broken.toml"
    path.write_text('preset = "ar"\n[penalty\nvalue = 1.2\n')
    with pytest.raises(SpecError, match=r"malformed TOML in .*broken.toml"):
        Pipeline.from_spec(path, model)


def test_missing_toml_file(tmp_path, model):
    with pytest.raises(SpecError, match="spec file not found"):
        Pipeline.from_spec(tmp_path / "missing.toml", model)


def test_overrides_cannot_name_a_preset(model):
    with pytest.raises(SpecError, match="overrides cannot name a preset"):
        Pipeline.from_spec("ar", model, overrides={"preset": "ar"})


def test_no_model_anywhere():
    with pytest.raises(SpecError, match="no model"):
        Pipeline.from_spec("ar")
