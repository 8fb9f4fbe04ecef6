"""Built-in presets: named spec dicts that a spec can start from (``preset = "..."``)."""

from __future__ import annotations

# The paper's sampling setting (temperature 1.0, min-p 0.1, contextual penalty 1.2 over
# the last 1024 tokens), shared by every preset so that they are comparable.
PAPER_SAMPLING = {"temperature": 1.0, "min_p": 0.1}
PAPER_PENALTY = {"name": "contextual", "value": 1.2, "window": 1024}

PRESETS: dict[str, dict] = {
    # Plain autoregressive decoding: the reference every other preset must equal.
    "ar": {
        "drafter": {"name": "none"},
        "retriever": {"name": "none"},
        "cache": {"name": "full"},
        "verifier": {"name": "tree-sampling"},
        "penalty": dict(PAPER_PENALTY),
        "sampling": dict(PAPER_SAMPLING),
    },
}
