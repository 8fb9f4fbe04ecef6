"""Training heads: learning happens, checkpoints resume exactly, the CLI records the run."""

import json

import pytest
import torch

from tokenswift import Pipeline
from tokenswift.cli import main
from tokenswift.drafters.draft_heads import DraftHeads
from tokenswift.tools.training import Corpus, TrainConfig, read_corpus, train_heads
from tokenswift.testing import FIXED_TREE, word_tokenizer, looping_model, tiny_model_for

CONFIG = dict(seq_len=32, batch=4, positions=0, warmup=2, lr=1e-2, eval_windows=8, holdout=("held",))


def cyclic_corpus():
    """Text the looping model itself writes: a cycle that heads can learn to predict."""
    pipe = Pipeline.from_spec("ar", looping_model(), overrides={"sampling": {"greedy": True}, "penalty": {"name": "none"}})
    tokens = torch.tensor(pipe.generate([3, 1, 4], 300, ignore_eos=True).tokens)
    return Corpus(train=tokens[:240], held_out=tokens[200:], train_ids=("loop",), held_out_ids=("held",))


def test_training_teaches_the_heads(tmp_path):
    model = looping_model()
    record = train_heads(model, cyclic_corpus(), tmp_path, TrainConfig(steps=40, **CONFIG))
    accuracy = record["held_out_accuracy"]
    assert min(accuracy["top1"]) > 0.9, accuracy  # a deterministic cycle is learnable
    heads = DraftHeads.from_pretrained(tmp_path, model)
    assert heads.num_heads == 3
    spec = {"preset": "tokenswift", "drafter": {"heads": str(tmp_path)}, "sampling": {"greedy": True}, "penalty": {"name": "none"}, **FIXED_TREE}
    result = Pipeline.from_spec(spec, model).generate([3, 1, 4], 40, ignore_eos=True)
    assert result.stats.tokens_per_step > 3  # trained heads are accepted


def test_resume_continues_exactly(tmp_path):
    model = tiny_model_for("llama-gqa")
    corpus = Corpus(train=torch.arange(400) % 64, held_out=torch.arange(100) % 64, train_ids=("a",), held_out_ids=("held",))
    straight = tmp_path / "straight"
    train_heads(model, corpus, straight, TrainConfig(steps=8, checkpoint_every=4, **CONFIG))
    resumed = tmp_path / "resumed"

    def interrupt_at_step_6(step, metrics):
        if step == 6:
            raise KeyboardInterrupt  # steps 5-6 done, checkpoint at 4

    with pytest.raises(KeyboardInterrupt):
        train_heads(model, corpus, resumed, TrainConfig(steps=8, checkpoint_every=4, **CONFIG), progress=interrupt_at_step_6)
    train_heads(model, corpus, resumed, TrainConfig(steps=8, checkpoint_every=4, **CONFIG), resume=True)
    a = DraftHeads.from_pretrained(straight).state_dict()
    b = DraftHeads.from_pretrained(resumed).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_read_corpus_holds_out_named_books(tmp_path):
    data = tmp_path / "books.jsonl"
    data.write_text(
        json.dumps({"id": "one", "text": "the cat sat on the mat"}) + "\n"
        + json.dumps({"id": "two", "text": "a dog sat"}) + "\n"
    )
    corpus = read_corpus(data, word_tokenizer(), ("two",))
    assert corpus.train.tolist() == [1, 2, 3, 4, 1, 5] and corpus.held_out.tolist() == [6, 7, 3]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    with pytest.raises(Exception, match=r"bad.jsonl:1: expected a JSON object with a 'text' key"):
        read_corpus(bad, word_tokenizer(), ())


def model_and_books(tmp_path):
    """A tiny looping model with a word tokenizer saved in tmp_path/model, and two
    books ("train", "held") in tmp_path/books.jsonl: what the training commands need."""
    model_dir = tmp_path / "model"
    looping_model(dtype="float32").save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "books.jsonl"
    text = " ".join(["the cat sat on the mat", "a dog sat on the cat"] * 40)
    data.write_text(json.dumps({"id": "train", "text": text}) + "\n" + json.dumps({"id": "held", "text": text}) + "\n")
    return model_dir, data


