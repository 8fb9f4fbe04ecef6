"""Hook specifications of tokenswift, grouped by phase.

Implement them in a plugin module or class decorated with
``tokenswift.hookimpl`` and expose it through the ``tokenswift`` entry-point group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from tokenswift.pipeline import GenerationResult, Pipeline, StepRecord
    from tokenswift.registry import Registrar

hookspec = pluggy.HookspecMarker("tokenswift")


# -- registration (once per plugin manager) --------------------------------------


@hookspec
def tokenswift_register_components(registrar: Registrar) -> None:
    """Add components and presets.

    Called once for each plugin when a registry is built (every built-in component is
    added the same way). Use ``registrar.add(kind, name, cls)`` with ``kind`` one of
    drafter / retriever / cache / verifier / penalty and ``cls`` a subclass of the
    matching interface in :mod:`tokenswift.interfaces`; and
    ``registrar.add_preset(name, spec_dict)``. Names must be unique across plugins.
    """


# -- generation (observers: return values are ignored) ------------------------------


@hookspec
def tokenswift_generation_start(pipeline: Pipeline, prompt_ids: list[int], max_new_tokens: int) -> None:
    """A generation starts (the prompt is tokenized, nothing is computed yet)."""


@hookspec
def tokenswift_step_end(pipeline: Pipeline, step: StepRecord) -> None:
    """One decoding step has been committed; ``step`` says what it proposed and emitted."""


@hookspec
def tokenswift_generation_end(pipeline: Pipeline, result: GenerationResult) -> None:
    """A generation ended (length, EOS, or an error that kept the text so far)."""
