"""The README a newcomer reads: short, and what it shows runs as printed."""

import re
import shlex
from pathlib import Path

import pytest

from tokenswift.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_fits_in_five_minutes():
    assert len(README.splitlines()) <= 300


def test_its_python_examples_run():
    local = ["\n".join(lines) for lines in blocks("python")]
    local = [block for block in local if "openai" not in block]  # the client example needs a running server
    assert local
    for block in local:
        exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - our own docs


def blocks(language: str = "") -> list[list[str]]:
    """The README's fenced blocks opened with ``` + ``language``, as lists of lines."""
    found, inside, wanted = [], False, False
    for line in README.splitlines():
        if line.startswith("```"):
            if not inside:
                wanted = line == "```" + language
                if wanted:
                    found.append([])
            inside = not inside
        elif inside and wanted:
            found[-1].append(line)
    return found


def transcripts():
    """``$ tokenswift ...`` lines of the README's console blocks with the lines printed after them."""
    found = []
    for lines in blocks():
        for i, line in enumerate(lines):
            if line.startswith("$ tokenswift ") and i + 1 < len(lines) and lines[i + 1].startswith("tokenswift: error"):
                found.append((shlex.split(line[2:])[1:], lines[i + 1]))
    return found


@pytest.mark.parametrize("argv,printed", transcripts())
def test_its_error_transcripts_print_what_they_show(argv, printed, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == printed


def test_it_has_error_transcripts():
    assert transcripts()


def test_every_doc_it_links_exists():
    for path in re.findall(r"`((?:docs|benchmarks|plugins|tests|tokenswift)/[\w./-]+)`", README):
        assert (ROOT / path).exists(), path


def test_its_spec_is_a_valid_spec():
    import tomllib

    from tokenswift.registry import build_registry, get_plugin_manager
    from tokenswift.spec import PipelineSpec

    (toml,) = ["\n".join(lines) for lines in blocks("toml")]
    spec = PipelineSpec.from_dict(tomllib.loads(toml), build_registry(get_plugin_manager()).presets)
    assert spec.to_dict()["verifier"]["name"] == "tree-sampling"
