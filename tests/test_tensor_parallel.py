"""Tensor parallelism on CPU: two gloo processes under torchrun equal one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tp_worker import CASES, run_case
from tokenswift.cli import main as cli_main
from tokenswift.errors import ModelLoadError
from tokenswift.model.loading import _load_pretrained

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


def torchrun(*args, log_dir=None, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir), "--redirects", "3"]  # each rank's stdout/stderr in its own file
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENSWIFT_DISABLE_PLUGINS": "all"}
    return subprocess.run(cmd + list(args), env=env, capture_output=True, text=True, timeout=timeout)


def rank_log(log_dir: Path, rank: int, stream: str) -> str:
    (path,) = log_dir.glob(f"**/attempt_0/{rank}/{stream}.log")
    return path.read_text()


def failure_report(done, log_dir: Path) -> str:
    """torchrun's own stderr says only that a rank died; what the ranks printed says why."""
    ranks = [f"--- rank {r} {s} ---\n{path.read_text()[-2000:]}"
             for r in (0, 1) for s in ("stderr", "stdout")
             for path in log_dir.glob(f"**/attempt_0/{r}/{s}.log")]
    return "\n".join([done.stderr[-2000:], *ranks])


def test_two_processes_generate_what_one_process_generates(model_dir, tmp_path):
    out = tmp_path / "tp"
    worker = Path(__file__).with_name("tp_worker.py")
    done = torchrun(str(worker), str(model_dir), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for name in CASES:
        single = run_case(name, str(model_dir))
        assert single["kv_heads"] == 2
        for r in ranks:
            assert r[name]["kv_heads"] == 1, "each rank caches its own KV head only"
            assert r[name]["tokens"] == single["tokens"], f"{name}: rank output differs from one process"
    assert ranks[0]["tokenswift"]["tokens_per_step"] > 1.0, "drafts must really be accepted under TP"


def test_cli_under_torchrun_writes_from_rank_0_only(model_dir, tmp_path):
    common = ["generate", "--preset", "tokenswift", "--model", str(model_dir), "--dtype", "float32",
              "--prompt", "the cat sat on the mat", "--max-new-tokens", "40", "--seed", "5", "--ignore-eos",
              "--checkpoint-every", "8"]
    single_out = tmp_path / "single.txt"
    # the one-process reference in this process (a third fresh interpreter cost ~7 s)
    assert cli_main([*common, "--out", str(single_out), "--quiet"]) == 0

    out, logs = tmp_path / "tp.txt", tmp_path / "logs"
    done = torchrun("-m", "tokenswift.cli", *common, "--out", str(out), log_dir=logs)
    assert done.returncode == 0, failure_report(done, logs)
    assert out.read_text() == single_out.read_text() and out.read_text().strip()
    assert json.loads(Path(f"{out}.ckpt").read_text())["tokens"] == json.loads(Path(f"{single_out}.ckpt").read_text())["tokens"]
    assert "new_tokens=40" in rank_log(logs, 0, "stderr")
    assert rank_log(logs, 1, "stdout") == "" and "new_tokens" not in rank_log(logs, 1, "stderr")


def test_heads_that_do_not_divide_by_the_world_size_are_refused(model_dir):
    with pytest.raises(ModelLoadError, match=r"over 3 processes.*4 attention heads and 2 KV heads"):
        _load_pretrained(model_dir, torch.float32, None, tp_size=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only case")
def test_a_device_other_than_the_machines_accelerator_is_refused_under_torchrun():
    from tokenswift.distributed import check_device_type

    check_device_type(torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=r"split over this machine's cpu devices.*'cuda'"):
        check_device_type(torch.device("cuda"))
