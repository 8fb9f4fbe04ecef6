"""tokenswift: lossless acceleration of ultra-long generation (TokenSwift) as a framework
of swappable parts.

    >>> from tokenswift import Pipeline
    >>> pipe = Pipeline.from_spec("ar", overrides={"model": {"path": "smollm2"}})  # doctest: +SKIP
    >>> pipe.generate("Once upon a time", max_new_tokens=50, seed=0).text  # doctest: +SKIP
"""

from tokenswift.memory import cap_native_caches

cap_native_caches()  # before the process's first oneDNN product: see tokenswift.memory

from tokenswift.errors import ModelLoadError, PluginError, SpecError, TokenswiftError
from tokenswift.pipeline import GenerationResult, GenerationStats, Pipeline, StepRecord, StreamChunk
from tokenswift.registry import get_plugin_manager, hookimpl
from tokenswift.spec import ComponentSpec, ModelSpec, PipelineSpec, SamplingSpec, SpeculationSpec

__version__ = "0.1.0"

__all__ = [
    "ComponentSpec",
    "GenerationResult",
    "GenerationStats",
    "ModelLoadError",
    "ModelSpec",
    "Pipeline",
    "PipelineSpec",
    "PluginError",
    "SamplingSpec",
    "SpeculationSpec",
    "SpecError",
    "StepRecord",
    "StreamChunk",
    "TokenswiftError",
    "get_plugin_manager",
    "hookimpl",
]
