import os
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Converted demo models go to a per-session cache, not the user's.
os.environ["TOKENSWIFT_CACHE"] = tempfile.mkdtemp(prefix="tokenswift-test-cache-")
# The CPU kernels are built once (~40 s on two cores) into the user's kernel cache, keyed
# by their source, torch and the CPU, and reused by every test and subprocess, including
# those that point TOKENSWIFT_CACHE at a folder of their own.
os.environ.setdefault("TOKENSWIFT_KERNEL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tokenswift", "kernels"))
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Compiled graphs are compiled in each test, not loaded from the graph store that an
# earlier test filled (tokenswift.model.graph_store); tests/test_graph_store.py turns it on.
os.environ["TOKENSWIFT_GRAPH_STORE"] = "0"


@pytest.fixture(autouse=True)
def _no_plugins(monkeypatch):
    """Tests see the built-ins only, unless a test installs plugins itself."""
    monkeypatch.setenv("TOKENSWIFT_DISABLE_PLUGINS", "all")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A saved tiny Llama (GQA, float32) with a word-level tokenizer, for CLI runs."""
    from tokenswift.testing import tiny_model_for, word_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    tiny_model_for("llama-gqa", "float32").save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path
