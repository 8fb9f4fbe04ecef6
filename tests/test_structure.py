"""The package's shape: the runtime (pipeline, model, components, specs, registry) stands
on its own. It imports none of the offline tools, the CLI's commands or matplotlib,
and its modules import each other without a circle."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tokenswift"
# Not runtime: the offline tools, the CLI and its commands, the HTTP server, and the test helpers.
NOT_RUNTIME = (
    "tokenswift.tools", "tokenswift.commands", "tokenswift.cli", "tokenswift.__main__", "tokenswift.server", "tokenswift.testing",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_runtime(name: str) -> bool:
    return not any(name == prefix or name.startswith(prefix + ".") for prefix in NOT_RUNTIME)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """tokenswift modules ``path`` imports, anywhere in it: functions and ``if
    TYPE_CHECKING:`` blocks included (an import for annotations alone is a dependency
    too, and hides a circle as well as any other)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # a submodule, or a name defined in the module
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: imported_modules(path, modules) - {name} for name, path in paths.items()}


def test_the_runtime_imports_no_tool_command_or_cli_module():
    graph = import_graph()
    leaks = {name: sorted(t for t in targets if not is_runtime(t)) for name, targets in graph.items() if is_runtime(name)}
    assert {name: t for name, t in leaks.items() if t} == {}


def test_no_import_circle_among_runtime_modules():
    graph = {name: {t for t in targets if is_runtime(t)} for name, targets in import_graph().items() if is_runtime(name)}
    # The package's __init__ only re-exports the public API; a module importing a
    # name from it (rather than from its home module) would be a circle.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                circle = stack[stack.index(target) :] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_building_and_running_a_pipeline_loads_no_tool_module_nor_matplotlib():
    script = """
import json, sys
from tokenswift import Pipeline
from tokenswift.model.loading import tiny_model
from tokenswift.testing import TINY_CONFIGS
pipe = Pipeline.from_spec({"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 24, "sink": 2},
                           "model": {"tiny": TINY_CONFIGS["llama-gqa"]}})
pipe.generate([1, 2, 3, 4], 12, seed=0, ignore_eos=True)
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("tokenswift.tools", "tokenswift.commands", "tokenswift.cli", "matplotlib")))))
"""
    env = {**os.environ, "TOKENSWIFT_DISABLE_PLUGINS": "all"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_a_generation_decodes_with_what_start_prepared_and_never_reaches_back():
    from tokenswift import Pipeline
    from tokenswift.decoding import DecodingSetup
    from tokenswift.testing import TINY_CONFIGS

    assert "tokenswift.pipeline" not in import_graph()["tokenswift.decoding"]
    pipe = Pipeline.from_spec({"preset": "tokenswift", "drafter": {"heads": "random"}, "cache": {"budget": 24, "sink": 2},
                               "model": {"tiny": TINY_CONFIGS["llama-gqa"]}, "speculation": {"tree": "fixed"}})
    run = pipe.start([1, 2, 3, 4], 12, seed=0, ignore_eos=True)
    # Prepared before any step: the KV store sized for the run, the policy chosen.
    assert pipe.runner.store.capacity == pipe.kv_capacity(4, 12) and pipe.runner.committed_length == 0
    assert isinstance(run.setup, DecodingSetup) and run.setup.speculator.costs is None  # fixed trees: no costs
    assert not any(value is pipe for value in vars(run).values())
    assert len(list(run.steps())) > 0
