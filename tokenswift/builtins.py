"""The built-in components and presets, registered through the same hook as plugins."""

from __future__ import annotations

import pluggy

from tokenswift.caches.full import FullCache
from tokenswift.drafters.none import NoDrafter
from tokenswift.penalties.contextual import ContextualPenalty
from tokenswift.penalties.none import NoPenalty
from tokenswift.presets import PRESETS
from tokenswift.retrievers.none import NoRetriever
from tokenswift.verifiers.greedy import GreedyVerifier
from tokenswift.verifiers.tree_sampling import TreeSamplingVerifier

hookimpl = pluggy.HookimplMarker("tokenswift")

COMPONENTS = {
    "drafter": {"none": NoDrafter},
    "retriever": {"none": NoRetriever},
    "cache": {"full": FullCache},
    "verifier": {"tree-sampling": TreeSamplingVerifier, "greedy": GreedyVerifier},
    "penalty": {"none": NoPenalty, "contextual": ContextualPenalty},
}


@hookimpl
def tokenswift_register_components(registrar) -> None:
    for kind, by_name in COMPONENTS.items():
        for name, cls in by_name.items():
            registrar.add(kind, name, cls)
    for name, spec in PRESETS.items():
        registrar.add_preset(name, spec)
