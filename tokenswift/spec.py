"""Specs: frozen, validated attrs classes describing a pipeline.

A spec is given as a dict, a TOML file, a preset name, or a preset plus overrides
(see :func:`PipelineSpec.parse`). Component options are validated later, by the
component's own ``Options`` class, when the registry builds it.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from tokenswift.errors import SpecError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

COMPONENT_KINDS = ("drafter", "retriever", "cache", "verifier", "penalty")
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEVICES = ("cpu", "cuda")


def _frozen_options(value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"component options must be a table/dict, got {value!r}")
    return dict(value)


@attrs.frozen(kw_only=True)
class ComponentSpec:
    """One component: its registered ``name`` and its options (validated by the component)."""

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    options: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_options, hash=False)

    @classmethod
    def from_value(cls, kind: str, value: Any) -> ComponentSpec:
        if isinstance(value, ComponentSpec):
            return value
        if isinstance(value, str):
            return cls(name=value)
        if not isinstance(value, Mapping):
            raise SpecError(f"[{kind}] must be a table with a 'name', or a name string; got {value!r}")
        if "name" not in value:
            raise SpecError(f"[{kind}] needs a 'name' (got keys {sorted(value)})")
        options = {k: v for k, v in value.items() if k != "name"}
        name = value["name"]
        if not isinstance(name, str):
            raise SpecError(f"[{kind}] name must be a string, got {name!r}")
        return cls(name=name, options=options)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.options}


def _from_table(cls, section: str, value: Any):
    """A spec section's attrs class from a table, rejecting unknown keys by name."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise SpecError(f"[{section}] must be a table, got {value!r}")
    valid = [f.name for f in attrs.fields(cls)]
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise SpecError(f"[{section}] has unknown option(s) {unknown}; valid: {valid}")
    return cls(**value)


def _optional(convert):
    return attrs.converters.optional(convert)


def _in_range(name: str, low: float, high: float, *, low_open=False, high_open=False):
    def check(_instance, _attribute, value):
        if value is None:
            return
        ok_low = value > low if low_open else value >= low
        ok_high = value < high if high_open else value <= high
        if not (ok_low and ok_high) or (isinstance(value, float) and math.isnan(value)):
            lo = "(" if low_open else "["
            hi = ")" if high_open else "]"
            raise SpecError(f"sampling.{name} must be in {lo}{low}, {high}{hi}, got {value!r}")

    return check


