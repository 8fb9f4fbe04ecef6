"""docs/plugins.md documents every hook, every hook has a test, and its examples run."""

import re
from pathlib import Path

import tokenswift.hookspecs as hookspecs

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "plugins.md").read_text()
HOOKS = sorted(name for name in vars(hookspecs) if name.startswith("tokenswift_"))


def test_every_hook_has_a_documentation_entry_and_a_test():
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_docs.py")
    assert HOOKS == ["tokenswift_generation_end", "tokenswift_generation_start", "tokenswift_register_components", "tokenswift_step_end"]
    for hook in HOOKS:
        assert f"### `{hook}`" in DOC, f"{hook} is not documented in docs/plugins.md"
        assert re.search(rf"def {hook}\(", tests), f"{hook} has no test implementing it"


def test_every_interface_is_documented():
    for heading in ("### Retriever", "### Drafter", "### Cache policy", "### Penalty", "### Verifier"):
        assert heading in DOC


def test_the_python_examples_run():
    namespace: dict = {}
    blocks = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)
    assert len(blocks) >= 7
    for block in blocks:
        exec(compile(block, "docs/plugins.md", "exec"), namespace)  # noqa: S102 - our own docs
