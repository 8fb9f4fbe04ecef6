"""benchmarks/long_run.py on a tiny model: blocks, memory bound, plot, resume."""

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "long_run.py"


def run(*args):
    env = {**os.environ, "TOKENSWIFT_DISABLE_PLUGINS": "all"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


@functools.cache
def _script():
    spec = importlib.util.spec_from_file_location("long_run_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_here(*args) -> int:
    """The script's main in this process (a fresh interpreter costs ~6 s of imports on a
    2-core CPU): for the runs whose resident memory the test does not read."""
    return _script().main(list(args))


def test_long_run_records_every_block_within_the_memory_bound(model_dir, tmp_path):
    out = tmp_path / "long"
    done = run("--model", str(model_dir), "--dtype", "float32", "--heads", "random", "--prompt-tokens", "24",
               "--new-tokens", "120", "--block", "40", "--rope", "yarn:4", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((out / "long_run.json").read_text())
    ends = [b["generated"] for b in record["blocks"]]  # a block ends with the step that crosses its boundary
    assert len(ends) == 3 and ends[-1] == 120 and all(40 * (i + 1) <= end < 40 * (i + 1) + 8 for i, end in enumerate(ends))
    assert all(0 < b["draft_ms_per_token"] < b["ms_per_token"] for b in record["blocks"])
    assert all(b["machine"] and "commit" in b for b in record["blocks"])  # a resumed run may span machines
    # each block shows the mechanism and the text: tokens a step by source, distinct-n and the self-NLL
    for b in record["blocks"]:
        assert b["tokens_per_step"] >= 1 and 0 <= b["drafter_tokens_per_step"] + b["retriever_tokens_per_step"] < b["tokens_per_step"]
        assert all(0 < b[f"distinct_{n}"] <= 1 for n in (1, 2, 3, 4))
        assert b["recent_self_nll"] > 0
        # and where resident memory goes: malloc's heaps in use and freed
        if b["malloc_in_use_mib"] is not None:  # glibc 2.33+
            assert b["malloc_in_use_mib"] > 0 and b["malloc_free_mib"] >= 0
    assert "distinct-4" in (out / "long_run.md").read_text()
    assert record["peak_rss_mib"] <= record["bound_mib"]
    assert record["summary"]["new_tokens"] == 120 and "rope yarn:4" in record["title"]
    assert (out / "long_run.png").stat().st_size > 10_000
    assert "| 120 |" in (out / "long_run.md").read_text() and "120 new tokens in " in (out / "long_run.md").read_text()

    # A finished run resumed is a no-op that keeps its blocks, and the highest peak of
    # its sessions (an earlier session's peak stands for itself).
    record["peak_rss_mib"] = 99999.0
    (out / "long_run.json").write_text(json.dumps(record))
    assert run_here("--out", str(out), "--resume") == 0
    resumed = json.loads((out / "long_run.json").read_text())
    assert [b["generated"] for b in resumed["blocks"]] == ends and resumed["peak_rss_mib"] == 99999.0

    # ar sampled at points of the run, from its own checkpoint: the same model and
    # sampler draw the run's own tokens there (the run is lossless), and are timed.
    assert run_here("--out", str(out), "--ar-at", "0,40,100", "--ar-tokens", "8") == 0
    record = json.loads((out / "long_run.json").read_text())
    assert [b["generated"] for b in record["blocks"]] == ends
    samples = record["ar"]
    assert [a["generated"] for a in samples] == [0, 40, 100]
    assert all(a["tokens"] == 8 and a["ms_per_token"] > 0 and a["machine"] for a in samples)
    assert all(a["same"] == a["compared"] == 12 for a in samples)
    assert "| 100 |" in (out / "long_run.md").read_text().split("sampled from the run's checkpoint")[1]

    # a point past what the run generated: a clear error, the record untouched
    with pytest.raises(SystemExit) as beyond:  # the message is all the user sees: no traceback
        run_here("--out", str(out), "--ar-at", "40,500")
    assert "500" in str(beyond.value.code) and "0..120" in str(beyond.value.code)
    assert json.loads((out / "long_run.json").read_text())["ar"] == samples
