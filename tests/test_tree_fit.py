"""Fitted draft trees: the replay walks the text exactly as verification does, the fit
keeps the likeliest paths, and a fitted tree saved beside the heads is used."""

import json

import pytest

from tokenswift.sampling import make_sampler
import torch

from tokenswift import Pipeline
from tokenswift.cli import main
from tokenswift.drafters.draft_heads import DraftHeads
from tokenswift.drafters.template import index_paths, load_tree, save_tree
from tokenswift.tools.tree_fit import MISS, fit_tree, replay, tokens_per_step, tokenswift_ranks
from tokenswift.testing import looping_model, tiny_model_for

SAMPLING = {"temperature": 0.5, "min_p": 0.05}
PENALTY = {"name": "contextual", "value": 1.3, "window": 16}


def test_tokens_per_step_walks_the_text_step_by_step():
    ranks = torch.tensor([
        [0, 1, 0],  # step 1: depth 1 (rank 0), depth 2 (rank 1) in the tree, depth 3 path (0,1,0) is not
        [9, 9, 9],  # covered by step 1 (accepted)
        [9, 9, 9],  # covered by step 1 (bonus)
        [2, 0, 0],  # step 2: rank 2 at depth 1 is not in the tree -> bonus only
        [1, 0, 0],  # step 3: (1,) and (1, 0) accepted, (1, 0, 0) too -> 3 + bonus
        [9, 9, 9],
        [9, 9, 9],
        [9, 9, 9],
        [0, MISS, 0],  # step 4: (0,), then a miss -> 2 tokens, but the text ends after 1
    ])
    tree = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 0, 0)]
    assert tokens_per_step(ranks, tree) == pytest.approx(9 / 4)


def test_fit_tree_keeps_the_likeliest_prefix_closed_paths():
    # depth 1 is rank 0 or 1 half the time each; depth 2 is almost always rank 0
    ranks = torch.tensor([[0, 0], [1, 0], [0, 0], [1, 0], [0, 3], [1, 0], [0, 0], [1, 0]])
    assert fit_tree([ranks], 2) == [(0,), (1,)]
    tree = fit_tree([ranks], 4)
    assert tree == [(0,), (1,), (0, 0), (1, 0)]
    assert all(path[:-1] in tree for path in tree if len(path) > 1)
    assert tokens_per_step(ranks, tree) > tokens_per_step(ranks, [(0,), (0, 0)])


@pytest.mark.parametrize(
    ("tree", "penalty"),
    [
        ([1, 3, 3, 3], PENALTY),
        ([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]], PENALTY),
        ([1, 3, 3, 3], {"name": "none"}),
    ],
)
def test_replay_predicts_the_pipelines_steps_exactly(tmp_path, tree, penalty):
    """The replay of an autoregressive run, walked down a tree, segments the text into
    the same steps as the ``tokenswift`` drafter with that tree (float64, same seed:
    the speculative run emits the very tokens of the autoregressive one)."""
    model = looping_model()
    heads = DraftHeads.random(model, num_heads=3, seed=1, std=0.5)
    heads.save_pretrained(tmp_path)
    prompt = [5, 9, 17, 3, 22, 41, 8, 30]
    common = {"penalty": penalty, "sampling": SAMPLING}
    ar = Pipeline.from_spec({"preset": "ar", **common}, model).generate(prompt, 60, seed=4, ignore_eos=True)
    pipe = Pipeline.from_spec(
        {
            "preset": "tokenswift",
            "speculation": {"tree": "fixed"},  # the replay walks the whole fixed tree, drafting pass included
            "drafter": {"heads": str(tmp_path), "tree": tree},
            "retriever": {"name": "none"},
            "cache": {"name": "full"},
            **common,
        },
        model,
    )
    result = pipe.generate(prompt, 60, seed=4, ignore_eos=True)
    assert result.tokens == ar.tokens
    noise = None
    if not pipe.spec.sampling.greedy:  # the keyed sampler: its drafts are ranked with the draw's noise
        noise = lambda position: make_sampler(pipe.spec.sampling, seed=4).noise(position, pipe.runner.vocab_size)  # noqa: E731
    ranks = tokenswift_ranks(replay(model, heads, prompt + ar.tokens, len(prompt), pipe.scorer, noise=noise), depth=4)
    assert result.stats.tokens_per_step > 1.2  # drafts are really accepted here
    assert tokens_per_step(ranks, index_paths(tree)) == pytest.approx(result.stats.tokens_per_step)


