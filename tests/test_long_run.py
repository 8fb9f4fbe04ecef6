"""benchmarks/long_run.py on a tiny model: blocks, memory bound, plot, resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "long_run.py"


def run(*args):
    env = {**os.environ, "TOKENSWIFT_DISABLE_PLUGINS": "all"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


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
    assert record["peak_rss_mib"] <= record["bound_mib"]
    assert record["summary"]["new_tokens"] == 120 and "rope yarn:4" in record["title"]
    assert (out / "long_run.png").stat().st_size > 10_000
    assert "| 120 |" in (out / "long_run.md").read_text()

    # A finished run resumed is a no-op that keeps its blocks.
    again = run("--out", str(out), "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert [b["generated"] for b in json.loads((out / "long_run.json").read_text())["blocks"]] == ends
