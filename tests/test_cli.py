"""The command line: a real run on a saved tiny model, and one clear line per bad input."""

import json
import re
from pathlib import Path

import pytest

from tokenswift.cli import main
from tokenswift.testing import tiny_model_for, word_tokenizer


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
    # where the steps' time went, by kind of step (GenerationStats.stage_profile)
    assert set(stats["stages"]) <= {"speculated", "plain"}
    assert sum(kind["steps"] for kind in stats["stages"].values()) == stats["steps"]
    assert all(set(kind["stage_ms"]) == {"propose", "forward", "verify", "commit"} for kind in stats["stages"].values())
    assert out_file.read_text().split() and not list(tmp_path.glob("*.partial"))
    assert "tokens_per_second=" in err


def test_generate_streams_to_stdout(model_dir, capsys):
    code, out, err = run(
        capsys, "generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", "a dog",
        "--max-new-tokens", "6", "--greedy", "--ignore-eos", "--quiet",
    )
    assert code == 0 and err == ""
    assert len(out.split()) == 6 and set(out.split()) <= set(word_tokenizer().get_vocab())


def test_spec_file(tmp_path, model_dir, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text(f'preset = "medusa"\n[model]\npath = "{model_dir}"\ndtype = "float32"\n[sampling]\ngreedy = true\n')
    code, out, err = run(capsys, "generate", "--spec", str(spec), "--prompt", "the mat", "--max-new-tokens", "5", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--preset", "nope"], "unknown preset 'nope'; valid presets: ['ar', 'eagle', 'medusa', 'prompt-lookup', 'tokenswift']"),
        (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer, got 0"),
        (["generate", "--max-new-tokens", "ten"], "invalid int value: 'ten'"),
        (["generate", "--prompt", "   "], "the prompt is empty"),
        (["generate", "--prompt-file", "/nonexistent/p.txt"], "prompt file not found: /nonexistent/p.txt"),
        (["generate", "--spec", "/nonexistent/s.toml"], "spec file not found: /nonexistent/s.toml"),
        (["generate", "--model", "/nonexistent/model"], "model path '/nonexistent/model' not found"),
        (["generate", "--preset", "ar", "--heads", "/x", "--prompt", "p"], "drafter 'none' has no option(s) ['heads']"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["bench", "--contexts", "1", "2048"], "--contexts must be prompt lengths of at least 2 tokens, got [1]"),
        (["bench", "--contexts", "2048", "--interleaved"], "--contexts is its own comparison"),
        (["bench", "--contexts", "2048", "--compile", "all"], "--compile all is for --interleaved; --contexts takes --compile off or on"),
        (["bench", "--contexts", "2048", "--methods", "ar,nope"], "--contexts compares presets and references; unknown ['nope']"),
        (["bench", "--contexts", "2048", "--new-tokens", "0"], "--new-tokens must be positive, got 0"),
        (["bench", "--contexts", "2048", "--prompt-file", "/nonexistent/p.txt"], "prompt file not found: /nonexistent/p.txt"),
        (["bench", "--interleaved", "--prompt-file", "/nonexistent/p.txt"], "prompt file not found: /nonexistent/p.txt"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    code, out, err = run(capsys, *argv, *(["--out", str(tmp_path / "o.txt")] if argv[0] == "generate" else []))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("tokenswift: error: ") and message in err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir()), "no output file may be left behind"


def _help(capsys, command: str) -> str:
    """``tokenswift COMMAND --help``, its lines rejoined (argparse wraps them)."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_generate_help_says_which_dtypes_give_identical_tokens(capsys):
    text = _help(capsys, "generate")
    # The contract in words: float32/float64 token for token, bfloat16 in distribution only,
    # for a seed against ar and for --resume against the uninterrupted run; and the way out.
    assert "in float32 and float64 a speculative preset emits" in text and "exactly the tokens --preset ar emits" in text
    assert "--resume continues exactly as the uninterrupted run" in text
    assert "In bfloat16 (what --dtype auto picks" in text and "agree in distribution, not token for token" in text
    assert "--dtype float32 for token-identical runs" in text
    assert "in float32 up to a rounding tie" in text and "in float64 without exception" in text
    import argparse

    from tokenswift.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.option_strings[-1]: a.help for a in sub.choices["generate"]._actions}
    for flag in ("--dtype", "--seed", "--resume"):  # each flag's own help says it too
        assert "float32" in helps[flag] and helps[flag] in text, flag


def test_float32_runs_of_a_speculative_preset_and_ar_emit_the_same_tokens(model_dir, capsys):
    """What ``generate --help`` promises for float32, through the command line."""
    texts = {}
    for preset in ("tokenswift", "ar"):
        code, out, err = run(
            capsys, "generate", "--preset", preset, "--model", str(model_dir), "--dtype", "float32", "--prompt",
            "the cat sat on the mat", "--max-new-tokens", "40", "--seed", "7", "--ignore-eos", "--quiet",
        )
        assert code == 0, err
        texts[preset] = out
    # 40 tokens: words, and a few that join a word or print nothing (special tokens)
    assert 30 <= len(texts["ar"].split()) <= 40 and texts["tokenswift"] == texts["ar"]


def test_the_training_flags_default_to_their_configs(capsys):
    """One authority for the defaults: train-heads and train-drafter take theirs from the
    config each fills, field by field."""
    import attrs

    from tokenswift.cli import build_parser
    from tokenswift.tools.drafter_training import DrafterTrainConfig
    from tokenswift.tools.training import TrainConfig

    for command, config in (("train-heads", TrainConfig), ("train-drafter", DrafterTrainConfig)):
        args = vars(build_parser().parse_args([command, "--data", "d.jsonl", "--out", "o"]))
        fields = {field.name: field.default for field in attrs.fields(config)}
        flags = fields.keys() & args.keys()
        assert {"steps", "seq_len", "batch", "lr", "warmup", "seed", "checkpoint_every", "holdout"} <= flags, command
        for name in flags:
            expected = ",".join(fields[name]) if name == "holdout" else fields[name]
            assert args[name] == expected, (command, name)
    assert "training windows whose features are cached (default 512)" in _help(capsys, "train-drafter")


def test_each_command_module_holds_its_arguments_and_its_handler():
    from pathlib import Path

    import tokenswift.commands
    from tokenswift.cli import COMMANDS

    modules = {p.stem for p in Path(tokenswift.commands.__file__).parent.glob("*.py")} - {"__init__"}
    assert {module.__name__.rsplit(".", 1)[1] for module in COMMANDS.values()} == modules
    for name, module in COMMANDS.items():
        assert module.NAME == name and module.HELP and callable(module.add_arguments) and callable(module.run)


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


def _spec(tmp_path, model_dir, body):
    path = tmp_path / "spec.toml"
    path.write_text(f'preset = "tokenswift"\n[model]\npath = "{model_dir}"\ndtype = "float32"\n' + body)
    return str(path)


def _other_heads(tmp_path):
    from tokenswift.drafters.draft_heads import DraftHeads

    DraftHeads.random(tiny_model_for("llama-gqa", "float32", seed=9)).save_pretrained(tmp_path / "heads")
    return str(tmp_path / "heads")


def _bad_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF but not really")
    return str(path)


BAD_RUNS = {
    "prompt longer than the context": (
        lambda t, m: ["--model", str(m), "--dtype", "float32", "--prompt", "the " * 600],
        "the prompt has 600 tokens, more than the model's context of 512 positions",
    ),
    "heads of another model": (
        lambda t, m: ["--model", str(m), "--dtype", "float32", "--prompt", "the cat", "--heads", _other_heads(t)],
        "were made for another model: fingerprint",
    ),
    "malformed tree template": (
        lambda t, m: ["--spec", _spec(t, m, "[drafter]\ntree = [1, 0]\n"), "--prompt", "the cat"],
        "drafter.tree widths must be >= 1, got [1, 0]",
    ),
    "negative penalty window": (
        lambda t, m: ["--spec", _spec(t, m, "[penalty]\nwindow = -1\n"), "--prompt", "the cat"],
        "penalty.window must be >= 0, got -1",
    ),
    "wrong option type": (
        lambda t, m: ["--spec", _spec(t, m, '[retriever]\ntop_k = "many"\n'), "--prompt", "the cat"],
        "retriever.top_k must be an integer >= 0, got 'many'",
    ),
    "cuda without a GPU": (
        lambda t, m: ["--spec", _spec(t, m, "").replace("spec.toml", "spec.toml"), "--prompt", "the cat"],
        None,
    ),
    "unreadable GGUF": (
        lambda t, m: ["--model", _bad_gguf(t), "--prompt", "the cat"],
        "cannot load a model from",
    ),
    "a prompt that is not valid text": (  # a command-line argument that is not UTF-8 decodes to surrogates
        lambda t, m: ["--model", str(m), "--dtype", "float32", "--prompt", "the \udcff cat"],
        "the prompt is not valid Unicode text: it has a lone surrogate '\\udcff' at character 4",
    ),
    "more tokens than memory can hold": (
        lambda t, m: ["--model", str(m), "--dtype", "float32", "--prompt", "the cat", "--max-new-tokens", str(10**12)],
        "but only",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_bad_runs_are_one_line_exit_2_and_leave_no_file(case, model_dir, tmp_path, capsys):
    import torch

    make_args, message = BAD_RUNS[case]
    args = make_args(tmp_path, model_dir)
    if case == "cuda without a GPU":
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
        spec = tmp_path / "spec.toml"
        spec.write_text(spec.read_text().replace('dtype = "float32"', 'dtype = "float32"\ndevice = "cuda"'))
        message = "'cuda' was asked for, but no CUDA GPU is available here"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, out, err = run(capsys, "generate", *args, "--out", str(out_dir / "o.txt"))
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("tokenswift: error: ") and message in err, err
    assert not list(out_dir.iterdir()), "no output file may be left behind"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--rope", "yarn:x", "--new-tokens", "4"], "a RoPE override must be TYPE:FACTOR like 'yarn:16', got 'yarn:x'"),
        (["bench", "--rope", "ntk:2", "--new-tokens", "4"], "model.rope.type must be one of ['yarn', 'linear', 'dynamic'], got 'ntk'"),
        (["bench", "--device", "tpu", "--new-tokens", "4"], "model.device must be one of"),
    ],
)
def test_bench_options_are_checked_before_anything_runs(argv, message, tmp_path, capsys):
    code, out, err = run(capsys, *argv, "--out", str(tmp_path / "b"))
    assert code == 2 and err.startswith("tokenswift: error: ") and message in err, err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("command", ["generate", "bench", "train-heads"])
def test_cuda_without_a_gpu_is_one_line(command, model_dir, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    extra = {
        "generate": ["--prompt", "the cat"],
        "bench": ["--new-tokens", "4", "--out", str(tmp_path / "b")],
        "train-heads": ["--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "h")],
    }[command]
    code, out, err = run(capsys, command, "--model", str(model_dir), "--device", "cuda", *extra)
    assert code == 2 and err.count("\n") == 1, err
    assert "'cuda' was asked for, but no CUDA GPU is available here" in err


def test_the_summary_names_the_dtype_auto_chose(model_dir, tmp_path, capsys):
    stats_file = tmp_path / "stats.json"
    code, out, err = run(
        capsys, "generate", "--model", str(model_dir), "--prompt", "a dog", "--max-new-tokens", "4", "--ignore-eos",
        "--stats-json", str(stats_file),
    )
    from tokenswift.model.dtypes import auto_dtype

    assert code == 0, err
    assert json.loads(stats_file.read_text())["dtype"] == auto_dtype("cpu") and f"dtype={auto_dtype('cpu')}" in err


def test_calibrate_measures_shows_and_caches(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(tmp_path))
    code, out, err = run(capsys, "calibrate", "--model", str(model_dir), "--dtype", "float32", "--show")
    assert code == 2 and "no calibration is cached" in err and err.count("\n") == 1
    code, out, err = run(capsys, "calibrate", "--model", str(model_dir), "--dtype", "float32")
    assert code == 0, err
    assert "float32 on cpu" in out and "| context | 1 node |" in out and "scoring one node:" in out
    assert "cached in" in err and len(list((tmp_path / "calibration").glob("*.json"))) == 1
    code, shown, err = run(capsys, "calibrate", "--model", str(model_dir), "--dtype", "float32", "--show")
    assert code == 0 and shown == out


def test_bench_interleaved_compares_presets_with_ar_in_turns(model_dir, tmp_path, capsys):
    out_dir = tmp_path / "versus"
    code, out, err = run(
        capsys, "bench", "--interleaved", "--model", str(model_dir), "--dtype", "float32", "--methods", "tokenswift,medusa",
        "--heads", "random", "--prompt-tokens", "12", "--new-tokens", "24", "--seeds", "0", "1", "--greedy",
        "--no-compiled-baseline", "--out", str(out_dir),
    )
    assert code == 0, err
    report = json.loads((out_dir / "interleaved.json").read_text())
    assert list(report["summary"]) == ["ar", "tokenswift", "medusa"] and report["summary"]["ar"]["ratio_to_ar"] == 1.0
    assert [run["seed"] for run in report["per_seed"]] == [0, 1]
    assert all(run[name]["same_tokens_as_ar"] for run in report["per_seed"] for name in ("tokenswift", "medusa"))
    assert report["config"]["dtype"] == "float32" and "| tokenswift |" in out


def test_bench_takes_its_prompts_from_a_prompt_file(model_dir, tmp_path, capsys):
    """--prompt-file: prompts longer than the bundled one (the first tokens of the file);
    one that is too short for the tokens asked is a one-line error naming it."""
    text = tmp_path / "long.txt"
    text.write_text("the cat sat on the mat . " * 8)
    common = ["bench", "--interleaved", "--model", str(model_dir), "--dtype", "float32", "--methods", "tokenswift",
              "--heads", "random", "--new-tokens", "8", "--seeds", "0", "--greedy", "--no-compiled-baseline",
              "--prompt-file", str(text)]
    code, out, err = run(capsys, *common, "--prompt-tokens", "40", "--out", str(tmp_path / "ok"))
    assert code == 0, err
    assert json.loads((tmp_path / "ok" / "interleaved.json").read_text())["per_seed"][0]["tokenswift"]["same_tokens_as_ar"]
    code, out, err = run(capsys, *common, "--prompt-tokens", "500", "--out", str(tmp_path / "short"))
    assert code == 2 and err.count("\n") == 1 and f"--prompt-file {text} has 56 tokens; 500 were asked for" in err
    assert not (tmp_path / "short").exists()


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The tiny model with a chat template in plain words of its vocabulary."""
    path = tmp_path_factory.mktemp("tiny-chat")
    tiny_model_for("llama-gqa", "float32").save_pretrained(path)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}a dog {% endif %}"
    )
    tokenizer.save_pretrained(path)
    return path


def test_generate_chat_applies_the_template_like_pipeline_generate(chat_model_dir, tmp_path, capsys):
    from tokenswift import Pipeline

    out_file, stats_file = tmp_path / "reply.txt", tmp_path / "stats.json"
    code, out, err = run(
        capsys, "generate", "--preset", "ar", "--model", str(chat_model_dir), "--dtype", "float32",
        "--chat", "the cat sat on the mat", "--system", "a dog", "--max-new-tokens", "10", "--seed", "4",
        "--out", str(out_file), "--stats-json", str(stats_file),
    )
    assert code == 0, err
    pipe = Pipeline.from_spec({"preset": "ar", "model": {"path": str(chat_model_dir), "dtype": "float32"}})
    messages = [{"role": "system", "content": "a dog"}, {"role": "user", "content": "the cat sat on the mat"}]
    expected = pipe.generate(messages=messages, max_new_tokens=10, seed=4)
    assert out_file.read_text() == expected.text
    # the template's text was the prompt: system turn, user turn, the assistant's opening
    assert json.loads(stats_file.read_text())["prompt_tokens"] == len(pipe.encode(pipe.chat_prompt(messages))) == 12


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chat", "the cat"], "has no chat template; pass a plain prompt instead"),
        (["--system", "be brief", "--prompt", "the cat"], "--system goes with --chat"),
        (["--chat", "  "], "--chat: the instruction is empty"),
    ],
)
def test_bad_chat_runs_are_one_line(argv, message, model_dir, tmp_path, capsys):
    out_file = tmp_path / "o.txt"
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--dtype", "float32", *argv, "--out", str(out_file))
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out_file.exists()


