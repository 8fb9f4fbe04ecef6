"""The self-distillation corpus: the target's own continuations, in resumable shards
that the training commands read."""

import json

from tokenswift.cli import main
from tokenswift.testing import word_tokenizer
from tokenswift.tools.self_distill import read_shards
from tokenswift.tools.training import read_corpus

WORDS = "the cat sat on the mat a dog " * 40


def books(tmp_path):
    path = tmp_path / "books.jsonl"
    lines = [{"id": "one", "text": WORDS}, {"id": "two", "text": WORDS[::-1]}, {"id": "held", "text": "the mat " * 50}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_distill_writes_resumable_shards_the_trainers_read(tmp_path, model_dir, capsys):
    out = tmp_path / "corpus"
    args = ["distill", "--model", str(model_dir), "--dtype", "float32", "--data", str(books(tmp_path)), "--out", str(out),
            "--shards", "3", "--batch", "2", "--prompt-tokens", "6", "--new-tokens", "5", "--holdout", "held"]
    assert main(args) == 0
    records = read_shards(out)
    assert len(records) == 6 and [r["decoding"] for r in records[::2]] == ["greedy", "sampled", "greedy"]
    assert all(r["new_tokens"] == 5 and r["prompt_tokens"] == 6 and len(r["text"].split()) >= 8 for r in records)
    record = json.loads((out / "distill.json").read_text())
    assert record["held_out_books"] == ["held"] and record["command"].startswith("tokenswift distill")
    # Resumed: nothing is written twice; a lost shard comes back the same.
    lost = (out / "shard-0001.jsonl").read_text()
    (out / "shard-0001.jsonl").unlink()
    assert main(args) == 0
    again = json.loads((out / "distill.json").read_text())
    assert again["written_this_run"] == ["shard-0001.jsonl"] and (out / "shard-0001.jsonl").read_text() == lost
    corpus = read_corpus(out, word_tokenizer(), ("nothing",))  # a directory of shards
    assert len(corpus.train_ids) == 6 and corpus.held_out_ids == ("last 5%",)


def test_distill_refuses_bad_sizes_with_one_line(tmp_path, model_dir, capsys):
    code = main(["distill", "--model", str(model_dir), "--data", str(books(tmp_path)), "--out", str(tmp_path / "c"),
                 "--batch", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "batch" in err


def test_distill_chat_shards_prompt_through_the_tokenizers_template(tmp_path, model_dir, capsys):
    import shutil

    chat_dir = tmp_path / "chat-model"
    shutil.copytree(model_dir, chat_dir)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}a dog {{ m['content'] }} a dog {% endfor %}{% if add_generation_prompt %}on{% endif %}"
    tokenizer.save_pretrained(chat_dir)
    out = tmp_path / "corpus"
    args = ["distill", "--model", str(chat_dir), "--dtype", "float32", "--data", str(books(tmp_path)), "--out", str(out),
            "--shards", "2", "--batch", "2", "--prompt-tokens", "6", "--new-tokens", "5", "--holdout", "held", "--chat"]
    assert main(args) == 0
    records = read_shards(out)
    assert [r["prompt"] for r in records] == ["chat"] * 4
    for record in records:
        words = record["text"].split()
        assert words[:2] == ["a", "dog"] and 1 <= record["new_tokens"] <= 5  # the template's user turn opens the text
        assert record["prompt_tokens"] > 6  # the excerpt inside the instruction and the template
    # No template: one clear line, nothing written.
    capsys.readouterr()
    code = main(["distill", "--model", str(model_dir), *args[3:8], str(tmp_path / "none"), *args[9:]])
    err = capsys.readouterr().err
    assert code == 2 and "no chat template" in err and err.count("\n") == 1
    assert not list((tmp_path / "none").glob("shard-*"))