def test_the_replay_ranks_among_the_heads_shortlist(tmp_path, monkeypatch):
    """Coupled to the draw, the heads rank a depth's SHORTLIST likeliest tokens only: the
    replay must too (the tiny vocabulary of 64 otherwise fits in the shortlist)."""
    from tokenswift.drafters import head_based

    monkeypatch.setattr(head_based, "SHORTLIST", 8)
    test_replay_predicts_the_pipelines_steps_exactly(tmp_path, [1, 3, 3, 3], PENALTY)


def test_a_tree_saved_beside_the_heads_is_the_drafters_default(tmp_path):
    model = tiny_model_for("llama-gqa")
    DraftHeads.random(model).save_pretrained(tmp_path)
    fitted = [[0], [1], [0, 0], [0, 0, 0]]
    save_tree(tmp_path, "tokenswift", fitted, {"nodes": 4})
    spec = {"preset": "tokenswift", "drafter": {"heads": str(tmp_path)}}
    assert Pipeline.from_spec(spec, model).drafter.paths == [tuple(p) for p in fitted]
    explicit = {"preset": "tokenswift", "drafter": {"heads": str(tmp_path), "tree": [1, 2]}}
    assert Pipeline.from_spec(explicit, model).drafter.paths == [(0,), (0, 0), (0, 1)]
    # fitted for the tokenswift drafter only: medusa keeps its own default
    medusa = {"preset": "medusa", "drafter": {"heads": str(tmp_path)}}
    assert len(Pipeline.from_spec(medusa, model).drafter.paths) == 3 + 9 + 27
    assert load_tree(tmp_path, "medusa") is None


def test_fit_tree_command_writes_a_tree_and_its_record(tmp_path, model_dir, capsys):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    heads_dir = tmp_path / "heads"
    DraftHeads.random(model, std=0.3).save_pretrained(heads_dir)
    code = main([
        "fit-tree", "--model", str(model_dir), "--dtype", "float32", "--heads", str(heads_dir), "--nodes", "6",
        "--prompt-tokens", "24", "--new-tokens", "30", "--seeds", "1", "2",
    ])
    err = capsys.readouterr().err
    assert code == 0, err
    record = json.loads((heads_dir / "tree.json").read_text())
    assert record["drafter"] == "tokenswift" and record["nodes"] == 6 and len(record["paths"]) == 6
    assert record["seeds"] == [1, 2] and record["new_tokens"] == 30
    per_seed = record["replayed_tokens_per_step"]["per_seed"]
    assert [(s["seed"], s["decoding"]) for s in per_seed] == [(1, "sampling"), (2, "sampling"), (1, "greedy"), (2, "greedy")]
    assert record["decodings"] == ["sampling", "greedy"]
    assert set(record["replayed_tokens_per_step"]["fitted_by_decoding"]) == {"sampling", "greedy"}
    assert record["command"].startswith("tokenswift fit-tree --model")
    assert "fitted a 6-node tree: replayed tokens/step" in err
    spec = {"preset": "tokenswift", "drafter": {"heads": str(heads_dir)}}
    assert Pipeline.from_spec(spec, model).drafter.paths == [tuple(p) for p in record["paths"]]

    # a prompt of one's own, and the tree written elsewhere
    prompt_file, out = tmp_path / "prompt.txt", tmp_path / "out"
    prompt_file.write_text("the cat sat on the mat " * 4)
    out.mkdir()
    code = main([
        "fit-tree", "--model", str(model_dir), "--dtype", "float32", "--heads", str(heads_dir), "--nodes", "3",
        "--prompt-file", str(prompt_file), "--new-tokens", "20", "--seeds", "5", "--out", str(out),
    ])
    assert code == 0, capsys.readouterr().err
    record = json.loads((out / "tree.json").read_text())
    assert record["prompt"] == str(prompt_file) and record["prompt_tokens"] == 24 and len(record["paths"]) == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fit-tree", "--nodes", "0"], "--nodes must be a positive integer, got 0"),
        (["fit-tree", "--new-tokens", "-5"], "--new-tokens must be a positive integer, got -5"),
        (["fit-tree", "--heads", "/nonexistent/heads"], "--heads '/nonexistent/heads' is not a directory of saved heads"),
        (["fit-tree", "--prompt-file", "/nonexistent/p.txt"], "prompt file not found: /nonexistent/p.txt"),
        (["fit-tree", "--out", "/nonexistent/dir"], "--out '/nonexistent/dir' is not a directory"),
        (["fit-tree", "--decodings", "greedy,beam"], "--decodings 'greedy,beam': give a comma-separated list of ['sampling', 'greedy']"),
    ],
)
def test_fit_tree_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"tokenswift: error: {message}"