def test_cli_train_heads_records_the_run(tmp_path, capsys):
    model_dir, data = model_and_books(tmp_path)
    out = tmp_path / "heads"
    argv = ["train-heads", "--model", str(model_dir), "--dtype", "float32", "--data", str(data), "--out", str(out),
            "--steps", "4", "--seq-len", "32", "--batch", "2", "--holdout", "held", "--checkpoint-every", "2"]
    assert main(argv) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["command"].startswith("tokenswift train-heads --model")
    assert record["held_out_books"] == ["held"] and len(record["held_out_accuracy"]["top3"]) == 3
    assert (out / "model.safetensors").is_file() and (out / "checkpoint.pt").is_file()
    assert main([*argv, "--steps", "6", "--resume"]) == 0
    capsys.readouterr()
    assert main(["train-heads", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "x"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_cli_train_heads_init_starts_from_trained_heads(tmp_path, capsys):
    from tokenswift.drafters.draft_heads import DraftHeads

    model_dir, data = model_and_books(tmp_path)
    common = ["--model", str(model_dir), "--dtype", "float32", "--data", str(data), "--seq-len", "32", "--batch", "2",
              "--holdout", "held"]
    assert main(["train-heads", *common, "--out", str(tmp_path / "a"), "--steps", "3"]) == 0
    assert main(["train-heads", *common, "--out", str(tmp_path / "b"), "--steps", "1", "--lr", "1e-9",
                 "--init", str(tmp_path / "a")]) == 0
    assert main(["train-heads", *common, "--out", str(tmp_path / "c"), "--steps", "1", "--lr", "1e-9"]) == 0
    a, b, c = (DraftHeads.from_pretrained(tmp_path / name).state_dict() for name in "abc")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)  # continued from a
    assert not all(torch.allclose(a[k], c[k], atol=1e-6) for k in a)  # a fresh start is not a
    capsys.readouterr()
    code = main(["train-heads", *common, "--out", str(tmp_path / "d"), "--steps", "1", "--num-heads", "2",
                 "--init", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 2 and "3 heads there" in err


def feature_cache(model, corpus, directory, penalty=1.0):
    """The target's cached features over windows of ``corpus`` (train-drafter's first phase)."""
    from tokenswift.tools.drafter_training import DrafterTrainConfig, cache_features, load_feature_cache

    cache_features(model, corpus, directory, DrafterTrainConfig(windows=16, seq_len=32))
    return load_feature_cache(model, directory, penalty)


def test_self_distilled_heads_learn_the_target(tmp_path):
    model = looping_model()
    corpus = cyclic_corpus()
    cache = feature_cache(model, corpus, tmp_path / "features")
    assert cache.windows.shape == (16, 32) and cache.features.shape[:2] == (16, 32)
    # the cached greedy tokens are the target's own next tokens after the text so far
    logits = model(cache.windows[:1]).logits[0]
    assert torch.equal(cache.greedy[0], logits.argmax(-1))
    config = TrainConfig(steps=40, penalty=1.0, **CONFIG)
    record = train_heads(model, corpus, tmp_path / "heads", config, cache=cache)
    accuracy = record["held_out_accuracy"]
    assert min(accuracy["greedy_top1"]) > 0.9, accuracy  # each head predicts the target i + 2 tokens ahead
    assert record["trained_on"].startswith("the target's own")


def test_feature_cache_errors_name_the_folder(tmp_path):
    from tokenswift.tools.drafter_training import load_feature_cache

    with pytest.raises(Exception, match=r"no cached features in .*empty"):
        load_feature_cache(looping_model(), tmp_path / "empty", 1.0)


def test_cli_train_heads_on_the_targets_features(tmp_path, capsys):
    model_dir, data = model_and_books(tmp_path)
    features = tmp_path / "features"
    common = ["--model", str(model_dir), "--dtype", "float32", "--data", str(data), "--seq-len", "32", "--holdout", "held"]
    assert main(["train-drafter", *common, "--out", str(tmp_path / "eagle"), "--features", str(features),
                 "--windows", "8", "--steps", "1", "--batch", "2"]) == 0
    out = tmp_path / "heads"
    assert main(["train-heads", *common, "--out", str(out), "--features", str(features), "--steps", "3",
                 "--batch", "2"]) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["features"] == str(features) and record["tokens_seen"] == 3 * 2 * 32
    assert len(record["held_out_accuracy"]["greedy_top1"]) == 3
    assert "the target's greedy token" in capsys.readouterr().err
    code = main(["train-heads", *common, "--out", str(tmp_path / "x"), "--features", str(tmp_path / "none")])
    assert code == 2 and "no cached features" in capsys.readouterr().err
    code = main(["train-heads", *common, "--out", str(tmp_path / "x"), "--features", str(features), "--penalty", "0.5"])
    assert code == 2 and "penalty" in capsys.readouterr().err