def test_version(capsys):
    from tokenswift import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"tokenswift {__version__}"


def test_the_progress_bar_shows_one_tokens_per_second_figure(model_dir, tmp_path, capsys):
    code, out, err = run(
        capsys, "generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", "a dog",
        "--max-new-tokens", "8", "--ignore-eos", "--out", str(tmp_path / "o.txt"),
    )
    assert code == 0, err
    bar = [line for line in err.replace("\r", "\n").splitlines() if "8/8" in line][-1]
    assert len(re.findall(r"tok/s(?!tep)|s/tok", bar)) == 1 and "tok/step" in bar, bar


# -- refused runs leave every file as it was (issue 55) ------------------------------------


@pytest.fixture(scope="module")
def finished_run(model_dir, tmp_path_factory):
    """A finished 8-token run's checkpoint (as JSON) and output text."""
    out = tmp_path_factory.mktemp("finished") / "o.txt"
    assert main(["generate", "--preset", "ar", "--model", str(model_dir), "--dtype", "float32", "--prompt", "the cat",
                 "--max-new-tokens", "8", "--seed", "1", "--ignore-eos", "--quiet", "--out", str(out)]) == 0
    return json.loads(out.with_name("o.txt.ckpt").read_text()), out.read_text()


def _unfinished(data):
    return {**data, "tokens": data["tokens"][:4], "finish_reason": "interrupted"}


