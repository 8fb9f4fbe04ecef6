"""The ``eagle`` drafter: its draft layer kept in step with the text, training that
teaches it, the CLI that trains it, and clear errors. (Losslessness with every
retriever, cache and penalty: tests/test_lossless.py.)"""

import collections
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from tokenswift import Pipeline
from tokenswift.cli import main
from tokenswift.drafters.eagle import EagleDrafter
from tokenswift.drafters.feature_net import FeatureNet
from tokenswift.errors import ModelLoadError, SpecError, TokenswiftError
from tokenswift.interfaces import DraftInputs
from tokenswift.testing import FIXED_TREE, assert_lossless, looping_model, tiny_model_for
from tokenswift.tree import DRAFTER
from tokenswift.tools.drafter_training import (
    DrafterTrainConfig, first_seen, greedy_tokens, level_losses, penalize, train_drafter,
)
from tests.test_training import cyclic_corpus, model_and_books

SMALL = dict(windows=16, seq_len=32, batch=4, positions=0, draft_vocab=64, eval_windows=8, warmup=5, lr=3e-3)


def decisive_net(model, directory, std=0.3, fused=()):
    """Random weights large enough that the draft's probabilities are far from ties;
    with ``fused`` layers, a random fuse of them too (not the final-norm block alone)."""
    net = FeatureNet.for_model(model).initialise(seed=3, std=std).with_fused_layers(fused)
    if fused:
        with torch.no_grad():
            net.reduce.weight.copy_(torch.randn(net.reduce.weight.shape, generator=torch.Generator().manual_seed(4)) * std)
    net.save_pretrained(directory)
    return str(directory)


def test_training_teaches_the_drafter_and_its_drafts_are_accepted(tmp_path):
    model = looping_model()
    record = train_drafter(model, cyclic_corpus(), tmp_path, DrafterTrainConfig(steps=60, **SMALL))
    assert min(record["held_out_agreement"]["top1"]) > 0.9, record  # a deterministic cycle is learnable
    spec = {"preset": "eagle", "drafter": {"weights": str(tmp_path)}, "sampling": {"greedy": True},
            "penalty": {"name": "none"}, **FIXED_TREE}
    result = assert_lossless(Pipeline.from_spec(spec, model), [3, 1, 4], 60)
    assert result.stats.tokens_per_step > 3  # several levels deep are accepted: the levels chain right


def test_training_can_start_from_a_trained_network(tmp_path):
    """--init: fine-tuning (on a self-distillation corpus, say) starts from a trained
    layer and keeps its draft vocabulary."""
    model = looping_model()
    first = tmp_path / "first"
    train_drafter(model, cyclic_corpus(), first, DrafterTrainConfig(steps=60, **SMALL))
    again = train_drafter(model, cyclic_corpus(), tmp_path / "again", DrafterTrainConfig(steps=1, init=str(first), **SMALL))
    assert min(again["held_out_agreement"]["top1"]) > 0.9  # one step from the trained layer, not from scratch
    fresh = train_drafter(model, cyclic_corpus(), tmp_path / "fresh", DrafterTrainConfig(steps=1, **SMALL))
    assert min(fresh["held_out_agreement"]["top1"]) < 0.9
    assert torch.equal(FeatureNet.from_pretrained(tmp_path / "again").draft_tokens, FeatureNet.from_pretrained(first).draft_tokens)


@pytest.mark.parametrize(("arch", "fused"), [("llama-gqa", ()), ("qwen2", ()), ("llama-gqa", (1,))])
def test_the_draft_layer_stays_in_step_with_the_committed_text(arch, fused, tmp_path):
    """After steps of generation, the running drafter proposes what a fresh drafter
    primed with the whole context's features proposes: the pairs it keeps are the
    committed text's, at the right positions; with fused layers, the verify forwards
    hand it the outputs of the right layer for the right rows."""
    model = tiny_model_for(arch, "float64")
    weights = decisive_net(model, tmp_path, fused=fused)
    spec = {"preset": "eagle", "drafter": {"weights": weights, "threshold": 0.0}, "retriever": {"name": "ngram"},
            "sampling": {"greedy": True}, "penalty": {"name": "none"}, **FIXED_TREE}
    pipe = Pipeline.from_spec(spec, model)
    generation = pipe.start([5, 9, 17, 3] * 3, 40, seed=2, ignore_eos=True)  # greedy tiny models loop: n-grams hit
    records = list(generation.steps())
    assert sum(record.accepted for record in records) > 0  # multi-token steps happened
    state = generation.state
    running = pipe.drafter.propose(state, DraftInputs())

    fresh = EagleDrafter(pipe.drafter.options, pipe.drafter.context)
    fresh.start(state)
    with torch.no_grad():
        out = model.get_decoder()(input_ids=torch.tensor([state.tokens[:-1]]), output_hidden_states=True)
    fresh.prime(state, torch.cat([out.hidden_states[k][0] for k in fused] + [out.last_hidden_state[0]], -1))
    recomputed = fresh.propose(state, DraftInputs())
    assert [b.tokens for b in running] == [b.tokens for b in recomputed]
    for a, b in zip(running, recomputed):
        assert a.confidence == pytest.approx(b.confidence, rel=1e-4, abs=1e-6)


def test_the_tree_has_the_asked_shape(tmp_path):
    model = tiny_model_for("llama-mha", "float64")
    drafter = {"weights": decisive_net(model, tmp_path), "depth": 3, "width": 2, "children": 3, "threshold": 0.0}

    def proposal(sampling):
        pipe = Pipeline.from_spec({"preset": "eagle", "drafter": drafter, "sampling": sampling}, model)
        generation = pipe.start([1, 2, 3, 4], 2, seed=0, ignore_eos=True)
        generation.prefill()
        return pipe, pipe.drafter.propose(generation.state, DraftInputs())

    pipe, branches = proposal({"greedy": True})
    depths = [len(b.tokens) for b in branches]
    assert depths.count(1) == 3 and depths.count(2) == 2 * 3 and depths.count(3) == 2 * 3
    assert pipe.drafter.max_tree_nodes == len(branches)
    # Under min-p, candidates the warpers filter out could never be drawn: not proposed.
    _, branches = proposal({"temperature": 1.0, "min_p": 0.3})
    assert 0 < len(branches) < pipe.drafter.max_tree_nodes and all(0 < c <= 1 for b in branches for c in b.confidence)


