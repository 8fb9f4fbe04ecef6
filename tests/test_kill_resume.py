"""A run killed with SIGKILL mid-generation resumes from its checkpoint exactly."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tokenswift.checkpoint import Checkpoint


# float64: in float32 a tree's rows and a resumed run's prefill round otherwise than the
# uninterrupted run's steps, and with the paper's sampling a near-tie parted the two runs in
# 3 of 9-10 tries on a 2-core Sapphire Rapids (at the code of 2026-12-07 before and after
# that day's changes alike); in float64, 8 of 8 equal. What this tests is the checkpoint.
def generate_cmd(model_dir, out, sampling, *extra):
    cmd = [sys.executable, "-m", "tokenswift.cli", "generate", "--preset", "tokenswift", "--model", str(model_dir),
           "--dtype", "float64", "--prompt", "the cat sat on the mat", "--max-new-tokens", "700", "--seed", "4",
           "--ignore-eos", "--out", str(out), "--checkpoint-every", "25", "--quiet", *extra]
    return cmd + ([] if sampling else ["--greedy"])


def env():
    return {**os.environ, "TOKENSWIFT_DISABLE_PLUGINS": "all", "OMP_NUM_THREADS": "1"}


# Greedy resumes through the same checkpoint and restore code with no sampler state:
# the sampled run covers it too and runs by default (each variant ~30-40 s of
# subprocesses on a 2-core AVX2 CPU); `python -m pytest -m slow` runs greedy as well.
@pytest.mark.parametrize("sampling", [pytest.param(False, marks=pytest.mark.slow), True], ids=["greedy", "sampling"])
def test_kill_9_then_resume_equals_the_uninterrupted_run(model_dir, tmp_path, sampling):
    # The uninterrupted reference runs beside the killed run and its resume (one thread
    # each, on a 2-core machine): the test takes the longer of the two, not their sum.
    reference = tmp_path / "reference.txt"
    uninterrupted = subprocess.Popen(generate_cmd(model_dir, reference, sampling), env=env())
    try:
        out = tmp_path / "out.txt"
        ckpt = tmp_path / "out.txt.ckpt"
        process = subprocess.Popen(generate_cmd(model_dir, out, sampling), env=env())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if ckpt.exists() and len(Checkpoint.load(ckpt).tokens) >= 100:
                break
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        partial = Checkpoint.load(ckpt)
        assert 100 <= len(partial.tokens) < 700 and not partial.done, "the kill must land mid-run"

        subprocess.run(generate_cmd(model_dir, out, sampling, "--resume"), check=True, env=env(), timeout=300)
        assert uninterrupted.wait(timeout=300) == 0
    finally:
        uninterrupted.kill()
    expected = Checkpoint.load(f"{reference}.ckpt")
    assert expected.done and len(expected.tokens) == 700
    final = Checkpoint.load(ckpt)
    assert final.done and final.tokens == expected.tokens
    assert out.read_text() == reference.read_text()


def test_sigterm_stops_cleanly_with_everything_written(model_dir, tmp_path):
    out = tmp_path / "out.txt"
    ckpt = tmp_path / "out.txt.ckpt"
    process = subprocess.Popen(generate_cmd(model_dir, out, True), env=env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (ckpt.exists() and len(Checkpoint.load(ckpt).tokens) >= 50):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert "interrupted after" in err and "--resume --out" in err and "Traceback" not in err
    saved = Checkpoint.load(ckpt)
    assert saved.finish_reason == "interrupted" and len(saved.tokens) >= 50


def test_resume_without_out_is_a_clear_error(capsys):
    from tokenswift.cli import main

    assert main(["generate", "--resume"]) == 2
    assert "--resume needs --out FILE" in capsys.readouterr().err
