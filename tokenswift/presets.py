"""Built-in presets: named spec dicts that a spec can start from (``preset = "..."``).

Every preset shares the paper's sampling setting (temperature 1.0, min-p 0.1,
contextual penalty 1.2 over the last 1024 tokens), so that they are comparable and
all emit the same distribution as ``ar``.
"""

from __future__ import annotations

PAPER_SAMPLING = {"temperature": 1.0, "min_p": 0.1}
PAPER_PENALTY = {"name": "contextual", "value": 1.2, "window": 1024}


def _preset(drafter, retriever, cache):
    return {
        "drafter": drafter,
        "retriever": retriever,
        "cache": cache,
        "verifier": {"name": "tree-sampling"},
        "penalty": dict(PAPER_PENALTY),
        "sampling": dict(PAPER_SAMPLING),
    }


PRESETS: dict[str, dict] = {
    # Plain autoregressive decoding: the reference every other preset must equal.
    "ar": _preset({"name": "none"}, {"name": "none"}, {"name": "full"}),
    # The paper's method: heads after an extra forward over a dynamic partial cache,
    # 4-gram reuse (top 20), tree verification. The tree is the one fitted for the heads
    # (tree.json beside them, from `tokenswift fit-tree`), else the paper's [1, 3, 3, 3].
    "tokenswift": _preset(
        {"name": "tokenswift", "heads": "auto"},
        {"name": "ngram", "n": 4, "top_k": 20},
        {"name": "dynamic", "budget": 4096, "sink": 16},
    ),
    # Medusa: the heads on the verify pass's hidden state; no extra forward, no reuse.
    "medusa": _preset({"name": "medusa", "heads": "auto", "tree": [3, 3, 3]}, {"name": "none"}, {"name": "full"}),
    # EAGLE-style: one draft layer on the verify pass's features drafts a tree level by
    # level (no extra forward of the model); 4-gram reuse adds branches.
    "eagle": _preset({"name": "eagle", "weights": "auto"}, {"name": "ngram", "n": 4, "top_k": 20}, {"name": "full"}),
    # Prompt lookup: no model-based drafts, the continuation of the latest match.
    "prompt-lookup": _preset({"name": "none"}, {"name": "prompt-lookup"}, {"name": "full"}),
}