def test_weights_made_for_another_model_are_refused(tmp_path):
    weights = decisive_net(tiny_model_for("llama-mha"), tmp_path)
    with pytest.raises(ModelLoadError, match="made for another model"):
        Pipeline.from_spec({"preset": "eagle", "drafter": {"weights": weights}}, tiny_model_for("qwen2"))
    with pytest.raises(ModelLoadError, match="no eagle drafter at"):
        Pipeline.from_spec({"preset": "eagle", "drafter": {"weights": str(tmp_path / "missing")}}, looping_model())


@pytest.mark.parametrize(
    ("drafter", "message"),
    [
        ({"depth": 0}, r"drafter.depth must be an integer >= 1, got 0"),
        ({"threshold": 1.5}, r"drafter.threshold must be a number in \[0, 1\), got 1.5"),
        ({"weights": ""}, r"drafter.weights must be 'auto'"),
        ({"seed": "x"}, r"drafter.seed must be an integer, got 'x'"),
        ({"vocab": 1}, r"drafter.vocab must be an integer >= 2, got 1"),
    ],
)
def test_bad_options_are_clear_errors(drafter, message):
    with pytest.raises(SpecError, match=message):
        Pipeline.from_spec({"preset": "eagle", "drafter": {"weights": "random", **drafter}}, tiny_model_for("llama-mha"))


def test_cli_train_drafter_records_the_run_and_resumes(tmp_path, capsys):
    model_dir, data = model_and_books(tmp_path)
    out = tmp_path / "eagle"
    argv = ["train-drafter", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--windows", "9",
            "--steps", "4", "--seq-len", "32", "--batch", "2", "--draft-vocab", "16", "--holdout", "held",
            "--checkpoint-every", "2"]
    assert main(argv) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["command"].startswith("tokenswift train-drafter --model") and record["feature_tokens"] == 9 * 32
    assert len(record["held_out_agreement"]["top1"]) == 4 and record["config"]["draft_vocab"] == 16
    assert sorted(p.name for p in (out / "features").iterdir()) == [
        "chunk-0000.safetensors", "chunk-0001.safetensors", "targets-0000.safetensors", "targets-0001.safetensors"]
    assert len(record["held_out_agreement"]["greedy_top1"]) == 4 and record["config"]["depth"] == 5
    assert (out / "model.safetensors").is_file() and (out / "checkpoint.pt").is_file()
    assert main([*argv, "--steps", "6", "--resume"]) == 0
    net = FeatureNet.from_pretrained(out)
    assert net.draft_tokens.numel() == 16 and net.draft_tokens[0].item() in (1, 2, 3, 4, 5, 6)  # frequent words first
    capsys.readouterr()
    assert main(["train-drafter", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "x"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_the_penalty_in_training_sees_each_positions_own_past():
    draft_index = torch.tensor([2, 0, 1, 3, 3])  # ids 0..4 -> rows; ids 3, 4 are outside (row 3 = extra)
    first = first_seen(torch.tensor([[1, 4, 0, 1]]), draft_index, 3)
    assert first.tolist() == [[0, 4, 2]]  # id 1 (row 0) at 0, id 2 (row 1) never, id 0 (row 2) at 2; id 4 dropped
    seen_by = first[:, None, :] <= torch.arange(4)[None, :, None]
    assert seen_by[0].tolist() == [[True, False, False], [True, False, False], [True, False, True], [True, False, True]]
    logits = torch.tensor([[2.0, -1.0, 3.0]])
    assert penalize(logits, torch.tensor([[True, True, False]]), 2.0).tolist() == [[1.0, -2.0, 3.0]]
    assert penalize(logits, None, 2.0) is logits


def test_the_greedy_targets_are_the_penalized_argmax_of_each_positions_past():
    logits = torch.tensor([[3.0, 2.5, 0.0], [3.0, 2.5, 0.0], [-1.0, -2.5, -0.9]])
    # position 0 has seen id 0 (3 / 2 = 1.5 < 2.5): id 1; position 1 has seen 0 and 1: 1.5 < 1.25? no: id 0;
    # position 2 has seen 0, 1 and 2: -2, -5, -1.8: id 2
    assert greedy_tokens(torch.tensor([0, 1, 2]), logits, 2.0).tolist() == [1, 0, 2]
    assert greedy_tokens(torch.tensor([0, 1, 2]), logits, 1.0).tolist() == [0, 0, 2]


def test_token_losses_mask_greedy_tokens_outside_the_draft_vocabulary():
    torch.manual_seed(0)
    model = tiny_model_for("llama-mha")
    net = FeatureNet.for_model(model, torch.arange(8)).float()
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings().weight.detach()[:8].float()
    tokens = torch.randint(0, 8, (1, 12))
    truth = torch.randn(1, 12, head.shape[1])
    draft_index = torch.full((model.config.vocab_size,), 8)
    draft_index[:8] = torch.arange(8)
    positions = torch.tensor([0, 2, 4, 6])  # level 1 reads greedy[1, 3, 5, 7], level 2 greedy[2, 4, 6, 8]
    inside = torch.randint(0, 8, (1, 12))
    outside = inside.clone()
    outside[:, positions + 1] = 9  # level 1's greedy tokens all outside: nothing left to learn there
    args = (net, embed, head, truth, truth, tokens, 2, positions)
    _, soft, hard, _ = level_losses(*args, greedy=inside, draft_index=draft_index)
    _, soft_out, hard_out, agree_out = level_losses(*args, greedy=outside, draft_index=draft_index)
    assert soft[0] > 0 and hard[0] > 0
    assert soft_out[0] == 0 and hard_out[0] == 0 and agree_out[0] == 0
    assert torch.equal(soft_out[1], soft[1]) and torch.equal(hard_out[1], hard[1])  # level 2 untouched


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"temperature": 1.0, "min_p": 0.1}], ids=["greedy", "sampled"])
def test_with_a_root_pass_depth_one_is_the_token_the_target_draws(sampling, tmp_path):
    """drafter.root_pass: over the whole context the pass's depth 1 is scored as
    verification scores the root's next token (penalty and warpers included) and ranked
    as the target draws it (greedy: the argmax; sampled: the coupled favourite), so
    with fixed trees every step accepts a draft; without the pass, the random layer's
    depth 1 misses."""
    model = tiny_model_for("llama-gqa", "float64")
    weights = decisive_net(model, tmp_path)

    def accepted(root_pass):
        drafter = {"weights": weights, "root_pass": root_pass, "depth": 2, "width": 2, "children": 2, "threshold": 0.0}
        spec = {"preset": "eagle", "drafter": drafter, "retriever": {"name": "none"},
                "penalty": {"name": "contextual", "value": 1.5, "window": 8}, "sampling": sampling, **FIXED_TREE}
        assert_lossless(Pipeline.from_spec(spec, model), [5, 9, 17, 3, 8, 5, 9], 40, seed=3)
        return drafts_accepted(Pipeline.from_spec(spec, model), [5, 9, 17, 3, 8, 5, 9], 40, seed=3)

    assert min(accepted(True)) >= 1
    assert min(accepted(False)) == 0