BAD_CHECKPOINTS = {
    "not JSON": (lambda d: "{not json", "is not readable"),
    "truncated": (lambda d: json.dumps(d)[: len(json.dumps(d)) // 2], "is not readable"),
    "a JSON list": (lambda d: json.dumps([1, 2]), "is not a tokenswift checkpoint (tokenswift-checkpoint/3): a JSON list"),
    "tokens are strings": (lambda d: json.dumps({**d, "tokens": ["a", "b"]}), "tokens must be a list of token ids"),
    "an id outside the vocabulary, unfinished": (
        lambda d: json.dumps({**_unfinished(d), "tokens": [1, 999999999]}),
        "generated token ids [999999999] are outside the vocabulary [0, 64)",
    ),
    "an id outside the vocabulary, finished": (
        lambda d: json.dumps({**d, "tokens": d["tokens"][:-1] + [999999999]}),
        "generated token ids [999999999] are outside the vocabulary [0, 64)",
    ),
    "a prompt id outside the vocabulary": (
        lambda d: json.dumps({**d, "prompt_tokens": [64]}), "prompt token ids [64] are outside the vocabulary [0, 64)"
    ),
    "more tokens than max_new_tokens": (
        lambda d: json.dumps({**d, "max_new_tokens": 2}), "holds 8 generated tokens, more than its max_new_tokens (2)"
    ),
    "a seed out of range": (lambda d: json.dumps({**d, "seed": 2**64}), "seed must be an integer from 0 to 2**64-1"),
    "a damaged generator state": (lambda d: json.dumps({**_unfinished(d), "rng_state": "AAAA"}), "rng_state is not a generator state"),
    "a missing field": (lambda d: json.dumps({k: v for k, v in d.items() if k != "seed"}), "is incomplete: it has no ['seed']"),
    "a spec that is not a table": (lambda d: json.dumps({**d, "spec": "ar"}), "spec must be an object"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_resume_with_a_bad_checkpoint_leaves_every_file_as_it_was(case, finished_run, tmp_path, capsys):
    data, _ = finished_run
    make, message = BAD_CHECKPOINTS[case]
    out, ckpt = tmp_path / "o.txt", tmp_path / "o.txt.ckpt"
    out.write_bytes(b"the text generated before the crash, 55 bytes long....")
    ckpt.write_text(make(data))
    before = {path: path.read_bytes() for path in (out, ckpt)}
    code, _, err = run(capsys, "generate", "--resume", "--out", str(out))
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("tokenswift: error: ") and message in err, err
    assert {path: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_resume_of_a_good_checkpoint_rewrites_the_output_from_it(finished_run, tmp_path, capsys):
    data, text = finished_run
    out = tmp_path / "o.txt"
    out.write_text("stale")
    (tmp_path / "o.txt.ckpt").write_text(json.dumps(_unfinished(data)))
    code, _, err = run(capsys, "generate", "--resume", "--quiet", "--out", str(out))
    assert code == 0, err
    assert out.read_text() == text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--stats-json", "{d}/nodir/s.json"], "--stats-json {d}/nodir/s.json: the directory {d}/nodir does not exist"),
        (["--stats-json", "{d}"], "--stats-json {d} is a directory; give a file path"),
        (["--out", "{d}"], "--out {d} is a directory; give a file path"),
        (["--out", "{d}/o.txt", "--mkdir", "{d}/o.txt.ckpt"], "--out's checkpoint {d}/o.txt.ckpt is a directory; give a file path"),
        (["--seed", str(2**64)], "--seed must be an integer from 0 to 2**64-1 (18446744073709551615), got 18446744073709551616"),
        (["--seed", "-1"], "--seed must be an integer from 0 to 2**64-1 (18446744073709551615), got -1"),
        (["--model", "{d}/garbage.bin"], "model path '{d}/garbage.bin' is a file, but not a .gguf file"),
    ],
)
def test_paths_seeds_and_model_files_are_checked_before_the_run(extra, message, model_dir, tmp_path, capsys):
    """Each is refused in one line before the model loads: nothing written, nothing left
    (a --stats-json in a missing directory failed after the whole generation; a checkpoint
    path that is a directory, at the first checkpoint, leaving .o.txt.ckpt.tmp)."""
    (tmp_path / "garbage.bin").write_bytes(b"\x00" * 64)
    extra = [arg.format(d=tmp_path) for arg in extra]
    if "--mkdir" in extra:
        i = extra.index("--mkdir")
        Path(extra[i + 1]).mkdir()
        del extra[i : i + 2]
    before = sorted(tmp_path.rglob("*"))
    model = [] if "--model" in extra else ["--model", str(model_dir)]
    code, out, err = run(capsys, "generate", *model, "--dtype", "float32", "--prompt", "the cat", "--max-new-tokens", "300",
                         "--checkpoint-every", "4", "--quiet", *extra)
    assert code == 2, err
    assert err.startswith(f"tokenswift: error: {message.format(d=tmp_path)}") and err.count("\n") == 1, err
    assert sorted(tmp_path.rglob("*")) == before


def test_seeds_outside_the_documented_range_are_refused_by_the_python_api():
    from tokenswift import Pipeline
    from tokenswift.errors import SpecError

    pipe = Pipeline.from_spec("ar", tiny_model_for("llama-gqa", "float32"))
    assert pipe.generate([1, 2], 2, seed=2**64 - 1).seed == 2**64 - 1
    for seed in (2**64, -1, -(2**70), 10**40, 1.5, "7", True):
        with pytest.raises(SpecError, match=r"^seed must be an integer from 0 to 2\*\*64-1 \(18446744073709551615\), got "):
            pipe.generate([1, 2], 2, seed=seed)


def test_a_run_too_large_for_memory_is_one_line_without_a_warning_before_it(model_dir, tmp_path, capsys, caplog):
    """Past the trained context a run is warned about, but only once it is accepted: a
    refused one logged a WARNING line before its error."""
    out = tmp_path / "o.txt"
    code, _, err = run(capsys, "generate", "--preset", "ar", "--model", str(model_dir), "--dtype", "float32",
                       "--prompt", "the cat", "--max-new-tokens", str(10**12), "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and "lower --max-new-tokens (1000000000000)" in err, err
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == [] and not out.exists()


def test_generate_decodes_with_the_heap_frozen_and_gives_it_back(model_dir, monkeypatch, capsys):
    """The objects alive before the run are out of the garbage collector's scans while it
    decodes (gc.freeze), and collectable again after it, also when the run fails."""
    import gc

    from tokenswift import Pipeline

    seen = []
    original = Pipeline.generate

    def generate(self, *args, **kwargs):
        seen.append(gc.get_freeze_count())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "generate", generate)
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", "a dog",
                         "--max-new-tokens", "3", "--quiet")
    assert code == 0, err
    assert seen and seen[0] > 0 and gc.get_freeze_count() == 0

    def failing(self, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(Pipeline, "generate", failing)
    with pytest.raises(RuntimeError):
        main(["generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", "a dog", "--max-new-tokens", "3", "--quiet"])
    assert gc.get_freeze_count() == 0