def _number(name: str, kind):
    def convert(value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise SpecError(f"sampling.{name} must be a number, got {value!r}")
        try:
            return kind(value)
        except ValueError:
            raise SpecError(f"sampling.{name} must be a number, got {value!r}") from None

    return convert


def _bool(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise SpecError(f"sampling.greedy must be true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class SamplingSpec:
    """Greedy decoding, or sampling with transformers' warpers in HF's order:
    temperature, top-k, top-p, min-p, eta."""

    greedy: bool = attrs.field(default=False, converter=_bool)
    temperature: float = attrs.field(
        default=1.0, converter=_number("temperature", float), validator=_in_range("temperature", 0, math.inf, low_open=True, high_open=True)
    )
    top_k: int | None = attrs.field(default=None, converter=_number("top_k", int), validator=_in_range("top_k", 1, math.inf))
    top_p: float | None = attrs.field(
        default=None, converter=_number("top_p", float), validator=_in_range("top_p", 0, 1, low_open=True)
    )
    min_p: float | None = attrs.field(default=None, converter=_number("min_p", float), validator=_in_range("min_p", 0, 1))
    eta: float | None = attrs.field(
        default=None, converter=_number("eta", float), validator=_in_range("eta", 0, 1, low_open=True, high_open=True)
    )
    # "keyed": Gumbel-max with noise keyed by (seed, position, token), which drafters can
    # couple to; "coupled": the same with a Philox vector per (seed, position); "inverse-cdf":
    # one uniform per token in order (checkpoints written before each resume with theirs).
    sampler: str = attrs.field(default="keyed")

    @sampler.validator
    def _check_sampler(self, attribute, value):
        if value not in ("keyed", "coupled", "inverse-cdf"):
            raise SpecError(f"sampling.sampler must be one of ['keyed', 'coupled', 'inverse-cdf'], got {value!r}")

    def __attrs_post_init__(self):
        if self.greedy and (self.top_k or self.top_p or self.min_p or self.eta or self.temperature != 1.0):
            raise SpecError("sampling: greedy = true takes no temperature, top_k, top_p, min_p or eta")

    @classmethod
    def from_value(cls, value: Any) -> SamplingSpec:
        return _from_table(cls, "sampling", value)

    def to_dict(self) -> dict[str, Any]:
        if self.greedy:
            return {"greedy": True}
        return {k: v for k, v in attrs.asdict(self).items() if v is not None and k != "greedy"}


TREE_MODES = ("auto", "fixed")


# The most tokens a drafting pass is taken to add to a step (over the same step drafted
# without it), by default (``speculation.pass_gain``, read by
# ``AutoSpeculator.pass_can_pay``). The pass makes depth 1 the target's own choice over
# the view: greedy, depth-1 agreement rises from the layer's ~55% to
# ~70-90%, so with chains accepted ~45% a level deeper a step gains at most
# (0.8 - 0.55) / (1 - 0.45) ~ 0.45 token. Measured with auto trees (2-core AMD EPYC Zen 4):
# at 8K, greedy, steps with a pass emitted 1.83 tokens against 1.37-1.57 without; at 32K
# with 0.5 passes ran (0.28 a step greedy) and the preset was no faster than without them
# (1.036x against 1.048x ``ar`` greedy, 0.949x against 0.969x sampling); on a Sapphire
# Rapids at 32K, four runs of five were slower with passes than ``eagle`` without.
PASS_GAIN = 0.3


@attrs.frozen(kw_only=True)
class SpeculationSpec:
    """How each step's tree is chosen. ``tree = "auto"``: the candidates worth verifying
    on this machine, by expected tokens per predicted second (possibly none: a plain
    step); ``"fixed"``: every candidate, and the drafting pass every step (the paper's
    setting, for ablations). ``max_nodes``: the most candidates verified in one step.
    ``plain_guard`` (auto trees): steps that speculate are also compared with plain
    steps by the tokens per second each realises, and the faster kept (the cost model
    prices forwards and proposals, not everything a speculative step takes); off, the
    cost model alone decides (for ablations of its choices). ``pass_gain`` (auto trees):
    the most tokens a drafting pass over a partial view is taken to add to a step; a
    pass that costs more than that many tokens at the context (one-token forwards, as
    the cost model prices them) is never tried (a large value leaves every pass to the
    pass chooser's measurements; 0: no passes)."""

    tree: str = attrs.field(default="auto")
    max_nodes: int = attrs.field(default=64)
    plain_guard: bool = attrs.field(default=True)
    pass_gain: float = attrs.field(default=PASS_GAIN)

    @tree.validator
    def _check_tree(self, _attribute, value):
        if value not in TREE_MODES:
            raise SpecError(f"speculation.tree must be one of {list(TREE_MODES)}, got {value!r}")

    @max_nodes.validator
    def _check_max_nodes(self, _attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecError(f"speculation.max_nodes must be an integer >= 0, got {value!r}")

    @plain_guard.validator
    def _check_plain_guard(self, _attribute, value):
        if not isinstance(value, bool):
            raise SpecError(f"speculation.plain_guard must be true or false, got {value!r}")

    @pass_gain.validator
    def _check_pass_gain(self, _attribute, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise SpecError(f"speculation.pass_gain must be a number >= 0, got {value!r}")

    @classmethod
    def from_value(cls, value: Any) -> SpeculationSpec:
        return _from_table(cls, "speculation", value)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


ROPE_TYPES = ("yarn", "linear", "dynamic")


def _rope(value):
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SpecError(f"model.rope must be a table like {{type = \"yarn\", factor = 16}}, got {value!r}")
    unknown = sorted(set(value) - {"type", "factor"})
    if unknown:
        raise SpecError(f"model.rope has unknown key(s) {unknown}; valid: ['type', 'factor']")
    kind = value.get("type", "yarn")
    if kind not in ROPE_TYPES:
        raise SpecError(f"model.rope.type must be one of {list(ROPE_TYPES)}, got {kind!r}")
    factor = value.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise SpecError(f"model.rope.factor must be a number > 1, got {factor!r}")
    return {"type": kind, "factor": float(factor)}


def parse_rope(text: str | None) -> dict[str, Any] | None:
    """A command line's ``TYPE:FACTOR`` (e.g. ``yarn:16``; ``none`` for no override) as a
    validated ``model.rope`` table."""
    if text is None or text == "none":
        return None
    kind, _, factor = text.partition(":")
    try:
        factor = float(factor)
    except ValueError:
        raise SpecError(f"a RoPE override must be TYPE:FACTOR like 'yarn:16', got {text!r}") from None
    return _rope({"type": kind, "factor": factor})


def _dtype(value):
    if value not in DTYPES:
        raise SpecError(f"model.dtype must be one of {list(DTYPES)}, got {value!r}")
    return value


RUN_ONLY = ("compile", "prefill_dtype")  # [model] keys that apply to a model passed in
PREFILL_DTYPES = ("auto", "model", "float32", "bfloat16", "float64")


def _prefill_dtype(value):
    if value not in PREFILL_DTYPES:
        raise SpecError(f"model.prefill_dtype must be one of {list(PREFILL_DTYPES)}, got {value!r}")
    return value


def _device(value):
    if not isinstance(value, str) or value.split(":")[0] not in DEVICES:
        raise SpecError(f"model.device must be one of {list(DEVICES)} (optionally 'cuda:N'), got {value!r}")
    return value


def _compile(value):
    """``"auto"``, True or False (also spelled as strings, as the CLI passes them)."""
    if isinstance(value, str):
        value = {"true": True, "false": False, "auto": "auto"}.get(value.lower(), value)
    if value is True or value is False or value == "auto":
        return value
    raise SpecError(f"model.compile must be \"auto\", true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class ModelSpec:
    """Where the model comes from.

    ``path``: a local transformers directory, a ``.gguf`` file, or the name of a
    packaged model (``smollm2``). ``tiny``: a config dict for a random model (tests,
    docs), with ``seed``. ``dtype``/``device`` apply to all; ``dtype = "auto"`` is
    the fastest for this machine (:mod:`tokenswift.model.dtypes`).
    """

    path: str | None = attrs.field(default=None, converter=_optional(os.fspath))
    tiny: dict[str, Any] | None = attrs.field(default=None, hash=False)
    seed: int = attrs.field(default=0, converter=int)
    dtype: str = attrs.field(default="auto", validator=lambda i, a, v: _dtype(v))
    device: str = attrs.field(default="cpu", validator=lambda i, a, v: _device(v))
    # RoPE-scaling override for runs past the trained context, e.g. {type = "yarn", factor = 16}.
    rope: dict[str, Any] | None = attrs.field(default=None, converter=lambda v: _rope(v), hash=False)
    # Compiled one-token forwards (tokenswift.model.compiled): "auto" compiles where the
    # calibration measured it faster and the run is long enough to repay compiling.
    compile: str | bool = attrs.field(default="auto", converter=_compile)
    # The dtype the prompt's prefill computes in (tokenswift.model.dtypes.prefill_dtype):
    # "auto" is float32 for a bfloat16 model on a CPU without native bfloat16 (a 2K
    # prefill 5x faster there), and on one with AVX512-BF16 but no AMX for prompts of
    # 256+ tokens where a probe measures float32 faster; else the model's own. The KV is
    # stored in the model's dtype.
    prefill_dtype: str = attrs.field(default="auto", validator=lambda i, a, v: _prefill_dtype(v))

    def __attrs_post_init__(self):
        if self.compile_only:
            return  # a model object passed in, with only this section's compile choice
        if (self.path is None) == (self.tiny is None):
            raise SpecError("[model] needs exactly one of 'path' (a directory, .gguf file or packaged model) or 'tiny' (a config dict)")
        if self.tiny is not None and not isinstance(self.tiny, Mapping):
            raise SpecError(f"model.tiny must be a config table, got {self.tiny!r}")

    @property
    def compile_only(self) -> bool:
        """No model to load, only how it runs (compile, prefill dtype: for a model passed in)."""
        defaults = ModelSpec.__attrs_attrs__
        return self.path is None and self.tiny is None and all(
            getattr(self, a.name) == a.default for a in defaults if a.name not in RUN_ONLY
        )

    @classmethod
    def from_value(cls, value: Any) -> ModelSpec:
        if isinstance(value, ModelSpec):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(path=value)
        if not isinstance(value, Mapping):
            raise SpecError(f"[model] must be a table or a path, got {value!r}")
        return _from_table(cls, "model", value)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


@attrs.frozen(kw_only=True)
class PipelineSpec:
    """The whole pipeline: model (optional when a model object is passed in), the five
    components, the sampling settings and how trees are chosen."""

    model: ModelSpec | None = None
    drafter: ComponentSpec = ComponentSpec(name="none")
    retriever: ComponentSpec = ComponentSpec(name="none")
    cache: ComponentSpec = ComponentSpec(name="full")
    verifier: ComponentSpec = ComponentSpec(name="tree-sampling")
    penalty: ComponentSpec = ComponentSpec(name="none")
    sampling: SamplingSpec = SamplingSpec()
    speculation: SpeculationSpec = SpeculationSpec()
    preset: str | None = None

    def component(self, kind: str) -> ComponentSpec:
        return getattr(self, kind)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.preset is not None:
            out["preset"] = self.preset
        if self.model is not None:
            out["model"] = self.model.to_dict()
        for kind in COMPONENT_KINDS:
            out[kind] = self.component(kind).to_dict()
        out["sampling"] = self.sampling.to_dict()
        out["speculation"] = self.speculation.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], presets: Mapping[str, Mapping[str, Any]]) -> PipelineSpec:
        """Build a spec from a dict; a ``preset`` key fills whatever is not given."""
        if not isinstance(data, Mapping):
            raise SpecError(f"a spec must be a table/dict, got {type(data).__name__}")
        valid = ["preset", "model", *COMPONENT_KINDS, "sampling", "speculation"]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise SpecError(f"spec has unknown section(s) {unknown}; valid: {valid}")
        preset = data.get("preset")
        merged: dict[str, Any] = {}
        if preset is not None:
            if preset not in presets:
                raise SpecError(f"unknown preset {preset!r}; valid presets: {sorted(presets)}")
            merged = copy.deepcopy(dict(presets[preset]))
        for key, value in data.items():
            if key == "preset":
                continue
            merged[key] = _merge_section(key, merged.get(key), value)
        kwargs: dict[str, Any] = {"preset": preset}
        if merged.get("model") is not None:
            kwargs["model"] = ModelSpec.from_value(merged["model"])
        for kind in COMPONENT_KINDS:
            if kind in merged:
                kwargs[kind] = ComponentSpec.from_value(kind, merged[kind])
        if "sampling" in merged:
            kwargs["sampling"] = SamplingSpec.from_value(merged["sampling"])
        if "speculation" in merged:
            kwargs["speculation"] = SpeculationSpec.from_value(merged["speculation"])
        return cls(**kwargs)


def _merge_section(key: str, base: Any, override: Any) -> Any:
    """Overrides on top of a preset's section.

    Components: a different ``name`` replaces the whole section (the base component's
    options would not apply); the same name merges options. Sampling: ``greedy = true``
    replaces everything; any other key turns greedy off and merges.
    """
    if base is None or not isinstance(base, Mapping) or not isinstance(override, Mapping):
        if key in COMPONENT_KINDS and isinstance(override, str) and isinstance(base, Mapping):
            return dict(base) if base.get("name") == override else {"name": override}
        return override
    if key in COMPONENT_KINDS:
        if "name" in override and override["name"] != base.get("name"):
            return dict(override)
        return {**base, **override}
    if key == "sampling":
        if _bool(override.get("greedy", False)):
            return dict(override)
        return {**{k: v for k, v in base.items() if k != "greedy"}, **override}
    return {**base, **override}


def merge_overrides(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` (a spec dict without ``preset``) on top of ``base``, section by section."""
    if not isinstance(overrides, Mapping):
        raise SpecError(f"overrides must be a dict, got {type(overrides).__name__}")
    if "preset" in overrides:
        raise SpecError("overrides cannot name a preset; pass the preset as the spec")
    merged = dict(base)
    for key, value in overrides.items():
        merged[key] = _merge_section(key, merged.get(key), value)
    return merged


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML spec file; errors name the file and the parser's complaint."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise SpecError(f"spec file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"malformed TOML in {path}: {exc}") from None
    except OSError as exc:
        raise SpecError(f"cannot read spec file {path}: {exc.strerror}") from None