def drafts_accepted(pipe, prompt, new_tokens, seed) -> list[int]:
    """Drafts accepted per step, but for the last step (which the token budget may cut short)."""
    return [record.accepted for record in pipe.start(prompt, new_tokens, seed=seed, ignore_eos=True).steps()][:-1]


@pytest.mark.parametrize("fused", [(), (1,)], ids=["final-norm", "fused"])
def test_with_a_root_pass_depth_two_is_drafted_from_the_roots_own_features(fused, tmp_path, monkeypatch):
    """The depth-1 node's pair in the draft layer carries the target's feature of the
    root's position (from the pass; with fused layers, their outputs too), not the
    layer's prediction of it."""
    model = tiny_model_for("llama-gqa", "float64")
    weights = decisive_net(model, tmp_path, fused=fused)
    drafter = {"weights": weights, "root_pass": True, "depth": 2, "width": 1, "children": 1, "threshold": 0.0}
    spec = {"preset": "eagle", "drafter": drafter, "retriever": {"name": "none"}, "sampling": {"greedy": True},
            "penalty": {"name": "none"}, **FIXED_TREE}
    pipe = Pipeline.from_spec(spec, model)
    generation = pipe.start([5, 9, 17, 3, 8, 2], 12, seed=0, ignore_eos=True)
    steps = generation.steps()
    next(steps)
    with torch.no_grad():  # the target over the committed text, the root last
        out = model.get_decoder()(input_ids=torch.tensor([generation.state.tokens]), output_hidden_states=True)
    root = torch.cat([out.hidden_states[k][0, -1] for k in fused] + [out.last_hidden_state[0, -1]])
    seen = []
    extend = pipe.drafter.net.extend

    def spy(embeds, features, *args):
        seen.append(features.clone())
        return extend(embeds, features, *args)

    monkeypatch.setattr(pipe.drafter.net, "extend", spy)
    next(steps)
    assert len(seen) == 2  # the committed pairs, then the depth-1 node's pair
    with torch.no_grad():
        expected = pipe.drafter.net.feature(root.to(torch.float32))
    torch.testing.assert_close(seen[1][0], expected, rtol=1e-5, atol=1e-5)


def test_the_tokenswift_drafter_drafts_with_a_layer_after_its_pass_where_asked(tmp_path):
    """drafter.levels: "layer" drafts below the pass with the eagle network (fed the
    pass's feature); "auto" takes it where no heads are named and a layer is given (or
    shipped for the model), else the heads; a bad value is a clear error."""
    model = tiny_model_for("llama-gqa", "float64")
    weights = decisive_net(model, tmp_path)
    base = {"cache": {"name": "full"}, "retriever": {"name": "none"}, "sampling": {"greedy": True},
            "penalty": {"name": "none"}, **FIXED_TREE}

    def pipe(drafter):
        return Pipeline.from_spec("tokenswift", model, overrides={**base, "drafter": drafter})

    layered = pipe({"levels": "layer", "weights": weights})
    assert isinstance(layered.drafter.layer, EagleDrafter) and layered.drafter.layer.options.root_pass
    assert_lossless(layered, [5, 9, 17, 3, 8, 5, 9], 40, seed=1)
    assert min(drafts_accepted(layered, [5, 9, 17, 3, 8, 5, 9], 40, seed=1)) >= 1  # depth 1 is the pass's: right every step
    assert pipe({"weights": weights}).drafter.layer is not None  # auto: no heads named, a layer given
    assert pipe({"heads": "random", "weights": weights}).drafter.layer is None  # heads named: the heads
    assert pipe({"heads": "random"}).drafter.layer is None  # no layer shipped for a tiny model
    with pytest.raises(SpecError, match="drafter.levels must be one of"):
        pipe({"levels": "network"})


def test_a_smaller_draft_vocabulary_drafts_only_its_tokens(tmp_path):
    model = tiny_model_for("llama-mha", "float64")
    weights = decisive_net(model, tmp_path)
    spec = {"preset": "eagle", "drafter": {"weights": weights, "vocab": 8, "threshold": 0.0}, **FIXED_TREE}
    pipe = Pipeline.from_spec(spec, model)
    allowed = set(FeatureNet.from_pretrained(weights).draft_tokens[:8].tolist())
    generation = pipe.start([1, 2, 3, 4], 2, seed=0, ignore_eos=True)
    generation.prefill()
    branches = pipe.drafter.propose(generation.state, DraftInputs())
    assert branches and all(set(b.tokens) <= allowed for b in branches)
    assert_lossless(Pipeline.from_spec(spec, model), [1, 2, 3, 4], 20, seed=5)


def test_a_network_given_fused_layers_drafts_as_before_until_trained(tmp_path):
    """with_fused_layers starts ``reduce`` as the final-norm block: a trained layer
    carries over to fused features unchanged (then training teaches it the others)."""
    model = tiny_model_for("llama-gqa", "float64")
    plain = decisive_net(model, tmp_path / "plain")
    FeatureNet.from_pretrained(plain).with_fused_layers((1,)).save_pretrained(tmp_path / "fused")

    def proposal(weights):
        pipe = Pipeline.from_spec({"preset": "eagle", "drafter": {"weights": str(weights), "threshold": 0.0}}, model)
        generation = pipe.start([5, 9, 17, 3, 8], 2, seed=0, ignore_eos=True)
        generation.prefill()
        return pipe.drafter.propose(generation.state, DraftInputs())

    before, after = proposal(plain), proposal(tmp_path / "fused")
    assert [b.tokens for b in before] == [b.tokens for b in after]
    assert [c for b in before for c in b.confidence] == pytest.approx([c for b in after for c in b.confidence], rel=1e-9)
    assert FeatureNet.from_pretrained(tmp_path / "fused").config.fused_layers == (1,)
    with pytest.raises(ValueError, match="fuses layers \\[1\\] already"):
        FeatureNet.from_pretrained(tmp_path / "fused").with_fused_layers((2,))


