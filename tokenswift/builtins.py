"""The built-in components and presets, registered through the same hook as plugins."""

from __future__ import annotations

import pluggy

from tokenswift.caches.dynamic import DynamicPolicy
from tokenswift.caches.full import FullPolicy
from tokenswift.caches.streaming import StreamingPolicy
from tokenswift.drafters.eagle import EagleDrafter
from tokenswift.drafters.medusa import MedusaDrafter
from tokenswift.drafters.none import NoDrafter
from tokenswift.drafters.tokenswift import TokenSwiftDrafter
from tokenswift.penalties.contextual import ContextualPenalty
from tokenswift.penalties.none import NoPenalty
from tokenswift.presets import PRESETS
from tokenswift.retrievers.ngram import NgramRetriever
from tokenswift.retrievers.none import NoRetriever
from tokenswift.retrievers.prompt_lookup import PromptLookupRetriever
from tokenswift.verifiers.greedy import GreedyVerifier
from tokenswift.verifiers.rejection import RejectionVerifier
from tokenswift.verifiers.tree_sampling import TreeSamplingVerifier

hookimpl = pluggy.HookimplMarker("tokenswift")

COMPONENTS = {
    "drafter": {"none": NoDrafter, "tokenswift": TokenSwiftDrafter, "medusa": MedusaDrafter, "eagle": EagleDrafter},
    "retriever": {"none": NoRetriever, "ngram": NgramRetriever, "prompt-lookup": PromptLookupRetriever},
    "cache": {"full": FullPolicy, "dynamic": DynamicPolicy, "streaming": StreamingPolicy},
    "verifier": {"tree-sampling": TreeSamplingVerifier, "greedy": GreedyVerifier, "rejection": RejectionVerifier},
    "penalty": {"none": NoPenalty, "contextual": ContextualPenalty},
}


@hookimpl
def tokenswift_register_components(registrar) -> None:
    for kind, by_name in COMPONENTS.items():
        for name, cls in by_name.items():
            registrar.add(kind, name, cls)
    for name, spec in PRESETS.items():
        registrar.add_preset(name, spec)
