"""The command line: a real run on a saved tiny model, and one clear line per bad input."""

import json

import pytest

from tokenswift.cli import main
from tokenswift.testing import word_tokenizer, tiny_model_for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model_for("llama-gqa", "float32").save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_to_a_file_with_stats(tmp_path, model_dir, capsys):
    out_file, stats_file = tmp_path / "out.txt", tmp_path / "stats.json"
    code, out, err = run(
        capsys, "generate", "--preset", "tokenswift", "--model", str(model_dir), "--dtype", "float32",
        "--prompt", "the cat sat on the mat", "--max-new-tokens", "12", "--seed", "3", "--ignore-eos",
        "--out", str(out_file), "--stats-json", str(stats_file),
    )
    assert code == 0, err
    stats = json.loads(stats_file.read_text())
    assert stats["new_tokens"] == 12 and stats["seed"] == 3 and stats["preset"] == "tokenswift"
    assert out_file.read_text().split() and not list(tmp_path.glob("*.partial"))
    assert "tokens_per_second=" in err


def test_generate_streams_to_stdout(model_dir, capsys):
    code, out, err = run(
        capsys, "generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", "a dog",
        "--max-new-tokens", "6", "--greedy", "--ignore-eos", "--quiet",
    )
    assert code == 0 and set(out.split()) <= {"the", "cat", "sat", "on", "mat", "a", "dog"} and err == ""


def test_spec_file(tmp_path, model_dir, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text(f'preset = "medusa"\n[model]\npath = "{model_dir}"\ndtype = "float32"\n[sampling]\ngreedy = true\n')
    code, out, err = run(capsys, "generate", "--spec", str(spec), "--prompt", "the mat", "--max-new-tokens", "5", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--preset", "nope"], "unknown preset 'nope'; valid presets: ['ar', 'medusa', 'prompt-lookup', 'tokenswift']"),
        (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer, got 0"),
        (["generate", "--max-new-tokens", "ten"], "invalid int value: 'ten'"),
        (["generate", "--prompt", "   "], "the prompt is empty"),
        (["generate", "--prompt-file", "/nonexistent/p.txt"], "prompt file not found: /nonexistent/p.txt"),
        (["generate", "--spec", "/nonexistent/s.toml"], "spec file not found: /nonexistent/s.toml"),
        (["generate", "--model", "/nonexistent/model"], "model path '/nonexistent/model' not found"),
        (["generate", "--preset", "ar", "--heads", "/x", "--prompt", "p"], "drafter 'none' has no option(s) ['heads']"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    code, out, err = run(capsys, *argv, *(["--out", str(tmp_path / "o.txt")] if argv[0] == "generate" else []))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("tokenswift: error: ") and message in err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir()), "no output file may be left behind"


def test_malformed_toml_is_one_line(tmp_path, capsys):
    spec = tmp_path / "bad.toml"
    spec.write_text("preset = \n")
    code, out, err = run(capsys, "generate", "--spec", str(spec))
    assert code == 2 and "malformed TOML" in err and err.count("\n") == 1


def test_components_lists_every_kind_with_origin_and_options(capsys):
    code, out, err = run(capsys, "components")
    assert code == 0
    for line in ("drafter:", "tokenswift       [built-in]", "retriever:", "ngram", "cache:", "dynamic", "verifier:", "penalty:", "presets:"):
        assert line in out
    assert "options: n=4, top_k=20, keys=1, window=None" in out