def test_training_with_fused_layers_caches_them_teaches_the_layer_and_stays_lossless(tmp_path):
    model = looping_model()
    features = tmp_path / "features"
    train_drafter(model, cyclic_corpus(), tmp_path / "plain", DrafterTrainConfig(steps=1, **SMALL), features_dir=features)
    record = train_drafter(
        model, cyclic_corpus(), tmp_path / "fused", DrafterTrainConfig(steps=60, fused_layers=(1,), **SMALL),
        features_dir=features,  # made without the layer: each chunk computed again, with it
    )
    chunk = load_file(features / "chunk-0000.safetensors")
    assert chunk["layers"].shape == chunk["features"].shape  # one inner layer beside the final-norm state
    with torch.no_grad():
        expected = model.get_decoder()(input_ids=chunk["tokens"], output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(chunk["layers"].float(), expected.float(), rtol=1e-2, atol=1e-2)  # stored in bfloat16
    assert min(record["held_out_agreement"]["top1"]) > 0.9 and tuple(record["config"]["fused_layers"]) == (1,)
    spec = {"preset": "eagle", "drafter": {"weights": str(tmp_path / "fused")}, "sampling": {"greedy": True},
            "penalty": {"name": "none"}, **FIXED_TREE}
    result = assert_lossless(Pipeline.from_spec(spec, model), [3, 1, 4], 60)
    assert result.stats.tokens_per_step > 3
    again = train_drafter(model, cyclic_corpus(), tmp_path / "again", DrafterTrainConfig(
        steps=1, init=str(tmp_path / "fused"), **SMALL), features_dir=features)  # the init's layers are kept
    assert not again["config"]["fused_layers"] and FeatureNet.from_pretrained(tmp_path / "again").config.fused_layers == (1,)


def test_a_shared_prefill_hands_each_drafter_the_layers_it_reads(tmp_path):
    """The benchmark prefills once with every layer any drafter reads; each run's
    drafter gets its own layers' blocks of those features."""
    from tokenswift.tools.interleaved import prefill_once

    model = tiny_model_for("llama-gqa", "float64")
    pipes = {
        "plain": Pipeline.from_spec({"preset": "eagle", "drafter": {"weights": decisive_net(model, tmp_path / "a")}}, model),
        "fused": Pipeline.from_spec(
            {"preset": "eagle", "drafter": {"weights": decisive_net(model, tmp_path / "b", fused=(1,))}}, model),
    }
    prompt = [5, 9, 17, 3, 8, 2, 11]
    prefilled = prefill_once(pipes, prompt, 64)
    assert prefilled.layers == (1,)
    for name, pipe in pipes.items():
        alone = pipe.start(prompt, 2, seed=0, ignore_eos=True)
        alone.prefill()
        expected = pipe.drafter.propose(alone.state, DraftInputs())
        shared = pipe.start(prompt, 2, seed=0, ignore_eos=True)
        shared.prefill(prefilled)
        got = pipe.drafter.propose(shared.state, DraftInputs())
        assert [b.tokens for b in got] == [b.tokens for b in expected], name
        assert [c for b in got for c in b.confidence] == pytest.approx(
            [c for b in expected for c in b.confidence], rel=1e-9), name


def test_a_saved_prefill_is_read_back_only_for_its_own_prompt_and_model(tmp_path, monkeypatch, caplog):
    """``prefill_once(..., saved=FILE)`` (``variant_turns.py --saved-prefill``): the first
    call computes and writes the prefill; a later one reads it back without a forward and
    runs emit exactly what they emit from a fresh prefill; another prompt, or another
    model, computes again (with a warning) instead of taking the file's."""
    from tokenswift.model.runner import Runner
    from tokenswift.tools.interleaved import prefill_once

    computed = []
    original = Runner.prefill_prompt
    monkeypatch.setattr(Runner, "prefill_prompt", lambda self, p, **kw: computed.append(len(p)) or original(self, p, **kw))
    model = tiny_model_for("llama-gqa", "float64")
    pipes = {"eagle": Pipeline.from_spec({"preset": "eagle", "drafter": {"weights": decisive_net(model, tmp_path / "a", fused=(1,))}}, model)}
    prompt, saved = [5, 9, 17, 3, 8, 2, 11], tmp_path / "prefill.safetensors"
    fresh = prefill_once(pipes, prompt, 64, saved=saved)
    again = prefill_once(pipes, prompt, 64, saved=saved)
    assert computed == [7] and saved.exists()
    assert again.tokens == fresh.tokens and again.layers == fresh.layers == (1,)
    assert all(torch.equal(a, b) for a, b in zip(again.keys + again.values, fresh.keys + fresh.values))
    assert torch.equal(again.hidden, fresh.hidden)
    pipe = pipes["eagle"]
    texts = []
    for prefilled in (fresh, again):
        run = pipe.start(prompt, 12, seed=0, ignore_eos=True)
        run.prefill(prefilled)
        for _ in run.steps():
            pass
        texts.append(list(run.new_tokens))
    assert texts[0] == texts[1] == pipe.generate(prompt, 12, seed=0, ignore_eos=True).tokens
    with caplog.at_level("WARNING"):
        prefill_once(pipes, prompt[:-1] + [12], 64, saved=saved)  # another prompt
    assert computed == [7, 7] and "holds another prefill" in caplog.text
    caplog.clear()
    plain, other = tmp_path / "plain.safetensors", tiny_model_for("llama-gqa", "float64", seed=7)
    prefill_once({"ar": Pipeline.from_spec("ar", model)}, prompt, 64, saved=plain)
    prefill_once({"ar": Pipeline.from_spec("ar", model)}, prompt, 64, saved=plain)
    assert computed == [7, 7, 7] and not caplog.text
    with caplog.at_level("WARNING"):
        prefill_once({"ar": Pipeline.from_spec("ar", other)}, prompt, 64, saved=plain)  # another model
    assert computed == [7, 7, 7, 7] and "holds another prefill" in caplog.text


def test_layers_a_model_does_not_have_are_clear_errors(tmp_path):
    model = tiny_model_for("llama-gqa", "float64")  # two decoder layers: only layer 1's output is inner
    net = FeatureNet.for_model(model).initialise()
    net.with_fused_layers((2,)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"fuses layers \[2\]; this model's inner layers are 1..1"):
        Pipeline.from_spec({"preset": "eagle", "drafter": {"weights": str(tmp_path)}}, model)
    runner = Pipeline.from_spec("ar", model).runner
    runner.allocate(8)
    with pytest.raises(ValueError, match=r"layers \[0\]: the outputs of this model's decoder layers 1..1"):
        runner.forward(torch.tensor([1, 2]), layers=(0,))
    with pytest.raises(TokenswiftError, match=r"fused layers \[5\]: this model's inner layers are 1..1"):
        train_drafter(looping_model(), cyclic_corpus(), tmp_path / "x", DrafterTrainConfig(steps=1, fused_layers=(5,), **SMALL))


def test_features_of_some_layers_are_picked_out_of_more():
    from tokenswift.model.runner import select_features

    rows = torch.arange(2 * 4 * 3).view(2, 12)  # 2 rows; blocks of 3: layers 2, 5, 7, then the final-norm state
    blocks = rows.view(2, 4, 3)
    assert torch.equal(select_features(rows, (2, 5, 7), (7, 2)), torch.cat([blocks[:, 2], blocks[:, 0], blocks[:, 3]], -1))
    assert torch.equal(select_features(rows, (2, 5, 7), ()), blocks[:, 3])
    assert select_features(rows, (2, 5, 7), (2, 5, 7)) is rows
    with pytest.raises(ValueError, match=r"hold layers \[2, 5, 7\], not \[3\]"):
        select_features(rows, (2, 5, 7), (3, 5))


def test_the_head_product_goes_through_the_kernel_in_bfloat16_where_the_runner_uses_it(monkeypatch):
    """A bfloat16 model whose runner takes the few-rows kernel (forced, whichever CPU
    runs this): the drafter keeps the draft vocabulary's head rows in bfloat16 and ranks
    from one kernel call per level, within bfloat16 rounding of the float32 product; a
    float32 model keeps its float32 head."""
    from tokenswift import kernels

    if not kernels.available():
        pytest.skip("the kernels cannot be built on this machine")
    monkeypatch.setenv(kernels.LINEARS_ENV, "kernel")
    model = tiny_model_for("llama-gqa", "bfloat16")
    pipe = Pipeline.from_spec({"preset": "eagle", **FIXED_TREE, "drafter": {"weights": "random"}}, model)
    drafter = pipe.drafter
    assert pipe.runner.kernel_linears and drafter.kernel_head and drafter.head.dtype == torch.bfloat16
    calls = []
    original = kernels.few_rows_linear
    monkeypatch.setattr(kernels, "few_rows_linear", lambda *a: calls.append(a[1].shape) or original(*a))
    features = torch.randn(3, model.config.hidden_size)
    got = drafter._head_logits(features)
    assert calls == [drafter.head.shape] and got.dtype == torch.float32
    want = features.to(torch.bfloat16).double() @ drafter.head.double().T
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    # a run through it (exact identity with ar belongs in float32: bfloat16 trees may
    # round differently from one-token steps where the attention of a tree is PyTorch's)
    result = pipe.generate([1, 5, 9, 2, 7, 3, 1, 5, 9, 2], 12, seed=0, ignore_eos=True)
    assert len(result.tokens) == 12 and calls[1:]

    float_pipe = Pipeline.from_spec({"preset": "eagle", "drafter": {"weights": "random"}}, tiny_model_for("llama-gqa", "float32"))
    assert not float_pipe.drafter.kernel_head and float_pipe.drafter.head.dtype == torch.float32


@pytest.mark.parametrize("native", [False, True], ids=["no native bfloat16", "native bfloat16"])
def test_the_layers_products_of_many_rows_run_in_float32_where_bfloat16_is_not_native(monkeypatch, native):
    """The draft layer's catch-up on a run of plain steps' pairs is more rows than the
    kernel takes: on a CPU without native bfloat16 PyTorch's bfloat16 products of many
    rows crawl, so they are computed in float32 on the same bfloat16 values there."""
    from tokenswift.model import linear

    monkeypatch.setattr(linear, "native_bfloat16", lambda device: native)  # pinned: whichever CPU runs the test
    served = linear.KernelServedLinear(torch.nn.Linear(64, 48), torch.bfloat16)
    x = torch.randn(40, 64)  # more rows than kernels.MAX_LINEAR_ROWS
    rows, weight, bias = x.to(torch.bfloat16), served.weight, served.bias
    if native:
        want = torch.nn.functional.linear(rows, weight, bias).float()
    else:
        want = torch.nn.functional.linear(rows.float(), weight.float(), bias.float())
    got = served(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_the_layers_products_take_the_kernel_and_the_root_pass_runs_as_any_forward(monkeypatch):
    """Where the runner's products go through the few-rows kernel, so do the draft
    layer's (its linears swapped for kernel-served ones on bfloat16 copies of the
    weights), with no function mode left on: the target's pass
    must run as any forward does (under a mode its compiled forward would be traced
    anew: 12 s at a 32K run's first step)."""
    from torch.overrides import _get_current_function_mode_stack

    from tokenswift import kernels
    from tokenswift.model.linear import KernelServedLinear

    if not kernels.available():
        pytest.skip("the kernels cannot be built on this machine")
    monkeypatch.setenv(kernels.LINEARS_ENV, "kernel")
    model = tiny_model_for("llama-gqa", "bfloat16")
    spec = {"preset": "eagle", **FIXED_TREE, "drafter": {"weights": "random", "root_pass": True}}
    pipe = Pipeline.from_spec(spec, model)
    net = pipe.drafter.net
    assert isinstance(net.q, KernelServedLinear) and isinstance(net.down, KernelServedLinear)
    assert net.q.weight.dtype == torch.bfloat16
    x = torch.randn(3, model.config.hidden_size)
    want = torch.nn.functional.linear(x.to(torch.bfloat16).double(), net.q.weight.double())
    torch.testing.assert_close(net.q(x).double(), want, rtol=2e-2, atol=2e-2)  # bfloat16 rounding of the result
    assert net.q(x).dtype == torch.float32
    float_products, passes = [], []
    original = kernels.few_rows_linear
    monkeypatch.setattr(kernels, "few_rows_linear", lambda *a: float_products.append(a[1] is net.q.weight) or original(*a))
    forward = pipe.runner.forward

    def spy(tokens, **kwargs):
        if kwargs.get("view") is not None:  # a drafting pass (verify forwards stage into the store)
            passes.append(bool(_get_current_function_mode_stack()))
        return forward(tokens, **kwargs)

    monkeypatch.setattr(pipe.runner, "forward", spy)
    pipe.generate([1, 5, 9, 2, 7, 3, 1, 5, 9, 2], 12, seed=0, ignore_eos=True)
    assert passes and not any(passes)
    assert any(float_products)  # the layer's own products went through the kernel


def test_coupled_candidates_are_ranked_on_the_untruncated_draft_plus_the_noise(tmp_path):
    """Coupled to the draw, a depth's candidates are the top of log q + G with q after the
    penalty and temperature but before min-p: truncating the draft's own guess would drop
    tokens the target still admits and the noise favours (planted: a truncated q fails)."""
    model = tiny_model_for("llama-mha", "float64")
    drafter = {"weights": decisive_net(model, tmp_path), "depth": 1, "children": 4, "threshold": 0.0}
    # fixed trees: every candidate drafted (a chosen tree's first proposal drafts fewer)
    spec = {"preset": "eagle", "drafter": drafter, "sampling": {"temperature": 1.0, "min_p": 0.9},
            "speculation": {"tree": "fixed"}}
    pipe = Pipeline.from_spec(spec, model)
    generation = pipe.start([1, 2, 3, 4], 2, seed=0, ignore_eos=True)
    generation.prefill()
    vocab = pipe.runner.vocab_size
    plain = pipe.drafter.propose(generation.state, DraftInputs(noise=lambda depth: torch.zeros(vocab, dtype=torch.float64)))
    assert len(plain) == 4  # min-p 0.9 would leave q one or two tokens: the others are still candidates
    favourite = plain[-1].tokens[0]  # the draft's fourth choice, which min-p 0.9 filters out of q
    noise = torch.zeros(vocab, dtype=torch.float64)
    noise[favourite] = 30.0
    generation = pipe.start([1, 2, 3, 4], 2, seed=0, ignore_eos=True)
    generation.prefill()
    coupled = pipe.drafter.propose(generation.state, DraftInputs(noise=lambda depth: noise))
    assert coupled[0].tokens == [favourite] and coupled[0].confidence[0] > 0.99


def test_the_untruncated_scores_are_the_penalty_and_temperature_alone():
    from tokenswift.penalties.contextual import ContextualPenalty
    from tokenswift.scoring import Scorer
    from tokenswift.spec import SamplingSpec

    penalty = ContextualPenalty(ContextualPenalty.Options(value=1.5, window=4), None)
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    contexts = torch.tensor([[0, 1, 1, 2]])
    scorer = Scorer(penalty, SamplingSpec(temperature=0.5, min_p=0.5))
    expected = torch.tensor([[2.0 / 1.5, -1.5, 0.5 / 1.5, 3.0, 1.0]]) / 0.5
    torch.testing.assert_close(scorer.untruncated(contexts, logits.clone()), expected)
    assert torch.isinf(scorer(contexts, logits.clone())).any()  # the full scorer truncates (min-p)
    greedy = Scorer(penalty, SamplingSpec(greedy=True))
    torch.testing.assert_close(greedy.untruncated(contexts, logits.clone()), expected * 0.5)


def test_a_proposal_keeps_the_likeliest_candidates_a_step_can_verify(tmp_path):
    """EAGLE-2's reranking: of everything drafted, the ``speculation.max_nodes`` likeliest
    (by the product of their probabilities) are proposed, a subtree (every prefix kept)."""
    import math

    model = tiny_model_for("llama-mha", "float64")
    drafter = {"weights": decisive_net(model, tmp_path), "depth": 3, "width": 4, "children": 4, "threshold": 0.0}

    def proposal(max_nodes):
        spec = {"preset": "eagle", "drafter": drafter, "sampling": {"greedy": True},
                "speculation": {"tree": "fixed", "max_nodes": max_nodes}}
        pipe = Pipeline.from_spec(spec, model)
        generation = pipe.start([1, 2, 3, 4], 2, seed=0, ignore_eos=True)
        generation.prefill()
        return pipe, pipe.drafter.propose(generation.state, DraftInputs())

    _, everything = proposal(1000)
    pipe, kept = proposal(10)
    assert len(everything) > 20 and len(kept) == 10 == pipe.drafter.max_tree_nodes  # (p = 0 children dropped)
    chance = {tuple(b.tokens): math.prod(b.confidence) for b in everything}
    paths = {tuple(b.tokens) for b in kept}
    assert all(path[:d] in paths for path in paths for d in range(1, len(path)))  # a subtree
    assert min(chance[p] for p in paths) >= max(c for p, c in chance.items() if p not in paths)


def test_levels_are_drafted_no_wider_than_the_verified_trees_need(tmp_path, monkeypatch):
    """Where the tree choice verifies, the drafter expands at most one node more per level,
    and drafts at most one child more per node, than the widest tree it verified in the
    last steps (most drafted nodes at one depth, or children of one node); fixed trees
    draft the whole configured width, cut only where a step verifies fewer nodes than
    that (``max_nodes``: no wider level can hold a verified node)."""
    model = tiny_model_for("llama-mha", "float64")
    drafter = {"weights": decisive_net(model, tmp_path), "depth": 3, "width": 12, "children": 10, "threshold": 0.0}

    def level_rows(tree, max_nodes):
        spec = {"preset": "eagle", "drafter": drafter, "sampling": {"greedy": True},
                "speculation": {"tree": tree, "max_nodes": max_nodes, "plain_guard": False}, "retriever": {"name": "none"}}
        pipe = Pipeline.from_spec(spec, model)
        rows, widths, extend, observe = [], [], pipe.drafter.net.extend, pipe.drafter.observe

        def recording(embeds, features, positions, *rest):
            if len(positions) > 1 and bool((positions == positions[0]).all()):  # a draft level, not committed pairs
                rows.append((len(positions), pipe.drafter.breadth_limit))
            return extend(embeds, features, positions, *rest)

        def observing(state, outcome):
            tree = outcome.tree
            if pipe.drafter._proposing:  # the verified tree of a proposal, measured here on its own
                drafted = [n for n in range(1, len(tree)) if tree.sources[n] == DRAFTER]
                by_depth = collections.Counter(tree.depths[n] for n in drafted)
                by_parent = collections.Counter(tree.parents[n] for n in drafted)
                widths.append(max([*by_depth.values(), *by_parent.values()], default=0))
            observe(state, outcome)

        monkeypatch.setattr(pipe.drafter.net, "extend", recording)
        monkeypatch.setattr(pipe.drafter, "observe", observing)
        result = pipe.generate([1, 2, 3, 4] * 3, 40, seed=0, ignore_eos=True)
        return pipe, rows, widths, result

    pipe, rows, widths, result = level_rows("auto", 3)  # a step verifies at most 3 drafted nodes
    assert result.stats.steps > 8 and rows and widths
    assert all(count <= limit for count, limit in rows)
    recent = list(pipe.drafter.verified_breadths)  # the last 8 (the first proposal's start value until then)
    assert recent[-len(widths[-8:]):] == widths[-8:]  # the drafter measured the trees as the test does
    assert pipe.drafter.breadth_limit == max(recent) + 1 <= 4  # narrower than configured
    _, rows, _, result = level_rows("fixed", 3)  # a step verifies at most 3 drafted nodes
    assert result.stats.steps > 12 and rows and max(count for count, _ in rows) <= 3
    _, rows, _, _ = level_rows("fixed", 64)
    assert rows and min(count for count, _ in rows) == 10  # every candidate verified: nothing cut


def test_the_level_economy_drafts_a_level_while_the_run_says_it_can_pay():
    """Depth k+1 is drafted while reach(k) x CONDITIONAL x seconds per token exceeds a
    level's seconds; until enough steps are seen, the whole limit."""
    from tokenswift.drafters.eagle import LevelEconomy

    economy = LevelEconomy()
    assert economy.deepest(6) == 6  # nothing seen yet
    for accepted in [0, 1, 1, 2, 1, 2, 3, 1] * 4:  # reach(1) = 7/8, reach(2) = 3/8, reach(3) = 1/8
        economy.observe(accepted, accepted + 1)
    economy.observe(None, 1)  # a step the drafter proposed nothing in: not counted
    assert economy.reach(1) == 7 / 8 and economy.reach(3) == 1 / 8
    economy.level_took(0.002)
    economy.token_seconds = 0.020  # 20 ms a token: depth k+1 pays while reach(k) > 0.2
    assert economy.deepest(6) == 3
    economy.token_seconds = 0.040  # tokens dearer (a long context): reach(3) = 1/8 > 0.1 pays too
    assert economy.deepest(6) == 4 and economy.deepest(2) == 2


@pytest.mark.parametrize("shallow_pays", [True, False])
def test_speculative_steps_choose_between_depth_one_and_the_rule_by_their_rate(monkeypatch, shallow_pays):
    """Each proposal's arm (depth 1 alone, or the rule's depth) is judged by its step's
    tokens per second, from the proposal's start to the step's end: the arm that pays
    more drafts most proposals, and its proposals draft as it says. A step that compiled
    a graph is not counted. The clock is pinned: no timing of this machine is tested."""
    from tokenswift.drafters import eagle

    clock = [0.0]
    monkeypatch.setattr(eagle.time, "perf_counter", lambda: clock[0])
    economy = eagle.LevelEconomy()
    economy.level_seconds, economy.token_seconds = 0.001, 0.010
    economy.accepted.extend([3] * economy.STEPS)  # the rule alone would draft deep
    arms = []
    for step in range(400):
        economy.proposing()
        arms.append(economy.arm)
        assert economy.deepest(6) == (1 if economy.arm else 4)  # the rule: one past the depth every step reached
        # a shallow step: 1.5 tokens in 22 ms; a deep one: 2.0 tokens in 27 ms (or in 35)
        tokens, seconds = (1.5, 0.022) if economy.arm else (2.0, 0.027 if not shallow_pays else 0.035)
        clock[0] += seconds
        economy.observe(None, tokens, compiled=step == 5)
    later = arms[100:]
    share = later.count(True) / len(later)
    assert (share > 0.8) if shallow_pays else (share < 0.2)
    assert sum(economy.shallow.samples.values()) == 399  # the compiling step left out


def test_chosen_trees_draft_as_deep_as_the_economy_says_fixed_ones_as_configured(tmp_path):
    """After a run, a drafter of chosen trees drafts deep while deep drafts are accepted
    and levels are cheap against a token, one level once nothing drafted is accepted; a
    drafter of fixed trees drafts what it is configured to either way. The economy's
    timings are pinned: what this machine measured (and whether its auto trees drafted
    at all in 30 tokens) is no part of the rule tested."""
    model = tiny_model_for("llama-gqa", "float64")
    drafter = {"weights": decisive_net(model, tmp_path), "threshold": 0.0}
    pipes = {tree: Pipeline.from_spec({"preset": "eagle", "drafter": drafter, "speculation": {"tree": tree}}, model)
             for tree in ("auto", "fixed")}
    depth = pipes["auto"].drafter.options.depth
    assert depth > 1
    for pipe in pipes.values():
        pipe.generate([5, 9, 17, 3] * 3, 30, seed=0, ignore_eos=True)
        economy = pipe.drafter.economy
        economy.shallow, economy.arm = None, None  # the rule alone, not the run's choice between it and depth 1
        economy.level_seconds, economy.token_seconds = 0.001, 0.010  # a level costs a tenth of a token
        pipe.drafter.verified_depths.append(depth)  # the tree choice verified the deepest level
        economy.accepted.extend([depth] * economy.STEPS)  # and every step accepted all of it
    assert pipes["auto"].drafter.depth_limit == depth
    for pipe in pipes.values():
        pipe.drafter.economy.accepted.extend([0] * pipe.drafter.economy.STEPS)  # nothing drafted is accepted any more
    assert pipes["auto"].drafter.depth_limit == 1
    assert pipes["fixed"].drafter.depth_limit == depth
    pipes["auto"].drafter.economy.level_seconds = 0.1  # and where a level costs more than a token, never deep
    pipes["auto"].drafter.economy.accepted.extend([depth] * economy.STEPS)
    assert pipes["auto"].drafter.depth_limit == 1


def test_chosen_trees_start_small_and_plain_steps_do_not_narrow_them(tmp_path):
    """Where the tree choice verifies, the first proposal drafts two levels below depth 1
    and expands three nodes a level, three children each (it grows with what the choice
    verifies); fixed trees
    draft everything from the first step. Steps that asked for no proposal (plain steps,
    ``max_nodes = 0`` or the plain guard's) leave what the drafter learnt of the verified
    trees as it was: after a stretch of them a proposal is as wide as before it."""
    model = tiny_model_for("llama-gqa", "float64")
    drafter = {"weights": decisive_net(model, tmp_path), "threshold": 0.0}

    def started(tree, max_nodes=64):
        spec = {"preset": "eagle", "drafter": drafter, "speculation": {"tree": tree, "max_nodes": max_nodes}}
        pipe = Pipeline.from_spec(spec, model)
        generation = pipe.start([5, 9, 17, 3] * 3, 24, seed=0, ignore_eos=True)
        generation.prefill()
        return pipe, generation

    pipe, _ = started("auto")
    assert (pipe.drafter.depth_limit, pipe.drafter.breadth_limit) == (3, 3)
    pipe, _ = started("fixed")
    options = pipe.drafter.options
    assert pipe.drafter.depth_limit == options.depth and pipe.drafter.breadth_limit >= max(options.width, options.children)
    pipe, generation = started("auto", max_nodes=0)
    steps = list(generation.steps())
    assert len(steps) == 24 and all(step.candidates == 0 for step in steps)  # no proposal asked
    assert (pipe.drafter.depth_limit, pipe.drafter.breadth_limit) == (3, 3)


@pytest.mark.parametrize("preset", ["eagle", "tokenswift"])
def test_the_first_proposal_after_plain_steps_reports_its_catch_up(tmp_path, preset):
    """The first proposal after steps that asked for none says what catching up on
    their pairs took (Drafter.catch_up_seconds); a proposal after a step that proposed
    has nothing to catch up on and says 0. So does the ``tokenswift`` drafter with the
    draft layer below its pass."""
    model = tiny_model_for("llama-gqa", "float64")
    drafter = {"weights": decisive_net(model, tmp_path)} | ({"levels": "layer"} if preset == "tokenswift" else {})
    spec = {"preset": preset, "drafter": drafter, "retriever": {"name": "none"},
            "sampling": {"greedy": True}, "speculation": {"tree": "fixed", "max_nodes": 8}}
    pipe = Pipeline.from_spec(spec, model)
    propose, calls, reported = pipe.drafter.propose, [0], []

    def every_third(state, inputs):
        calls[0] += 1
        if calls[0] % 3 == 1:  # two steps in three plain
            reported.append(None)
            return []
        branches = propose(state, inputs)
        reported.append(pipe.drafter.catch_up_seconds)
        return branches

    pipe.drafter.propose = every_third
    pipe.generate([5, 9, 17, 3, 8, 1] * 2, 30, seed=0, ignore_eos=True)
    after_plain = [seconds for previous, seconds in zip(reported, reported[1:]) if previous is None and seconds is not None]
    after_proposal = [seconds for previous, seconds in zip(reported, reported[1:])
                      if previous is not None and seconds is not None]
    assert len(after_plain) >= 3 and all(seconds > 0 for seconds in after_plain)
    assert len(after_proposal) >= 3 and all(seconds == 0 for seconds in after_proposal)


def test_a_proposal_after_plain_steps_drafts_what_one_after_every_step_does(tmp_path):
    """After steps that asked for no proposal, the layer catches up on every pair they
    committed in one forward, and drafts from the last: the same drafts, at the same
    committed text, as a drafter that proposed at every step."""
    model = tiny_model_for("llama-gqa", "float64")
    drafter = {"weights": decisive_net(model, tmp_path), "threshold": 0.0, "depth": 3, "width": 3, "children": 3}
    spec = {"preset": "eagle", "drafter": drafter, "sampling": {"greedy": True}, "retriever": {"name": "none"},
            "speculation": {"tree": "fixed", "max_nodes": 8}}
    proposals = {}
    for skip in (False, True):
        pipe = Pipeline.from_spec(spec, model)
        propose, calls, seen = pipe.drafter.propose, [0], proposals.setdefault(skip, {})

        def recording(state, inputs, propose=propose, calls=calls, seen=seen, skip=skip):
            calls[0] += 1
            if skip and calls[0] % 3:  # two steps in three plain: their pairs wait
                return []
            branches = propose(state, inputs)
            seen[len(state.tokens)] = [tuple(b.tokens) for b in branches]
            return branches

        pipe.drafter.propose = recording
        pipe.generate([5, 9, 17, 3, 8, 1] * 2, 40, seed=0, ignore_eos=True)
    common = sorted(set(proposals[False]) & set(proposals[True]))
    assert len(common) >= 3
    assert all(proposals[True][n] == proposals[False][n] for n in common)


@settings(max_examples=12, deadline=None)
@given(arms=st.lists(st.booleans(), min_size=1, max_size=12), greedy=st.booleans(), seed=st.integers(0, 3))
def test_any_sequence_of_depth_arms_is_lossless(tmp_path_factory, arms, greedy, seed):
    """Whatever each proposal's arm (depth 1 alone or the level rule; here a scripted
    sequence, cycled, in place of the rate chooser), chosen trees emit what
    autoregressive decoding does, greedy and sampled."""
    from tokenswift.drafters import eagle

    class Scripted:
        def __init__(self, **_):
            self.picks = iter(arms * 64)

        def pick(self):
            return next(self.picks)

        def observe(self, *args, **kwargs):
            pass

    model = tiny_model_for("llama-gqa", "float64")
    drafter = {"weights": decisive_net(model, tmp_path_factory.mktemp("arms")), "threshold": 0.0}
    spec = {"preset": "eagle", "drafter": drafter, "sampling": {"greedy": greedy}}
    original = eagle.RateChooser
    eagle.RateChooser = Scripted
    try:
        pipe = Pipeline.from_spec(spec, model)
        assert_lossless(pipe, [5, 9, 17, 3, 8, 5, 9], 30, seed=seed)
        assert isinstance(pipe.drafter.economy.shallow, Scripted)
    finally:
        eagle.RateChooser = original
