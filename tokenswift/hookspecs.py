"""Hook specifications of tokenswift, grouped by phase.

Implement them in a plugin module or class decorated with
``tokenswift.hookimpl`` and expose it through the ``tokenswift`` entry-point group.
"""

from __future__ import annotations

import pluggy

# The hooks' argument types are named, not imported: the pipeline and the registry
# import this module, so importing them back would make a circle.
hookspec = pluggy.HookspecMarker("tokenswift")


# -- registration (once per plugin manager) --------------------------------------


@hookspec
def tokenswift_register_components(registrar: tokenswift.registry.Registrar) -> None:
    """Add components and presets.

    Called once for each plugin when a registry is built (every built-in component is
    added the same way). Use ``registrar.add(kind, name, cls)`` with ``kind`` one of
    drafter / retriever / cache / verifier / penalty and ``cls`` a subclass of the
    matching interface in :mod:`tokenswift.interfaces`; and
    ``registrar.add_preset(name, spec_dict)``. Names must be unique across plugins.
    """


# -- generation (observers: return values are ignored) ------------------------------


@hookspec
def tokenswift_generation_start(pipeline: tokenswift.Pipeline, prompt_ids: list[int], max_new_tokens: int) -> None:
    """A generation starts (the prompt is tokenized, nothing is computed yet)."""


@hookspec
def tokenswift_step_end(pipeline: tokenswift.Pipeline, step: tokenswift.StepRecord) -> None:
    """One decoding step has been committed; ``step`` says what it proposed and emitted."""


@hookspec
def tokenswift_generation_end(pipeline: tokenswift.Pipeline, result: tokenswift.GenerationResult) -> None:
    """A generation ended (length, EOS, or an error that kept the text so far)."""
